"""Optimizer section: aoffload's CPUAdam against in-process optimizers and DeepSpeed's
SuperOffload worker driven as its stage-3 optimizer drives it."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from ._common import Figure, Report, progress

SECTION = "optimizer"
CONFIG: dict[str, Any] = {
    "lr": 1e-3,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 0.01,
    "amsgrad": False,
}


def _subgroups(count: int, numel: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(count * numel)
    return [
        (torch.randn(numel, generator=generator), torch.randn(numel, generator=generator))
        for _ in range(count)
    ]


def _timed(call: Callable[[], None]) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds)."""
    wall, cpu = time.perf_counter(), time.process_time()
    call()
    return time.perf_counter() - wall, time.process_time() - cpu


def _deepspeed_in_process(groups: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], None]:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    params = [torch.nn.Parameter(p.clone()) for p, _ in groups]
    for param, (_, grad) in zip(params, groups, strict=True):
        param.grad = grad
    optimizer = DeepSpeedCPUAdam(
        [params[0]],
        lr=CONFIG["lr"],
        betas=CONFIG["betas"],
        eps=CONFIG["eps"],
        weight_decay=CONFIG["weight_decay"],
    )

    def step() -> None:
        for index, param in enumerate(params):
            optimizer.param_groups[0]["params"] = [param]
            optimizer.step_subgroup(index)

    return step


def _torch_fused(groups: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], None]:
    params = [torch.nn.Parameter(p.clone()) for p, _ in groups]
    for param, (_, grad) in zip(params, groups, strict=True):
        param.grad = grad
    optimizer = torch.optim.Adam(
        params,
        lr=CONFIG["lr"],
        betas=CONFIG["betas"],
        eps=CONFIG["eps"],
        weight_decay=CONFIG["weight_decay"],
        fused=True,
    )
    return optimizer.step


def _superoffload(
    groups: list[tuple[torch.Tensor, torch.Tensor]], awaiting: list[float], *, ours: bool
) -> tuple[Any, Callable[[], None]]:
    """DeepSpeed's class, or (``ours``) aoffload's drop-in on the optimizer's core, each with
    its own defaults, driven alike from this thread with no event loop."""
    from deepspeed.runtime.superoffload.superoffload_utils import SuperOffloadCPUOptimizer

    numel = max(p.numel() for p, _ in groups)
    optimizer: Any
    if ours:
        import aoffload.deepspeed

        optimizer = aoffload.deepspeed.SuperOffloadCPUOptimizer(dict(CONFIG), max_grad_numel=numel)
    else:
        optimizer = SuperOffloadCPUOptimizer(dict(CONFIG), max_grad_numel=numel)
    params = [p.clone() for p, _ in groups]

    def step() -> None:
        for index, (param, (_, grad)) in enumerate(zip(params, groups, strict=True)):
            optimizer.async_step(0, index, param, grad)
        started = time.process_time()
        received = 0
        while received < len(params):  # what DeepSpeed's stage 3 does: poll and sleep 1 ms
            result = optimizer.get_result()
            if result is None:
                time.sleep(0.001)
                continue
            received += 1
        awaiting.append(time.process_time() - started)

    return optimizer, step


async def _aoffload(
    groups: list[tuple[torch.Tensor, torch.Tensor]],
    backend: str,
    reps: int,
    worker_cores: float | None = None,
) -> tuple[list[float], list[float], list[float]]:
    import aoffload

    params = [p.clone() for p, _ in groups]
    grads = [g.clone() for _, g in groups]
    walls, cpus, awaiting = [], [], []
    async with aoffload.CPUAdam(
        [dict(CONFIG)], backend=backend, worker_cores=worker_cores
    ) as optimizer:
        for rep in range(reps + 1):  # the first pass registers the tensors: warm-up
            wall, cpu = time.perf_counter(), time.process_time()
            for index, (param, grad) in enumerate(zip(params, grads, strict=True)):
                optimizer.submit(0, index, param, grad)
            submitted = time.process_time()
            async for _ in optimizer.results():
                pass
            if rep:
                walls.append(time.perf_counter() - wall)
                cpus.append(time.process_time() - cpu)
                awaiting.append(time.process_time() - submitted)
    return walls, cpus, awaiting


def _sync_pipeline(
    groups: list[tuple[torch.Tensor, torch.Tensor]], reps: int, *, ours: bool
) -> tuple[list[tuple[float, float]], list[float]]:
    """(wall, CPU) of each pipelined pass, and the CPU spent awaiting its results.

    This process's CPU affinity and torch threads are put back after it: DeepSpeed's class
    pins the trainer (``cpuadam_cores_perc=0.8``) and never restores it, which would leave
    the systems measured after it on one core.
    """
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    threads = torch.get_num_threads()
    awaiting: list[float] = []
    try:
        optimizer, step = _superoffload(groups, awaiting, ours=ours)
        try:
            step()  # warm-up: registers the tensors
            runs = [_timed(step) for _ in range(reps)]
            del awaiting[0]
        finally:
            if ours:
                optimizer.close()  # an error of aoffload's close is a failure, reported
            else:
                with contextlib.suppress(Exception):  # its close() only logs
                    optimizer.close()
    finally:
        if affinity is not None:
            os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)
    return runs, awaiting


