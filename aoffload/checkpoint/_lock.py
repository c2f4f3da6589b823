"""The directory lock: which checkpoint directories have a live engine.

``DIR/.aoffload.lock`` is an ``flock``-ed file. Every live writing engine holds it shared
(``LOCK_SH``) for its whole life, so several engines (the ranks of one job) can share a
directory. ``aoffload clean`` takes it exclusive and non-blocking: it gets it only when no
engine is live, and then holds off engines that start meanwhile. The kernel drops a
process's locks when it dies, so a crashed run never leaves the directory locked.

An engine that gets the lock exclusive at start is the only one there: it may remove
leftovers of dead runs before it settles for a shared hold. The file itself is never
removed (removing an flock-ed file lets two processes lock two different files).
The calls block (briefly, while a ``clean`` runs): run them off the event loop.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

__all__ = ["LOCK_FILE", "DirectoryLock", "hold_shared", "try_exclusive"]

T = TypeVar("T")

LOCK_FILE = ".aoffload.lock"
"""The lock's file name inside a checkpoint directory."""


class DirectoryLock:
    """An ``flock`` on ``directory/.aoffload.lock``, released by :meth:`release`."""

    def __init__(self, path: Path, fd: int, *, sole: bool) -> None:
        self.path = path
        self.sole = sole
        """Whether no other engine held the lock when this one was taken."""
        self._fd: int | None = fd

    def release(self) -> None:
        """Drop the lock (closing its file). Idempotent."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _open(directory: Path) -> tuple[Path, int]:
    path = directory / LOCK_FILE
    return path, os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)


def hold_shared(directory: Path, first: Callable[[bool], T]) -> tuple[DirectoryLock, T]:
    """A live engine's hold on ``directory``, and what ``first(sole)`` returned.

    ``first`` runs before the hold becomes shared: under the exclusive lock when no other
    engine holds it (``sole=True``, so it may remove leftovers), else under the shared one.
    """
    path, fd = _open(directory)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            sole = True
        except BlockingIOError:
            sole = False
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits out a `clean`, if one runs
        result = first(sole)
        if sole:
            fcntl.flock(fd, fcntl.LOCK_SH)
    except BaseException:
        os.close(fd)
        raise
    return DirectoryLock(path, fd, sole=sole), result


def try_exclusive(directory: Path) -> DirectoryLock | None:
    """The exclusive lock on ``directory``, or ``None`` while an engine holds it."""
    path, fd = _open(directory)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return DirectoryLock(path, fd, sole=True)
