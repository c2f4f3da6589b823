"""Checkpointing: :class:`CheckpointEngine` and the threads and processes behind it.

A small core with roles plugged in, by room:

- :mod:`._engine`: the face (``CheckpointEngine``: ``with`` and ``async with``, handles to
  ``await`` or ``.result()``), :mod:`._staged` (``Staged``), :mod:`._api`
  (``load_checkpoint``, ``load_metadata``), :mod:`._options` (the options, validated once);
- :mod:`._assemble`: options in, the core and its roles out; the only importer of the roles;
- ``core/``: the engine of one process writing one directory, with no feature flags; the
  :class:`~.core.roles.Coordinator` and :class:`~.core.roles.Tier` protocols it is handed;
- ``format/``: the on-disk format alone (no torch): what the command line reads;
- ``writer/``: the writer process (imports nothing of the trainer's side);
- the roles: ``ranks/`` (a coordinator: every rank of a job), ``remote/`` (a tier: uploads,
  resume from an object store; its uploader process in ``remote/worker/``), ``preemption/``
  (the notice, and the ranks agreeing on its step).

Import direction: ``format`` <- ``core`` <- roles <- ``_assemble`` <- faces; the test
``tests/test_layering.py`` keeps it so.
"""

from __future__ import annotations

import typing as _typing

from .._lazy import exports as _exports

# Imported on first use (PEP 562): the command line reads the format (format/) without
# importing torch.
if _typing.TYPE_CHECKING:
    from ._api import load_checkpoint as load_checkpoint
    from ._api import load_metadata as load_metadata
    from ._engine import CheckpointEngine as CheckpointEngine
    from ._engine import CommitResult as CommitResult
    from ._engine import PreemptionNotice as PreemptionNotice
    from ._engine import Staged as Staged
else:
    _LAZY = {
        "CommitResult": "._engine",
        "CheckpointEngine": "._engine",
        "Staged": "._engine",
        "load_checkpoint": "._api",
        "load_metadata": "._api",
        "PreemptionNotice": "._engine",
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
