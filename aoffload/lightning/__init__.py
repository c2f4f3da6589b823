"""Lightning integration: :class:`AsyncCheckpointIO`, a ``CheckpointIO`` plugin.

Import it explicitly (``from aoffload.lightning import AsyncCheckpointIO``); ``import
aoffload`` never imports Lightning. Install with ``pip install "aoffload[lightning]"``.
See ``docs/lightning.md``.
"""

from ._checkpoint_io import AsyncCheckpointIO as AsyncCheckpointIO

__all__ = ("AsyncCheckpointIO",)
