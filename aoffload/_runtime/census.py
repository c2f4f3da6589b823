"""Counting what an aoffload object may leave behind: child processes and staging segments.

Linux only (``/proc``); used by :mod:`aoffload.testing` to fail a test whose worker or
``/dev/shm`` segment outlives it.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["SHM_DIR", "child_pids", "is_resource_tracker", "staging_segments"]

SHM_DIR = "/dev/shm"
_SEGMENT_PREFIX = "aoffload-"  # the staging segments' names (checkpoint/_staging.py)


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


def is_resource_tracker(pid: int) -> bool:
    """Whether ``pid`` is multiprocessing's resource tracker (started by the first spawn,
    it lives as long as the process that started it, by design)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"multiprocessing.resource_tracker" in cmdline


def staging_segments(pid: int | None = None) -> set[str]:
    """Names in ``/dev/shm`` of the staging segments process ``pid`` (default: this one) made."""
    prefix = f"{_SEGMENT_PREFIX}{os.getpid() if pid is None else pid}-"
    try:
        return {name for name in os.listdir(SHM_DIR) if name.startswith(prefix)}
    except FileNotFoundError:
        return set()