def run(report: Report, *, quick: bool, smoke: bool = False) -> None:
    """Measure the optimizer pipelines."""
    reps = 1 if smoke else 3 if quick else 7  # --smoke: every system steps once, measured
    shapes = (
        ((16, 1 << 14),) if smoke else ((16, 1 << 20),) if quick else ((16, 1 << 20), (4, 10 << 20))
    )
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        for count, numel in shapes:
            _shape(report, count, numel, reps, quick=quick)
    finally:
        if affinity is not None:
            os.sched_setaffinity(0, affinity)


def _shape(report: Report, count: int, numel: int, reps: int, *, quick: bool) -> None:
    label = f"{count} x {numel / 1e6:.2g}M"
    groups = _subgroups(count, numel)
    baseline: Figure | None = None
    progress(f"optimizer {label}: in-process DeepSpeedCPUAdam")
    try:
        step = _deepspeed_in_process(groups)
        step()  # warm-up (and the op's first load)
        runs = [_timed(step) for _ in range(reps)]
        baseline = report.add(
            SECTION, "in-process DeepSpeedCPUAdam", f"{label} step", "s", [r[0] for r in runs]
        )
    except Exception as exc:  # noqa: BLE001 - an anchor that cannot run is reported
        report.skip(SECTION, "in-process DeepSpeedCPUAdam", f"{type(exc).__name__}: {exc}"[:300])

    progress(f"optimizer {label}: torch.optim.Adam(fused=True)")
    step = _torch_fused(groups)
    step()
    fused = report.add(
        SECTION,
        "in-process torch Adam(fused=True)",
        f"{label} step",
        "s",
        [_timed(step)[0] for _ in range(reps)],
    )
    baseline = baseline or fused

    for system, adapter in (
        ("DeepSpeed SuperOffloadCPUOptimizer", False),
        ("aoffload.deepspeed SuperOffloadCPUOptimizer", True),
    ):
        if adapter and importlib.util.find_spec("deepspeed") is None:
            report.notes.append(f"optimizer: {system} not measured: DeepSpeed is not installed")
            continue
        progress(f"optimizer {label}: {system} (1 ms sleep polling)")
        try:
            runs, awaiting = _sync_pipeline(groups, reps, ours=adapter)
        except Exception as exc:  # noqa: BLE001 - reported: a skip for DeepSpeed's, a failure for ours
            if adapter:
                report.fail(SECTION, system, exc)
            else:
                report.skip(SECTION, system, f"{type(exc).__name__}: {exc}"[:300])
            continue
        ref = report.add(SECTION, system, f"{label} pipeline", "s", [r[0] for r in runs])
        report.add(
            SECTION,
            system,
            f"{label} trainer CPU, submit + wait (% of a core)",
            "%",
            [100 * r[1] / r[0] for r in runs],
        )
        report.add(
            SECTION,
            system,
            f"{label} trainer CPU while awaiting results (% of a core)",
            "%",
            [100 * a / r[0] for a, r in zip(awaiting, runs, strict=True)],
        )
        report.add(
            SECTION,
            system,
            f"{label} trainer CPU per step, submit + result",
            "ms",
            [r[1] / count * 1e3 for r in runs],
        )
        report.ratio(SECTION, f"{label}: {system} / in-process", ref, baseline)

    # The default configuration first (worker_cores=None), then the explicit CPU split.
    variants: tuple[tuple[str, float | None], ...] = (
        ("deepspeed", None),
        ("deepspeed", 0.8),
        ("torch", 0.8),
    )
    for backend, cores in variants:
        system = f"aoffload CPUAdam ({backend}, worker_cores={cores!r})"
        progress(f"optimizer {label}: {system}")
        try:
            walls, cpus, awaiting = asyncio.run(_aoffload(groups, backend, reps, cores))
        except Exception as exc:  # noqa: BLE001 - an aoffload error is a failure, reported
            report.fail(SECTION, system, exc)
            continue
        ours = report.add(SECTION, system, f"{label} pipeline", "s", walls)
        report.add(
            SECTION,
            system,
            f"{label} trainer CPU, submit + wait (% of a core)",
            "%",
            [100 * c / w for c, w in zip(cpus, walls, strict=True)],
        )
        report.add(
            SECTION,
            system,
            f"{label} trainer CPU while awaiting results (% of a core)",
            "%",
            [100 * a / w for a, w in zip(awaiting, walls, strict=True)],
        )
        report.add(
            SECTION,
            system,
            f"{label} trainer CPU per step, submit + result",
            "ms",
            [c / count * 1e3 for c in cpus],
        )
        report.add(
            SECTION,
            system,
            f"{label} overhead per sub-group step (vs {baseline.system})",
            "ms",
            [(w - baseline.value) / count * 1e3 for w in walls],
        )
        report.ratio(SECTION, f"{label}: {system} / {baseline.system}", ours, baseline)
        report.ratio(SECTION, f"{label}: {system} / torch Adam(fused=True)", ours, fused)
