"""The engines running in this process, by directory: how ``aoffload.dcp.StorageWriter``
finds the engine it writes through when it is not handed one."""

from __future__ import annotations

import threading
import weakref
from pathlib import Path
from typing import Any, Protocol

from .format.layout import is_url

__all__ = ["Running", "add", "discard", "running"]


class Running(Protocol):
    """What the registry knows of an engine (a protocol: the engine imports this module)."""

    _remote: str | None

    @property
    def directory(self) -> Path:
        """The engine's checkpoint directory."""

    @property
    def dcp(self) -> Any:
        """The engine's DCP face."""


_engines: weakref.WeakSet[Running] = weakref.WeakSet()
_lock = threading.Lock()


def add(engine: Running) -> None:
    """``engine`` started."""
    with _lock:
        _engines.add(engine)


def discard(engine: Running) -> None:
    """``engine`` is closing."""
    with _lock:
        _engines.discard(engine)


def running(location: str) -> Running | None:
    """The engine of this process running on ``location``, if any: its directory (compared
    resolved), or the URL of its remote tier."""
    with _lock:
        engines = list(_engines)
    if is_url(location):
        url = location.rstrip("/")
        return next((e for e in engines if (e._remote or "").rstrip("/") == url), None)
    target = Path(location).resolve()
    return next((e for e in engines if e.directory.resolve() == target), None)
