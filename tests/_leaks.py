"""Counting what a test may leave behind: workers and child processes, fds, threads, /dev/shm
entries. The worker servers of this process, their sockets and their listener threads live as
long as the process by design (the first start of a session starts one): none is counted."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from aoffload._runtime import census, launcher
from aoffload._runtime.census import SHM_DIR

__all__ = ["BACKGROUND", "Snapshot", "child_pids"]

BACKGROUND: set[int] = set()
"""Processes started beside the tests (the suite's background benchmark): what their trees
put in /dev/shm is theirs, not a leak of the test that happens to run meanwhile."""


def child_pids() -> set[int]:
    """Live workers and other children of this process (see :func:`census.worker_pids`),
    but multiprocessing's forkserver, which tests/_ranks.py keeps for the whole session."""
    from multiprocessing import forkserver

    server = getattr(forkserver._forkserver, "_forkserver_pid", None)
    return census.worker_pids() - {server}


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return int(stat.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _ours(name: str) -> bool:
    """Whether /dev/shm entry ``name`` (``aoffload-<pid>-...`` or ``aoffload-load-<pid>-...``)
    may be this process's or its workers': a process of this tree, or one gone (its
    leftovers are what a leak looks like), but not another live process's, nor the
    background benchmark's tree's."""
    parts = name.split("-")
    digits = parts[2] if len(parts) > 2 and parts[1] == "load" else parts[1]
    if not digits.isdigit():
        return True
    pid, me = int(digits), os.getpid()
    while pid > 1:
        if pid == me:
            return True
        if pid in BACKGROUND:
            return False
        parent = _parent(pid)
        if parent is None:
            return pid == int(digits)  # the entry's own process is gone: count it
        pid = parent
    return False


def _fds() -> int:
    servers = {server.fileno for server in launcher.servers()}
    return len({int(fd) for fd in os.listdir("/proc/self/fd")} - servers)


def _threads() -> int:
    return sum(1 for t in threading.enumerate() if not t.name.startswith("aoffload-server-"))


@dataclass(frozen=True)
class Snapshot:
    """What this process holds at one instant."""

    children: frozenset[int]
    fds: int
    threads: int
    shm: frozenset[str]
    idents: frozenset[int] = frozenset()

    @classmethod
    def take(cls) -> Snapshot:
        """Read the counts now."""
        # Only aoffload's names: other processes of a shared machine come and go in /dev/shm.
        names = os.listdir(SHM_DIR) if os.path.isdir(SHM_DIR) else []
        shm = frozenset(name for name in names if name.startswith("aoffload-") and _ours(name))
        return cls(
            children=frozenset(child_pids()),
            fds=_fds(),
            threads=_threads(),
            shm=shm,
            idents=frozenset(t.ident for t in threading.enumerate() if t.ident is not None),
        )

    def leaked_since(self, before: Snapshot) -> list[str]:
        """Describe what grew between ``before`` and this snapshot."""
        problems = []
        if self.children - before.children:
            problems.append(f"child processes {sorted(self.children - before.children)}")
        if self.fds > before.fds:
            problems.append(f"{self.fds - before.fds} file descriptors")
        if self.threads > before.threads:
            # aoffload's threads that were already on their way out (their work resolved the
            # future the test awaited) get a few seconds to end; what stays is a leak.
            new = [t for t in threading.enumerate() if t.ident not in before.idents]
            server = "aoffload-server-"
            for thread in new:
                if thread.name.startswith("aoffload") and not thread.name.startswith(server):
                    thread.join(timeout=5.0)
            left = [t.name for t in new if t.is_alive() and not t.name.startswith(server)]
            if _threads() > before.threads:
                problems.append(f"{_threads() - before.threads} threads ({', '.join(left)})")
        if self.shm - before.shm:
            problems.append(f"/dev/shm entries {sorted(self.shm - before.shm)}")
        return problems
