"""What the trainer says about DeepSpeed's op: the torch backend ``"auto"`` chose, and a start
that timed out while the op was being built (trainer side; the worker builds,
:mod:`.worker._deepspeed_op`)."""

from __future__ import annotations

import logging
import os
import threading

from .._errors import WorkerStartupError
from .worker._build_lock import LOCK, holders
from .worker._deepspeed_op import BUILD_TIME, build_directory
from .worker._deepspeed_stamp import NAME

__all__ = ["startup_timeout", "tell_fallback"]

logger = logging.getLogger(__name__)

_told: set[str] = set()
_told_lock = threading.Lock()


def tell_fallback(reason: str) -> None:
    """Say once per process (at INFO) why ``backend="auto"`` runs the torch backend."""
    with _told_lock:
        if reason in _told:
            return
        _told.add(reason)
    logger.info(
        "backend='auto' runs the torch backend (torch's fused AdamW, bit-identical to "
        "torch.optim.AdamW(fused=True)): %s. backend='deepspeed' loads DeepSpeed's CPU Adam "
        "op, building it first if it must (%s, once)",
        reason,
        BUILD_TIME,
    )


def _building(directory: str, pid: int | None) -> str | None:
    """What a build of the op in ``directory`` was doing, if one was (``pid``: the worker)."""
    lock = os.path.join(directory, LOCK)
    if os.path.exists(lock):
        found = holders(directory)
        if pid is not None and pid in found.openers:
            return f"it was building DeepSpeed's CPU Adam op in {directory}"
        if found:
            return f"it was waiting for a build of DeepSpeed's CPU Adam op in {directory}"
        return f"it was held by a build lock a dead build left in {directory} (cleared next time)"
    if not os.path.exists(os.path.join(directory, f"{NAME}.so")):
        return f"it was about to build DeepSpeed's CPU Adam op in {directory}"
    return None


def startup_timeout(timeout: float, backend: str, pid: int | None) -> WorkerStartupError | None:
    """The error of a start that timed out while DeepSpeed's op was built (or waited for),
    saying so; ``None`` if no build was involved."""
    if backend != "deepspeed":
        return None  # "auto" never builds nor waits for a build
    try:
        doing = _building(build_directory(), pid)
    except OSError:
        return None
    if doing is None:
        return None
    return WorkerStartupError(
        f"the cpu-adam worker did not become ready within {timeout} s: {doing}, which takes "
        f"{BUILD_TIME} the first time. Start it again with a larger start_timeout (the build "
        "starts over unless its compiler outlived the worker), or use backend='torch'"
    )
