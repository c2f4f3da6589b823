"""Checkpointing: :class:`CheckpointEngine` and the trainer/writer processes behind it.

- :mod:`._engine`: the trainer's side (stage, save, commit, load orchestration);
- :mod:`._stager`: ``stage()`` and its pipeline; :mod:`._copy`: the staging copy threads;
- :mod:`._commit`: the committed tags, publishing and retention;
- :mod:`._plan`: validation, the pickled skeleton and the version counters;
- :mod:`._staging`: the shared-memory segments and slots staged tensors live in;
- :mod:`._writer`: the writer service, run in the worker process;
- :mod:`._store`: the on-disk format (manifest, publish, ``latest``, retention, load).
"""

from ._commit import CommitResult as CommitResult
from ._engine import CheckpointEngine as CheckpointEngine
from ._load import load_checkpoint as load_checkpoint
from ._stager import Staged as Staged

__all__ = ("CheckpointEngine", "CommitResult", "Staged", "load_checkpoint")
