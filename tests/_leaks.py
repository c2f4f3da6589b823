"""Counting what a test may leave behind: child processes, fds, threads, /dev/shm entries."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from aoffload._runtime import census
from aoffload._runtime.census import SHM_DIR

__all__ = ["Snapshot", "child_pids"]


def child_pids() -> set[int]:
    """Live children of this process, less multiprocessing's resource tracker.

    The tracker starts with the first spawn of the session and lives on by design, so a
    test that happens to run first would otherwise count it as a leak.
    """
    return {pid for pid in census.child_pids() if not census.is_resource_tracker(pid)}


@dataclass(frozen=True)
class Snapshot:
    """What this process holds at one instant."""

    children: frozenset[int]
    fds: int
    threads: int
    shm: frozenset[str]

    @classmethod
    def take(cls) -> Snapshot:
        """Read the counts now."""
        shm = frozenset(os.listdir(SHM_DIR)) if os.path.isdir(SHM_DIR) else frozenset()
        return cls(
            children=frozenset(child_pids()),
            fds=len(os.listdir("/proc/self/fd")),
            threads=threading.active_count(),
            shm=shm,
        )

    def leaked_since(self, before: Snapshot) -> list[str]:
        """Describe what grew between ``before`` and this snapshot."""
        problems = []
        if self.children - before.children:
            problems.append(f"child processes {sorted(self.children - before.children)}")
        if self.fds > before.fds:
            problems.append(f"{self.fds - before.fds} file descriptors")
        if self.threads > before.threads:
            problems.append(f"{self.threads - before.threads} threads")
        if self.shm - before.shm:
            problems.append(f"/dev/shm entries {sorted(self.shm - before.shm)}")
        return problems
