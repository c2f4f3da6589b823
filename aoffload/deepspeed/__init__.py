"""DeepSpeed adapters: aoffload's workers behind DeepSpeed's synchronous interfaces.

Import this module explicitly (``import aoffload.deepspeed``); ``import aoffload`` never imports
DeepSpeed. Both adapters own a private event loop on a daemon thread (a *portal*): their
synchronous methods submit coroutines to it and re-raise aoffload's exceptions in the caller's
thread. See ``docs/deepspeed.md`` for how to install them and why ``latest`` stays truthful.

- :class:`AsyncCheckpointEngine` is a DeepSpeed ``CheckpointEngine`` backed by
  :class:`aoffload.CheckpointEngine`; :func:`install` puts it on a ``DeepSpeedEngine``.
- :class:`SuperOffloadCPUOptimizer` is a drop-in for DeepSpeed's class of that name backed by
  :class:`aoffload.CPUAdam`; :func:`install_superoffload` puts it under a SuperOffload stage-3
  optimizer.
"""

from ._checkpoint import AsyncCheckpointEngine as AsyncCheckpointEngine
from ._checkpoint import install as install
from ._superoffload import SuperOffloadCPUOptimizer as SuperOffloadCPUOptimizer
from ._superoffload import install_superoffload as install_superoffload

__all__ = (
    "AsyncCheckpointEngine",
    "SuperOffloadCPUOptimizer",
    "install",
    "install_superoffload",
)
