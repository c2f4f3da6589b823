"""torch's build lock of DeepSpeed's op, and the lock a dead build leaves (worker side).

torch's ``load()`` builds an extension under a lock: it creates ``<build directory>/lock``
(``O_CREAT | O_EXCL``), keeps the file open while ninja builds, then closes and removes it;
every other process that loads the extension meanwhile polls until the file is gone. A
builder killed mid-way (a worker past its ``start_timeout``, a Ctrl-C) leaves the file
behind, and from then on every load waits for it forever, with no compiler running.

The file records no owner, but the owner keeps it open, and ninja's compilers run in the
build directory. So a lock that no process of this host holds open, while no process works
in its directory, is a dead build's: :func:`clear_stale_lock` removes it and says so. A
lock held open is a live build's: torch waits for it, and that is said too. Compilers that
outlived their builder are waited for (their exit wakes the wait: a pidfd per process),
then the lock is removed. Only processes this user may inspect are seen: a lock created by
another user is left alone, with a warning naming it.
"""

from __future__ import annotations

import logging
import os
import select
from dataclasses import dataclass

__all__ = ["Holders", "clear_stale_lock", "holders"]

logger = logging.getLogger(__name__)

LOCK = "lock"
"""The lock's name in the build directory (torch's ``FileBaton``)."""


@dataclass(frozen=True, slots=True)
class Holders:
    """Who keeps a build lock alive: processes that hold it open, processes that work in
    its directory (compilers, ninja)."""

    openers: frozenset[int]
    workers: frozenset[int]

    def __bool__(self) -> bool:
        return bool(self.openers or self.workers)


def _inode(path: str) -> tuple[int, int] | None:
    try:
        status = os.stat(path)
    except FileNotFoundError:
        return None
    return status.st_dev, status.st_ino


def holders(directory: str) -> Holders:
    """The processes of this host, but this one, that keep ``directory``'s lock alive."""
    target = _inode(os.path.join(directory, LOCK))
    openers, workers = set(), set()
    inside = os.path.realpath(directory) + os.sep
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            if (os.readlink(f"/proc/{name}/cwd") + os.sep).startswith(inside):
                workers.add(int(name))
            if target is not None:
                for fd in os.listdir(f"/proc/{name}/fd"):
                    if _inode(f"/proc/{name}/fd/{fd}") == target:
                        openers.add(int(name))
                        break
        except OSError:
            continue  # gone meanwhile, or not ours to inspect
    return Holders(frozenset(openers), frozenset(workers))


def _wait_for_exit(pids: frozenset[int]) -> None:
    """Block until every process of ``pids`` has exited (woken by their pidfds)."""
    fds = []
    try:
        for pid in pids:
            try:
                fds.append(os.pidfd_open(pid))
            except ProcessLookupError:
                continue  # already gone
        while fds:
            ready, _, _ = select.select(fds, [], [])
            for fd in ready:
                fds.remove(fd)
                os.close(fd)
    finally:
        for fd in fds:
            os.close(fd)


def clear_stale_lock(directory: str, *, wait: bool) -> bool:
    """Remove ``directory``'s build lock if its builder is dead; whether no lock is left.

    A lock held open is a live build's: it stays (``False``; torch waits for it, which is
    said when ``wait``). One whose builder is dead but whose compilers still run stays too
    unless ``wait``: then they are waited for first. Without ``/proc`` (not Linux) nothing
    can be told: ``False``.
    """
    lock = os.path.join(directory, LOCK)
    while True:
        inode = _inode(lock)
        if inode is None:
            return True
        if not os.path.isdir("/proc"):
            return False
        owner = os.stat(lock).st_uid
        if owner != os.geteuid() and os.geteuid() != 0:
            logger.warning(
                "%s belongs to user %d, whose processes this one cannot inspect: if no build "
                "of DeepSpeed's CPU Adam op runs on this host, remove it",
                lock,
                owner,
            )
            return False
        found = holders(directory)
        if found.openers:
            if wait:
                logger.warning(
                    "a build of DeepSpeed's CPU Adam op is under way in %s (process %s holds "
                    "its lock): waiting for it",
                    directory,
                    ", ".join(map(str, sorted(found.openers))),
                )
            return False
        if found.workers:
            if not wait:
                return False
            logger.warning(
                "the build that left %s is gone, but processes still work in %s (%s, its "
                "compilers): waiting for them to end",
                lock,
                directory,
                ", ".join(map(str, sorted(found.workers))),
            )
            _wait_for_exit(found.workers)
            continue
        # Its owner may be between closing the lock and removing it: a second look (a
        # scan of every process, far longer than those two calls) tells.
        if holders(directory) or _inode(lock) != inode:
            continue
        try:
            os.remove(lock)
        except FileNotFoundError:
            return True
        logger.warning(
            "removed %s: the build of DeepSpeed's CPU Adam op that held it is gone (no "
            "process holds it or works in %s)",
            lock,
            directory,
        )
        return True
