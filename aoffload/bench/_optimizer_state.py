"""Benchmark: ``await CPUAdam.state_dict()`` against a memcpy of the same bytes.

The snapshot is one copy of both moments in the worker, into shared memory the trainer
maps, plus a round trip; the baseline is ``Tensor.copy_`` between two warm buffers of the
same size in this process. Both use torch's default thread count.
"""

from __future__ import annotations

import asyncio
import time

import torch

from ._common import Report, progress

SECTION = "optimizer"


async def _snapshots(count: int, numel: int, reps: int) -> tuple[float, list[float]]:
    import aoffload

    params = [torch.randn(numel) for _ in range(count)]
    grads = [torch.randn(numel) for _ in range(count)]
    async with aoffload.CPUAdam([{"lr": 1e-3}]) as opt:
        for index, (param, grad) in enumerate(zip(params, grads, strict=True)):
            await opt.register(0, index, param, grad)
            opt.submit(0, index, param, grad)
        await opt.drain()  # the moments exist
        started = time.perf_counter()
        state = await opt.state_dict()  # cold: the shared buffer's pages are new
        cold = time.perf_counter() - started
        del state  # dropped, as after engine.save(): the next snapshot reuses its buffer
        warm = []
        for _ in range(reps):
            started = time.perf_counter()
            state = await opt.state_dict()
            warm.append(time.perf_counter() - started)
            del state
    return cold, warm


def _memcpy(total: int, reps: int) -> list[float]:
    source, target = torch.randn(total), torch.empty(total)
    target.copy_(source)  # warm both
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - started)
    return times


def run(report: Report, *, quick: bool, smoke: bool = False) -> None:
    """Measure ``state_dict()`` of ``count x numel`` sub-groups against a memcpy."""
    count, numel = (4, 10 << 20) if not quick else (4, (10 << 20) // (640 if smoke else 4))
    reps = 1 if smoke else 3 if quick else 5
    label = f"{count} x {numel / 2**20:g}Mi state_dict ({2 * count * numel * 4 / 2**20:.0f} MiB)"
    progress(f"optimizer state: {label}")
    baseline = report.add(
        SECTION, "memcpy (Tensor.copy_, warm)", label, "s", _memcpy(2 * count * numel, reps)
    )
    try:
        cold, warm = asyncio.run(_snapshots(count, numel, reps))
    except Exception as exc:
        report.notes.append(f"FAILED: aoffload CPUAdam.state_dict(): {type(exc).__name__}: {exc}")
        raise
    ours = report.add(SECTION, "aoffload CPUAdam.state_dict()", label, "s", warm)
    report.add(
        SECTION,
        "aoffload CPUAdam.state_dict()",
        f"{label}, first call (new shared pages)",
        "s",
        [cold],
        note="single sample",
    )
    report.ratio(SECTION, f"{label}: state_dict() / memcpy", ours, baseline)
