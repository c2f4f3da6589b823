"""aoffload: background checkpointing and CPU optimizer offload for PyTorch and DeepSpeed.

The work runs on aoffload's threads and spawned worker processes; the trainer only learns
that it finished. Every call that waits returns a :class:`Handle`: an asyncio trainer
awaits it, a synchronous trainer calls ``.result()``. A wait ends when the work is done
or a worker dies.
"""

from __future__ import annotations

import typing as _typing

from ._errors import AoffloadError as AoffloadError
from ._errors import CheckpointError as CheckpointError
from ._errors import ClosedError as ClosedError
from ._errors import CorruptCheckpointError as CorruptCheckpointError
from ._errors import InvalidStateError as InvalidStateError
from ._errors import OptimizerError as OptimizerError
from ._errors import RemoteError as RemoteError
from ._errors import WorkerDiedError as WorkerDiedError
from ._errors import WorkerError as WorkerError
from ._errors import WorkerStartupError as WorkerStartupError
from ._lazy import exports as _exports
from ._runtime.handle import Handle as Handle
from ._runtime.loops import run as run

# The names below import torch: they are imported on first use (PEP 562), so that what
# needs none of them starts fast (the `aoffload` command: ls, verify, clean).
if _typing.TYPE_CHECKING:
    from .checkpoint import CheckpointEngine as CheckpointEngine
    from .checkpoint import CommitResult as CommitResult
    from .checkpoint import PreemptionNotice as PreemptionNotice
    from .checkpoint import Staged as Staged
    from .checkpoint import load_checkpoint as load_checkpoint
    from .checkpoint import load_metadata as load_metadata
    from .optimizer import CPUAdam as CPUAdam
    from .optimizer import OffloadAdam as OffloadAdam
    from .optimizer import StepKind as StepKind
    from .optimizer import StepReport as StepReport
    from .optimizer import StepResult as StepResult
else:
    from . import checkpoint as _checkpoint  # its names, not yet what they name (no torch)

    _LAZY = {
        **dict.fromkeys(_checkpoint.__all__, ".checkpoint"),
        **dict.fromkeys(
            ("CPUAdam", "OffloadAdam", "StepKind", "StepReport", "StepResult"), ".optimizer"
        ),
    }

    __getattr__, __dir__ = _exports(__name__, globals(), _LAZY)


__version__ = "0.1.0"

__all__ = (
    "AoffloadError",
    "CheckpointEngine",
    "CPUAdam",
    "CheckpointError",
    "ClosedError",
    "CommitResult",
    "CorruptCheckpointError",
    "Handle",
    "InvalidStateError",
    "OffloadAdam",
    "OptimizerError",
    "PreemptionNotice",
    "RemoteError",
    "Staged",
    "StepKind",
    "StepReport",
    "StepResult",
    "WorkerDiedError",
    "WorkerError",
    "WorkerStartupError",
    "load_checkpoint",
    "load_metadata",
    "run",
)
