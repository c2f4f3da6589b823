"""Loop-lag section: how late the trainer's event loop runs while aoffload works.

A ticker task sleeps 1 ms at a time and records how late each wake-up is. Around it
the checkpoint engine saves, commits and loads a state of ``size_gib`` GiB of tensors
(cold: the first of each in a fresh engine, staging memory and files new; warm: the
second) and a state holding one 64 MB ``bytes`` value. Each case's max and p99 lag
are figures over ``reps`` fresh engines. The goal (issue #10): max < 20 ms, p99 < 2 ms.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ._common import Report, progress

SECTION = "loop lag"
_BLOB = 64 * 10**6
_TICK = 0.001


async def _lagged(call: Callable[[], Awaitable[Any]]) -> tuple[float, float]:
    """Run ``call`` with a 1 ms ticker beside it; return (max lag, p99 lag) in seconds.

    The lag is read on ``time.perf_counter``: uvloop's own clock counts whole milliseconds.
    """
    lags: list[float] = []
    stop = asyncio.Event()

    async def tick() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            await asyncio.sleep(_TICK)
            lags.append(max(0.0, time.perf_counter() - started - _TICK))

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(5 * _TICK)
    try:
        await call()
    finally:
        stop.set()
        await ticker
    lags.sort()
    return lags[-1], lags[min(len(lags) - 1, int(0.99 * len(lags)))]


async def _idle() -> None:
    await asyncio.sleep(0.3)


async def _foreign(code: str) -> None:
    # Started from a thread: uvloop forks from the loop's thread, and forking this process
    # (a GiB of state mapped) would stall the very loop the control measures.
    await asyncio.to_thread(subprocess.run, [sys.executable, "-c", code], check=True)


async def _foreign_load(path: Path) -> None:
    """The same load in a process of its own, not aoffload's: what the machine itself costs."""
    code = (
        "import os, torch; os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0)); "
        f"torch.load({str(path)!r}, weights_only=True, mmap=True)"
    )
    await _foreign(code)


async def _foreign_touch(nbytes: int) -> None:
    """New shared memory filled by a process of its own, as a cold save's first copy fills it."""
    code = (
        "import mmap, os, numpy; os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0)); "
        f"m = mmap.mmap(-1, {nbytes}, flags=mmap.MAP_SHARED); "
        "numpy.frombuffer(m, dtype=numpy.uint8).fill(1)"
    )
    await _foreign(code)


async def _one_engine(
    root: Path, state: dict[str, torch.Tensor], blob: dict[str, bytes]
) -> dict[str, tuple[float, float]]:
    import aoffload

    seen: dict[str, tuple[float, float]] = {"idle (the loop's own floor)": await _lagged(_idle)}
    cases: list[tuple[str, object, str]] = [
        ("cold", state, "state-cold"),
        ("warm", state, "state-warm"),
        ("64 MB bytes value", blob, "blob"),
    ]
    async with aoffload.CheckpointEngine(root, durable=True) as engine:
        for case, saved, tag in cases:
            seen[f"save, {case}"] = await _lagged(partial(engine.save, saved, "m.pt", tag=tag))
            seen[f"commit, {case}"] = await _lagged(partial(engine.commit, tag))
            seen[f"load, {case}"] = await _lagged(partial(engine.load, "m.pt", tag=tag))
    if sys.platform == "linux":
        control = "control: that load by torch.load in another process, not aoffload's"
        seen[control] = await _lagged(partial(_foreign_load, root / "blob" / "m.pt"))
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        control = "control: another process filling as much new shared memory"
        seen[control] = await _lagged(partial(_foreign_touch, nbytes))
    return seen


def run(report: Report, *, quick: bool, size_gib: float, directory: Path | None) -> None:
    """Measure the loop's lag during each checkpoint phase, on asyncio's loop and uvloop."""
    from .._runtime.loops import loop_factory

    reps = 1 if quick else 3  # --quick: one engine per loop, its figures labelled as such
    tensors = 16
    numel = int(size_gib * 2**30) // 4 // tensors
    state = {f"layer{i}": torch.randn(numel) for i in range(tensors)}
    blob = {"blob": os.urandom(_BLOB)}
    loops: list[tuple[str, Callable[[], asyncio.AbstractEventLoop] | None]] = [("asyncio", None)]
    factory = loop_factory()
    if "uvloop" in factory.__module__:
        loops.append(("uvloop", factory))
    for loop_name, chosen in loops:
        samples: dict[str, list[tuple[float, float]]] = {}
        for rep in range(reps):
            root = Path(tempfile.mkdtemp(prefix="aoffload-lag-", dir=directory))
            try:
                progress(f"loop lag on {loop_name}: {size_gib:g} GiB state, {rep + 1}/{reps}")
                with asyncio.Runner(loop_factory=chosen) as runner:
                    for case, lag in runner.run(_one_engine(root, state, blob)).items():
                        samples.setdefault(case, []).append(lag)
            finally:
                shutil.rmtree(root, ignore_errors=True)
        system = f"aoffload ({loop_name})"
        for case, lags in samples.items():
            report.add(SECTION, system, f"{case}: max lag", "ms", [m * 1e3 for m, _ in lags])
            report.add(SECTION, system, f"{case}: p99 lag", "ms", [p * 1e3 for _, p in lags])
    report.notes.append(
        f"loop lag: a 1 ms ticker beside each phase, read on time.perf_counter, {size_gib:g} "
        f"GiB of fp32 tensors ({tensors} tensors) or one 64 MB bytes value, {reps} fresh "
        "engine(s) per loop; the idle row is the ticker with nothing else running (uvloop's "
        "timers fire on whole milliseconds); the control rows are the 64 MB file loaded by "
        "plain torch.load, and as much new shared memory as the state filled, in a separate "
        "background process while this loop only ticks (what the VM costs a loop when "
        "another process does it); goal max < 20 ms, p99 < 2 ms"
    )
