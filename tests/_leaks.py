"""Counting what a test may leave behind: workers and child processes, fds, threads, /dev/shm
entries. The worker servers of this process, their sockets and their listener threads live as
long as the process by design (the first start of a session starts one): none is counted."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from aoffload._runtime import census, launcher
from aoffload._runtime.census import SHM_DIR

__all__ = ["Snapshot", "child_pids"]


def child_pids() -> set[int]:
    """Live workers and other children of this process (see :func:`census.worker_pids`),
    but multiprocessing's forkserver, which tests/_ranks.py keeps for the whole session."""
    from multiprocessing import forkserver

    server = getattr(forkserver._forkserver, "_forkserver_pid", None)
    return census.worker_pids() - {server}


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
        shm = frozenset(name for name in names if name.startswith("aoffload-"))
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
