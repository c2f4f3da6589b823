"""The directory locks: which checkpoint directories have a live engine, and which writes.

``DIR/.aoffload.lock`` is an ``flock``-ed file. Every live writing engine holds it shared
(``LOCK_SH``) for its whole life, so the ranks of one job can share a directory.
``aoffload clean`` takes it exclusive and non-blocking: it gets it only when no engine is
live, and then holds off engines that start meanwhile. The kernel drops a process's locks
when it dies, so a crashed run never leaves the directory locked.

``DIR/.aoffload.writer`` makes one engine *the* writer of a directory: the process that
publishes (a single-process engine that writes, or rank 0 of a distributed engine) holds
it exclusive for its whole life, and writes its pid and host into it. A second engine
that would publish there refuses to start, naming the holder: two writers would number
their tags alike, retire only their own and could rewrite each other's tags. Replicas
(``writer=False``) and the other ranks of the writer's own job take no writer lock.

An engine that gets the lock exclusive at start is the only one there: it may remove
leftovers of dead runs before it settles for a shared hold. The file itself is never
removed (removing an flock-ed file lets two processes lock two different files).
The calls block (briefly, while a ``clean`` runs): run them off the event loop.
"""

from __future__ import annotations

import fcntl
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ..._errors import CheckpointError

__all__ = ["LOCK_FILE", "WRITER_FILE", "DirectoryLock", "hold_shared", "try_exclusive"]

T = TypeVar("T")

LOCK_FILE = ".aoffload.lock"
"""The lock's file name inside a checkpoint directory."""
WRITER_FILE = ".aoffload.writer"
"""The writer lock's file name inside a checkpoint directory."""


class DirectoryLock:
    """``flock``s on files of a checkpoint directory, released by :meth:`release`."""

    def __init__(self, path: Path, fd: int, *, sole: bool, writer: int | None = None) -> None:
        self.path = path
        self.sole = sole
        """Whether no other engine held the lock when this one was taken."""
        self._fds: list[int] = [fd] if writer is None else [fd, writer]

    def release(self) -> None:
        """Drop the locks (closing their files). Idempotent."""
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)


def _open(directory: Path, name: str = LOCK_FILE) -> tuple[Path, int]:
    path = directory / name
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW  # a planted link: ELOOP
    return path, os.open(path, flags, 0o644)


def _hold_writer(directory: Path) -> int:
    """The writer lock of ``directory``; :class:`CheckpointError` naming the engine that
    holds it when another live one does."""
    path, fd = _open(directory, WRITER_FILE)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "pid unknown"
            raise CheckpointError(
                f"another live checkpoint engine ({holder}) writes in {directory}: one engine "
                "writes in a checkpoint directory at a time (it holds "
                f"{path}). Close it first, use another directory, or open this one with "
                "writer=False to read it"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def hold_shared(
    directory: Path, first: Callable[[bool], T], *, writer: bool = False
) -> tuple[DirectoryLock, T]:
    """A live engine's hold on ``directory``, and what ``first(sole)`` returned.

    ``first`` runs before the hold becomes shared: under the exclusive lock when no other
    engine holds it (``sole=True``, so it may remove leftovers), else under the shared one.
    ``writer`` also takes the writer lock first: the engine that publishes in
    ``directory`` (:class:`CheckpointError` if another live engine does).
    """
    held = _hold_writer(directory) if writer else None
    try:
        path, fd = _open(directory)
    except BaseException:
        if held is not None:
            os.close(held)
        raise
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
        if held is not None:
            os.close(held)
        raise
    return DirectoryLock(path, fd, sole=sole, writer=held), result


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
