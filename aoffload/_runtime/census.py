"""Counting what an aoffload object may leave behind: worker processes and staging segments.

Linux only (``/proc``); used by :mod:`aoffload.testing` to fail a test whose worker or
``/dev/shm`` segment outlives it. Workers are forked by this process's worker servers
(:mod:`.forkserver`), so they are its grandchildren: :func:`worker_pids` counts this
process's children, the servers replaced by their own children. A server, like
multiprocessing's resource tracker, lives as long as this process by design and is never
counted itself.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "SHM_DIR",
    "child_pids",
    "is_resource_tracker",
    "is_worker_server",
    "staging_segments",
    "worker_pids",
]

SHM_DIR = "/dev/shm"
_SEGMENT_PREFIX = "aoffload-"  # the staging segments' names (checkpoint/_staging.py)
_SERVER_MARK = b"aoffload._runtime.forkserver"  # in a worker server's command line


def _stat(pid: int | str) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state, ppid, ...), or None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        fields = _stat(pid)
        if fields is not None and fields[0] != "Z":
            alive.add(pid)
    return alive


def _children_by_scan(parents: set[int]) -> dict[int, set[int]]:
    # Kernels without /proc/PID/task/TID/children (gVisor, some builds): one pass over /proc.
    wanted = {str(pid): pid for pid in parents}
    found: dict[int, set[int]] = {pid: set() for pid in parents}
    for entry in Path("/proc").iterdir():
        fields = _stat(entry.name) if entry.name.isdigit() else None
        if fields is not None and fields[1] in wanted:
            found[wanted[fields[1]]].add(int(entry.name))
    return found


def _children_of(parents: set[int]) -> dict[int, set[int]]:
    found: dict[int, set[int]] = {}
    for parent in parents:
        pids: set[int] = set()
        try:
            tasks = list(Path(f"/proc/{parent}/task").iterdir())
        except OSError:
            tasks = []
        for task in tasks:
            try:
                text = (task / "children").read_text()
            except OSError:
                return _children_by_scan(parents)
            pids.update(int(pid) for pid in text.split())
        found[parent] = pids
    return found


def child_pids(pid: int | None = None) -> set[int]:
    """Live children of process ``pid`` (default: this one), zombies excluded."""
    parent = os.getpid() if pid is None else pid
    return _alive(_children_of({parent})[parent])


def is_resource_tracker(pid: int) -> bool:
    """Whether ``pid`` is multiprocessing's resource tracker (started by the first spawn,
    it lives as long as the process that started it, by design)."""
    return b"multiprocessing.resource_tracker" in _cmdline(pid)


def is_worker_server(pid: int) -> bool:
    """Whether ``pid`` is an aoffload worker server (of this process, if it is a child)."""
    return _SERVER_MARK in _cmdline(pid)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def worker_pids() -> set[int]:
    """This process's live workers and other children: every live child, except the
    resource tracker and the worker servers, and every live child of those servers."""
    children = child_pids()
    servers = {pid for pid in children if is_worker_server(pid)}
    others = {pid for pid in children - servers if not is_resource_tracker(pid)}
    grandchildren = _children_of(servers) if servers else {}
    return others | _alive(set().union(*grandchildren.values()))


def staging_segments(pid: int | None = None) -> set[str]:
    """Names in ``/dev/shm`` of the staging segments process ``pid`` (default: this one) made."""
    prefix = f"{_SEGMENT_PREFIX}{os.getpid() if pid is None else pid}-"
    try:
        return {name for name in os.listdir(SHM_DIR) if name.startswith(prefix)}
    except FileNotFoundError:
        return set()
