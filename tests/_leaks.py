"""Counting what a test may leave behind: child processes, fds, threads, /dev/shm entries."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path


def _stat(pid: int | str) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state, ppid, ...), or None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def child_pids() -> set[int]:
    """Live children of this process (zombies excluded)."""
    pids: set[int] = set()
    listed = False
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            text = (task / "children").read_text()
        except OSError:
            continue
        listed = True
        pids.update(int(pid) for pid in text.split())
    if not listed:  # kernels without .../children (gVisor): find children by their ppid
        me = str(os.getpid())
        for entry in Path("/proc").iterdir():
            fields = _stat(entry.name) if entry.name.isdigit() else None
            if fields is not None and fields[1] == me:
                pids.add(int(entry.name))
    alive = set()
    for pid in pids:
        fields = _stat(pid)
        if fields is not None and fields[0] != "Z":
            alive.add(pid)
    return alive


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
        shm = frozenset(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else frozenset()
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
