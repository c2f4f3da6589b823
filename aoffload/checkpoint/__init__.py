"""Checkpointing: :class:`CheckpointEngine` and the threads and writer process behind it.

The trainer's side, by role:

- :mod:`._engine`: the asyncio face (``CheckpointEngine``, ``Staged``);
- :mod:`._core`: the engine itself, synchronous and thread-safe (also what the DeepSpeed
  adapter uses), and which thread does what;
- :mod:`._tags`: the one owner of the tags in flight and their staging slots;
- :mod:`._pipeline`: ``stage()`` to the writer, on threads (:mod:`._plan`, :mod:`._copy`,
  :mod:`._staging`);
- :mod:`._commit`: a commit, on the commit thread, and the catalog of committed tags;
  :mod:`._distributed` and :mod:`._ranks`: the same across every rank;
- :mod:`._upload`: the remote tier (``remote=``): uploads in commit order; :mod:`._resume`:
  both tiers as one catalog, verified downloads;
  :mod:`._spread`: ranks without a shared filesystem;
- :mod:`._preemption`: the preemption notice; :mod:`._agreement`: the ranks agreeing on its step;
- :mod:`._load`: verified loads; :mod:`._lock`: the directory lock;
- :mod:`._format`: the on-disk format alone (no torch): manifest, ``latest``, scan,
  publish, verify; :mod:`._inspect`: what the command line shows.

The writer process's side is :mod:`.writer`; nothing there imports the trainer's side.
The uploader process's side is :mod:`.remote` (it reads the format, :mod:`._format`).
"""

from __future__ import annotations

import typing as _typing

from .._lazy import exports as _exports

# Imported on first use (PEP 562): the command line reads the format (_format, _inspect)
# without importing torch.
if _typing.TYPE_CHECKING:
    from ._engine import CheckpointEngine as CheckpointEngine
    from ._engine import Staged as Staged
    from .core.commit import CommitResult as CommitResult
    from .core.load import load_checkpoint as load_checkpoint
    from .core.load import load_metadata as load_metadata
    from .preemption.notice import PreemptionNotice as PreemptionNotice
else:
    _LAZY = {
        "CommitResult": ".core.commit",
        "CheckpointEngine": "._engine",
        "Staged": "._engine",
        "load_checkpoint": ".core.load",
        "load_metadata": ".core.load",
        "PreemptionNotice": ".preemption.notice",
    }

    __getattr__, __dir__ = _exports(__name__, globals(), _LAZY)


__all__ = (
    "CheckpointEngine",
    "CommitResult",
    "PreemptionNotice",
    "Staged",
    "load_checkpoint",
    "load_metadata",
)
