"""aoffload's side of the checkpoint section: stage() + fence per step length, a real CPU step.

The trainer's stall per checkpoint is the ``stage()`` call plus the fence (``await staged``)
after a step of ``compute`` seconds. The step blocks the event loop's thread, as a real
training step does: ``time.sleep`` (the trainer waiting for its accelerator, e.g. in
``torch.cuda.synchronize()``), or real matrix products on torch's threads (the 'real CPU
step' rows, which show what the copy costs the compute and the compute costs the copy).
The commit is awaited after the fence, outside the stall, so that repetitions do not
queue behind each other's disk writes. The event loop's lag is the ``looplag`` section's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ._checkpoint_systems import scratch, torch_save_stall
from ._common import Report, progress

__all__ = ["DURABLE", "aoffload_runs"]

SECTION = "checkpoint"
GIB = float(1 << 30)
DURABLE = "time to durable, from the save call (0 s step)"


def _cpu_step_call(seconds: float) -> Any:
    """A real training-like step: products of 1024x1024 matrices for about ``seconds``."""
    a, b = torch.rand(1024, 1024), torch.rand(1024, 1024)
    started = time.perf_counter()
    torch.mm(a, b)
    iters = max(1, round(seconds / max(time.perf_counter() - started, 1e-4)))

    def step() -> None:
        for _ in range(iters):
            torch.mm(a, b)

    return step


async def aoffload_runs(
    root: Path,
    state: dict[str, torch.Tensor],
    computes: tuple[float, ...],
    reps: int,
    report: Report,
    cpu_step_seconds: float,
    after_commit: Callable[[int], None] | None = None,
) -> int:
    """Measure stage() + fence at each step length; returns the bytes of one written file.

    ``after_commit(nbytes)`` runs after each measured commit, outside every timed span (the
    raw disk write that the writer's rate is compared with, made beside it: this host's
    disk is not as fast from one minute to the next).
    """
    import aoffload

    with scratch(root, "aoffload") as directory:
        async with aoffload.CheckpointEngine(directory, keep_last=1) as engine:
            step = 0

            async def one(compute: float, work: Any = None) -> tuple[float, float, float, Any]:
                """(the stage() call, the stall, the time to durable, the commit's result)."""
                nonlocal step
                step += 1
                tag = f"step-{step}"
                started = time.perf_counter()
                staged = engine.stage(state, "model.pt", tag=tag)
                call = time.perf_counter() - started
                if work is not None:
                    work()  # a real step on the loop thread, as a trainer's step would be
                else:
                    time.sleep(compute)  # noqa: ASYNC251 - the loop thread waits for its accelerator
                fenced = time.perf_counter()
                await staged
                fence = time.perf_counter() - fenced
                result = await engine.commit(tag)
                return call, call + fence, time.perf_counter() - started, result

            await one(0.0)  # warm-up: fills the staging slot once
            calls: list[float] = []
            results: list[Any] = []

            async def measured(compute: float) -> tuple[float, float, float, Any]:
                run = await one(compute)
                if after_commit is not None:
                    after_commit(run[3].bytes)
                return run

            for compute in computes:
                runs = [await measured(compute) for _ in range(reps)]
                calls += [r[0] for r in runs]
                results += [r[3] for r in runs]
                report.add(
                    SECTION,
                    "aoffload",
                    f"trainer stall, {compute:g} s step",
                    "s",
                    [r[1] for r in runs],
                )
                if compute == 0.0:
                    report.add(SECTION, "aoffload", DURABLE, "s", [r[2] for r in runs])
            nbytes = results[-1].bytes
            report.add(
                SECTION,
                "aoffload",
                "stage() call per GiB",
                "s",
                [c * GIB / nbytes for c in calls],
            )
            report.add(
                SECTION,
                "aoffload",
                "copy time (0 s step: the fence waits for all of it)",
                "s",
                [r.stage_seconds for r in results[:reps]],
            )
            report.add(
                SECTION,
                "aoffload",
                "write+fsync rate (GiB/s)",
                "GiB/s",
                [r.bytes / GIB / r.write_seconds for r in results if r.write_seconds],
            )
            await _cpu_step(one, report, reps, cpu_step_seconds, root, state)
            await _dead_writer(engine, state, report)
            return int(nbytes)


async def _cpu_step(
    one: Any,
    report: Report,
    reps: int,
    seconds: float,
    root: Path,
    state: dict[str, torch.Tensor],
) -> None:
    progress(f"checkpoint: a real CPU step of ~{seconds:g} s with and without a checkpoint")
    step = _cpu_step_call(seconds)
    plain: list[float] = []
    for _ in range(reps):
        started = time.perf_counter()
        step()
        plain.append(time.perf_counter() - started)
    report.add(SECTION, "real CPU step", "step time, no checkpoint", "s", plain)
    with_ckpt: list[float] = []
    for _ in range(reps):
        started = time.perf_counter()
        await one(0.0, step)  # stage, the step, the fence (the commit is outside the span)
        with_ckpt.append(time.perf_counter() - started)
    fences: list[float] = []
    for _ in range(reps):
        fences.append((await one(0.0, step))[1])
    report.add(
        SECTION,
        "real CPU step",
        "aoffload stage()+fence: stall after a step using every core (copy and step share them)",
        "s",
        fences,
    )
    spans: list[float] = []
    for _ in range(reps):
        started = time.perf_counter()
        step()
        torch_save_stall(root, state, 0.0)
        spans.append(time.perf_counter() - started)
    report.add(SECTION, "real CPU step", "step + torch.save+fsync", "s", spans)
    report.ratio(
        SECTION,
        "real CPU step: (step + stage + fence + commit) / plain step",
        report.add(SECTION, "real CPU step", "step + stage + fence + commit", "s", with_ckpt),
        report.find(SECTION, "real CPU step", "step time, no checkpoint"),
    )


async def _dead_writer(engine: Any, state: dict[str, torch.Tensor], report: Report) -> None:
    import aoffload

    pid = engine.pid
    if pid is None:
        return
    await engine.save(state, "model.pt", tag="doomed")
    commit = asyncio.ensure_future(engine.commit("doomed"))
    await asyncio.sleep(0.01)
    logging.getLogger("aoffload").setLevel(logging.CRITICAL)
    started = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(aoffload.WorkerDiedError):
        await commit
    report.add(
        SECTION,
        "aoffload",
        "dead writer noticed by commit() (single sample)",
        "s",
        [time.perf_counter() - started],
    )
