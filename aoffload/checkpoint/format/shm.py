"""The ``/dev/shm`` files aoffload makes: named by their owner, swept when it is dead.

Staging segments (``aoffload-<pid>-<start>-<n>``, :mod:`.staging`) and the large values a
load hands over (``aoffload-load-<pid>-<n>``, ``writer/_loader.py``) are named after the
process that made them, with its start time where the name has room for it, so that a
SIGKILLed trainer's leftovers can be told from a live engine's: :func:`remove_dead` (run
at every engine start and by ``aoffload clean``) removes the files of dead owners, never
a live one's, nor another user's. :func:`check_room` is the start's check that
``/dev/shm`` can hold the staging memory the next checkpoints will take.

No torch here: the command line imports this.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re

from ..._errors import CheckpointError
from ..._runtime.census import SHM_DIR

__all__ = ["SHM_DIR", "check_room", "dead_files", "remove_dead", "segment_prefix"]

logger = logging.getLogger(__name__)

_OWNED = re.compile(r"aoffload-(?:load-)?(?P<pid>\d+)-(?:(?P<start>\d+)-)?\d+")


def _start_time(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks after boot), or ``None`` if none runs."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return -1  # it exists, but cannot be read: count it live
    return int(fields[19])  # field 22 of proc(5); two fields precede the ")"


def segment_prefix() -> str:
    """This process's prefix for staging segments: ``aoffload-<pid>-<start time>-``."""
    pid = os.getpid()
    return f"aoffload-{pid}-{_start_time(pid) or 0}-"


def _dead(name: str) -> bool:
    match = _OWNED.fullmatch(name)
    if match is None:
        return False
    started = _start_time(int(match["pid"]))
    if started is None:
        return True
    recorded = match["start"]
    # Same pid, later start: the owner died and its pid was reused.
    return recorded is not None and started not in (-1, int(recorded))


def dead_files(directory: str = SHM_DIR) -> list[tuple[str, int]]:
    """This user's aoffload files in ``directory`` whose owner is dead, with their sizes."""
    found = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory):
            with contextlib.suppress(FileNotFoundError):
                info = entry.stat(follow_symlinks=False)
                mine = entry.is_file(follow_symlinks=False) and info.st_uid == os.geteuid()
                if mine and _dead(entry.name):
                    found.append((entry.path, info.st_size))
    return found


def remove_dead(directory: str = SHM_DIR) -> list[tuple[str, int]]:
    """Remove :func:`dead_files` (logged at INFO); what was removed."""
    removed = []
    for path, size in dead_files(directory):
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            logger.warning("could not remove %s, left by a dead process: %s", path, exc)
            continue
        logger.info("removed %s (%d bytes), left in shared memory by a dead process", path, size)
        removed.append((path, size))
    return removed


def check_room(
    latest_bytes: int,
    max_pending: int,
    cap: int | None = None,
    chosen: bool = False,
    directory: str = SHM_DIR,
) -> None:
    """Raise :class:`CheckpointError` unless ``directory`` has room for the staging memory
    the next checkpoints will take: ``max_pending`` of ``latest_bytes`` each (the latest
    one's size, the best estimate of the next), or the staging cap ``cap`` if smaller
    (``chosen``: the user's ``staging_bytes``); naming the fix."""
    needed = latest_bytes * max_pending if cap is None else min(latest_bytes * max_pending, cap)
    if needed <= 0:
        return
    try:
        info = os.statvfs(directory)
    except OSError as exc:
        raise CheckpointError(
            f"aoffload stages checkpoints in {directory}, which it cannot use: {exc}"
        ) from exc
    free, total = info.f_bavail * info.f_frsize, info.f_blocks * info.f_frsize
    if needed > free:
        why = (
            f"staging_bytes={cap}"
            if chosen and needed == cap
            else f"max_pending={max_pending} x {latest_bytes / 2**20:.0f} MiB, the size of the "
            "latest checkpoint"
        )
        raise CheckpointError(
            f"checkpoint staging needs about {needed / 2**20:.0f} MiB of shared memory "
            f"({why}), but {directory} has {free / 2**20:.0f} MiB free of "
            f"{total / 2**20:.0f} MiB. Enlarge it (Docker: `docker run --shm-size=...`; "
            "Kubernetes: an emptyDir with medium: Memory at /dev/shm), lower staging_bytes "
            "(a larger state streams through it) or max_pending, or run `aoffload clean` to "
            "remove what dead runs left there"
        )
