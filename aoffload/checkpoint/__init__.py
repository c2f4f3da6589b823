"""Checkpointing: :class:`CheckpointEngine` and the threads and processes behind it.

A small core with roles plugged in; ``docs/architecture.md`` walks through the rooms, and
``tests/test_layering.py`` keeps the import direction: ``format`` <- ``core`` <- roles <-
``_assemble`` <- faces. The public names are imported on first use (``_names``).
"""

from __future__ import annotations

import typing as _typing

from ._names import __dir__ as __dir__
from ._names import __getattr__ as __getattr__

if _typing.TYPE_CHECKING:
    from ._api import load_checkpoint as load_checkpoint
    from ._api import load_metadata as load_metadata
    from ._engine import CheckpointEngine as CheckpointEngine
    from ._engine import CommitResult as CommitResult
    from ._engine import PreemptionNotice as PreemptionNotice
    from ._engine import Staged as Staged

__all__ = (
    "CheckpointEngine",
    "CommitResult",
    "PreemptionNotice",
    "Staged",
    "load_checkpoint",
    "load_metadata",
)
