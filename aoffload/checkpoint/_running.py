"""The engines running in this process, by directory: how ``aoffload.dcp.StorageWriter``
finds the engine it writes through when it is not handed one."""

from __future__ import annotations

import threading
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

from .format.layout import is_url

if TYPE_CHECKING:
    from ._engine import CheckpointEngine

__all__ = ["add", "discard", "running"]

_engines: weakref.WeakSet[CheckpointEngine] = weakref.WeakSet()
_lock = threading.Lock()


def add(engine: CheckpointEngine) -> None:
    """``engine`` started."""
    with _lock:
        _engines.add(engine)


def discard(engine: CheckpointEngine) -> None:
    """``engine`` is closing."""
    with _lock:
        _engines.discard(engine)


def running(location: str) -> CheckpointEngine | None:
    """The engine of this process running on ``location``, if any: its directory (compared
    resolved), or the URL of its remote tier."""
    with _lock:
        engines = list(_engines)
    if is_url(location):
        url = location.rstrip("/")
        return next((e for e in engines if (e._remote or "").rstrip("/") == url), None)
    target = Path(location).resolve()
    return next((e for e in engines if e.directory.resolve() == target), None)
