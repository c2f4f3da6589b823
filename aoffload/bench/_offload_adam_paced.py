"""OffloadAdam section, the paced backward: a backward paced as an accelerator's.

16 parameters of 1M fp32, each one bucket; parameter ``i``'s gradient reaches autograd at
``(i + 1) * t_b / 16`` after the step starts (a custom autograd function waits with
``time.sleep`` in its backward, as a trainer waits for an accelerator, so the
post-accumulate-grad hooks run on the real autograd path, on the loop's thread). Each
gradient is a precomputed tensor, so autograd copies it into ``.grad``: that copy is the
backward's own work on the CPU, and at small ``t_b`` most of it.

Sequential: in-process ``torch.optim.AdamW(fused=True)`` after the backward; its optimizer
time is ``t_adam``. OffloadAdam uses ``backend="torch"``, the same kernel. The ideal is
``max(b, t_adam) + t_adam / 16``, with ``b`` the paced backward measured alone at each
``t_b`` of the ``overlap`` section, plus ``t_b = t_adam``, both taken in the same round
(the host's pace drifts): it takes the backward and the optimizer at their full speed *at
once*. Both move memory, on the cores they share; so the section also times that work at
once (:func:`at_once`): the gradient copies OffloadAdam's backward makes (16 x 4 MiB
``memmove``) on one core while another process runs the fused AdamW over 16 x 1M on the
other, each also alone.

A control for OffloadAdam's own cost: the same overlap inside the trainer's process, each
parameter stepped by the same kernel on a thread as its gradient arrives, scheduled as the
worker schedules its steps (a stepping thread per torch thread, all but one while the
backward runs, all after: the worker's own :class:`~aoffload.optimizer.worker._stepper.Stepper`),
with no process, pipe or shared memory. It is a control, not a floor: its hooks and step
calls run on Python threads that share the trainer's GIL, which a worker process does not,
so a worker can beat it (``worker_cores=0.5`` has, below ``t_b`` = 30 ms). Beside the
multiples of the ideal, the section reports each overlap against the sequential step: below
1, the overlap is slower than stepping after the backward.

The systems step in turn, one step each per round, so that a burst of a shared host's noise
lands on all of them alike.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import functools
import multiprocessing
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from . import _at_once
from ._common import Figure, Report, Table, format_value, progress
from ._overlap_report import BACKWARDS

__all__ = [
    "ALONE",
    "ADAM_ONE",
    "AT_ONCE",
    "COPIES",
    "IDEAL",
    "LR",
    "PACED",
    "PACED_SPLIT",
    "SECTION",
    "SEQUENTIAL",
    "THREAD",
    "Step",
    "at_once",
    "interleaved",
    "paced",
]

SECTION = "offload_adam"
PACED_PARAMS, PACED_NUMEL = 16, 1 << 20
SMOKE_NUMEL = 1 << 14  # --smoke: every system runs, on parameters too small to measure
LR = 1e-3

SEQUENTIAL = "in-process AdamW(fused=True), after the backward (sequential)"
PACED = "aoffload OffloadAdam (backend='torch')"
THREAD = (
    "in-process overlap control: each parameter stepped on a thread of the trainer's process "
    "as it arrives (no worker; shares the trainer's GIL)"
)
SPLIT = 0.5
PACED_SPLIT = f"aoffload OffloadAdam (backend='torch', worker_cores={SPLIT:g}; run after)"
ALONE = "paced backward alone, no optimizer"
IDEAL = "ideal: max(b, t_adam) + t_adam / 16"
COPIES = "the gradient copies alone (16 memmoves of a gradient, one core)"
ADAM_ONE = "fused AdamW over the 16 parameters alone (another process, one core)"
AT_ONCE = "both at once, one core each"

Step = Callable[[float], Awaitable[float]]  # one step at this t_b -> its seconds


async def interleaved(systems: dict[str, Step], plan: list[float]) -> dict[str, list[float]]:
    """Every system steps once per entry of ``plan``, in turn: a burst of the shared host's
    noise lands on all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in systems}
    for t_b in plan:
        for name, step in systems.items():
            times[name].append(await step(t_b))
    return times


class _Clock:
    def __init__(self, grads: list[torch.Tensor]) -> None:
        self.grads = grads
        self.started = 0.0
        self.t_b = 0.0


class _Paced(torch.autograd.Function):
    """Forward: ``carry``. Backward: waits for this parameter's time on the schedule, then
    gives it its (precomputed) gradient; the last parameter's comes first."""

    @staticmethod
    def forward(
        ctx: Any, param: torch.Tensor, carry: torch.Tensor, clock: _Clock, index: int
    ) -> torch.Tensor:
        ctx.clock, ctx.index = clock, index
        return carry.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        clock: _Clock = ctx.clock
        order = PACED_PARAMS - 1 - ctx.index
        deadline = clock.started + (order + 1) * clock.t_b / PACED_PARAMS
        remaining = deadline - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)  # the trainer blocked on its accelerator (simulated)
        return clock.grads[ctx.index], grad, None, None


class _PacedModel:
    def __init__(self, numel: int) -> None:
        gen = torch.Generator().manual_seed(7)
        self.params = [
            torch.nn.Parameter(torch.randn(numel, generator=gen)) for _ in range(PACED_PARAMS)
        ]
        self.clock = _Clock([torch.randn(numel, generator=gen) for _ in self.params])

    def backward(self, t_b: float, on_start: Callable[[], object] | None = None) -> None:
        carry = torch.zeros(())
        for index, param in enumerate(self.params):
            carry = _Paced.apply(param, carry, self.clock, index)  # type: ignore[no-untyped-call]
        self.clock.t_b = t_b
        self.clock.started = time.perf_counter()
        if on_start is not None:
            on_start()
        torch.autograd.backward(carry)


def _paced_in_process(adam: list[float] | None, numel: int) -> Step:
    """Sequential: the paced backward, then AdamW(fused=True) (its time into ``adam``);
    with ``adam=None``, the backward alone."""
    model = _PacedModel(numel)
    opt = torch.optim.AdamW(model.params, lr=LR, fused=True)

    async def step(t_b: float) -> float:
        model.backward(t_b)
        optimizer_started = time.perf_counter()
        if adam is not None:
            opt.step()
        opt.zero_grad()
        ended = time.perf_counter()
        if adam is not None:
            adam.append(ended - optimizer_started)
        return ended - model.clock.started

    return step


def _paced_thread(stack: contextlib.AsyncExitStack, numel: int) -> Step:
    """The overlap without a worker: a post-accumulate-grad hook hands each parameter's
    fused AdamW step to the worker's own scheduler, in this process."""
    from aoffload.optimizer.worker._stepper import Stepper

    model = _PacedModel(numel)
    stepper = Stepper(torch.get_num_threads())  # as many as the worker's (see _service)
    stack.callback(stepper.close)
    optimizers = [torch.optim.AdamW([p], lr=LR, fused=True) for p in model.params]
    sent: list[concurrent.futures.Future[Any]] = []

    def hook(index: int, _: torch.Tensor) -> None:
        sent.append(stepper.submit((0, index), optimizers[index].step))

    for index, param in enumerate(model.params):
        param.register_post_accumulate_grad_hook(functools.partial(hook, index))  # type: ignore[no-untyped-call]

    async def step(t_b: float) -> float:
        model.backward(t_b)
        stepper.hurry()
        for future in sent:
            future.result()
        sent.clear()
        for optimizer in optimizers:
            optimizer.zero_grad()
        return time.perf_counter() - model.clock.started

    return step


async def _paced_offloaded(stack: contextlib.AsyncExitStack, numel: int, **options: Any) -> Step:
    import aoffload

    model = _PacedModel(numel)
    bucket_mb = numel * 4 / (1 << 20)  # one parameter per bucket
    opt = aoffload.OffloadAdam(model.params, lr=LR, backend="torch", bucket_mb=bucket_mb, **options)
    await stack.enter_async_context(opt)
    if len(opt._off.buckets) != PACED_PARAMS:
        raise RuntimeError(f"expected {PACED_PARAMS} buckets, got {len(opt._off.buckets)}")

    async def step(t_b: float) -> float:
        model.backward(t_b)  # the hooks submit each bucket from the loop's blocked thread
        await opt.astep()
        opt.zero_grad()
        return time.perf_counter() - model.clock.started

    return step


async def _paced_times(
    reps: int, numel: int
) -> tuple[list[float], list[float], dict[str, list[float]], list[float]]:
    """(t_adam's samples, measured first at t_b = 0; the plan of t_b; each system's step
    times along the plan; the sequential system's optimizer times along the plan)."""
    adam: list[float] = []
    async with contextlib.AsyncExitStack() as stack:
        sequential = _paced_in_process(adam, numel)
        systems: dict[str, Step] = {
            ALONE: _paced_in_process(None, numel),
            SEQUENTIAL: sequential,
            PACED: await _paced_offloaded(stack, numel),
            THREAD: _paced_thread(stack, numel),
        }
        await interleaved(systems, [0.0, 0.0])  # warm-up
        adam.clear()
        for _ in range(reps):
            await sequential(0.0)
        samples = list(adam)
        plan = [t_b for t_b in (*BACKWARDS, statistics.median(samples)) for _ in range(reps)]
        times = await interleaved(systems, plan)
        return samples, plan, times, adam[len(samples) :]


async def _paced_split_times(plan: list[float], numel: int) -> list[float]:
    """OffloadAdam with the cores split: it pins this process's threads to the other
    cores while it runs, so it cannot step in turn with the in-process systems."""
    async with contextlib.AsyncExitStack() as stack:
        step = await _paced_offloaded(stack, numel, worker_cores=SPLIT)
        await interleaved({PACED_SPLIT: step}, [0.0, 0.0])
        return (await interleaved({PACED_SPLIT: step}, plan))[PACED_SPLIT]


def _by_t_b(plan: list[float], times: list[float]) -> dict[float, list[float]]:
    out: dict[float, list[float]] = {}
    for t_b, seconds in zip(plan, times, strict=True):
        out.setdefault(t_b, []).append(seconds)
    return out


def _metric(t_b: float, label: str = "") -> str:
    return f"step, t_b = {t_b * 1e3:.3g} ms{label}"


def _copy_all(sources: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
    for source, target in zip(sources, targets, strict=True):
        ctypes.memmove(target.data_ptr(), source.data_ptr(), 4 * source.numel())


def _at_once_times(reps: int, cores: list[int], numel: int) -> dict[str, list[float]]:
    context = multiprocessing.get_context("spawn")  # never the global start method
    conn, child = context.Pipe()
    process = context.Process(
        target=_at_once.serve,
        args=(child, numel, PACED_PARAMS, LR, cores[-1]),
        name="aoffload-bench-adam",
        daemon=True,
    )
    process.start()
    child.close()
    mine = os.sched_getaffinity(0)
    try:
        if conn.recv() != "ready":
            raise RuntimeError("the AdamW process did not start")
        os.sched_setaffinity(0, {cores[0]})  # this thread only
        gen = torch.Generator().manual_seed(11)
        sources = [torch.randn(numel, generator=gen) for _ in range(PACED_PARAMS)]
        targets = [torch.zeros(numel).share_memory_() for _ in range(PACED_PARAMS)]  # type: ignore[no-untyped-call]
        times: dict[str, list[float]] = {COPIES: [], ADAM_ONE: [], AT_ONCE: []}
        for round_ in range(reps + 1):  # the first round warms up
            started = time.perf_counter()
            _copy_all(sources, targets)
            copied = time.perf_counter()
            conn.send(True)
            adam = conn.recv() - copied
            started_both = time.perf_counter()
            conn.send(True)
            _copy_all(sources, targets)
            ended = max(time.perf_counter(), conn.recv())
            if round_:
                times[COPIES].append(copied - started)
                times[ADAM_ONE].append(adam)
                times[AT_ONCE].append(ended - started_both)
        return times
    finally:
        os.sched_setaffinity(0, mine)
        conn.send(None)
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
        conn.close()


def _size(numel: int) -> str:
    return f"{PACED_PARAMS} x {numel / (1 << 20):g}M"


def at_once(report: Report, reps: int, *, smoke: bool = False) -> None:
    """What the ideal's ``max(b, t_adam)`` asks of this host: the backward's gradient copies
    and AdamW at full speed at the same time. Timed alone and at once, one core each."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        report.notes.append("offload_adam: one core, so no 'at once' figure")
        return
    progress("offload_adam: the gradient copies and AdamW, alone and at once")
    try:
        numel = SMOKE_NUMEL if smoke else PACED_NUMEL
        times = _at_once_times(reps, cores, numel)
    except Exception as exc:  # noqa: BLE001 - a failure is reported, the run goes on
        report.fail(SECTION, AT_ONCE, exc)
        return
    metric = f"{_size(numel)} fp32: copies, AdamW, or both"
    figures = {
        name: report.add(SECTION, name, metric, "s", samples) for name, samples in times.items()
    }
    alone = max(figures[COPIES].value, figures[ADAM_ONE].value)
    total = figures[COPIES].value + figures[ADAM_ONE].value
    report.tables.append(
        Table(
            SECTION,
            "The backward's gradient copies and AdamW on this host's cores: alone and at once",
            ["work", "time"],
            [
                [COPIES, format_value(figures[COPIES].value, "s")],
                [ADAM_ONE, format_value(figures[ADAM_ONE].value, "s")],
                [
                    AT_ONCE,
                    f"{format_value(figures[AT_ONCE].value, 's')} (the longer alone "
                    f"{format_value(alone, 's')}, the sum {format_value(total, 's')})",
                ],
            ],
        )
    )


def paced(report: Report, reps: int, *, smoke: bool = False) -> None:
    """The paced backward's figures, table and ratios."""
    progress(f"offload_adam: paced backward, {reps} rounds of 4 systems in turn per t_b")
    numel = SMOKE_NUMEL if smoke else PACED_NUMEL
    try:
        adam, plan, times, adam_along = asyncio.run(_paced_times(reps, numel))
    except Exception as exc:  # noqa: BLE001 - a failure is reported, the run goes on
        report.fail(SECTION, "paced backward", exc)
        return
    report.add(SECTION, SEQUENTIAL, f"optimizer alone (t_adam), {_size(numel)}", "s", adam)
    backwards = list(dict.fromkeys(plan))
    labels = {t_b: "" for t_b in BACKWARDS} | {backwards[-1]: " (= t_adam)"}
    measured = {system: _by_t_b(plan, samples) for system, samples in times.items()}
    progress(f"offload_adam: paced backward, {PACED_SPLIT}")
    try:
        measured[PACED_SPLIT] = _by_t_b(plan, asyncio.run(_paced_split_times(plan, numel)))
    except Exception as exc:  # noqa: BLE001 - a failure is reported, the run goes on
        report.fail(SECTION, PACED_SPLIT, exc)
    figures: dict[tuple[str, float], Figure] = {}
    for system, by_t_b in measured.items():
        for t_b in backwards:
            figures[system, t_b] = report.add(
                SECTION, system, _metric(t_b, labels[t_b]), "s", by_t_b[t_b]
            )
    rows: list[list[str]] = []
    ideal: dict[float, Figure] = {}
    if ALONE in measured:
        # Each round's own b and t_adam: the host's pace drifts between rounds.
        rounds = zip(plan, times[ALONE], adam_along, strict=True)
        per_round = _by_t_b(plan, [max(b, a) + a / PACED_PARAMS for _, b, a in rounds])
        for t_b in backwards:
            ideal[t_b] = report.add(
                SECTION,
                IDEAL,
                _metric(t_b, labels[t_b]),
                "s",
                per_round[t_b],
                note="each round: b, the paced backward alone; t_adam, the sequential "
                "system's optimizer, in the same round",
            )
    for system in (SEQUENTIAL, PACED, PACED_SPLIT, THREAD):
        if system not in measured:
            continue
        row = [system]
        for t_b in backwards:
            figure = figures[system, t_b]
            ratio = report.ratio(
                SECTION, f"{system} / ideal, {_metric(t_b, labels[t_b])}", figure, ideal.get(t_b)
            )
            cell = format_value(figure.value, "s")
            row.append(cell if ratio is None else f"{cell} ({ratio.value:.2f}x)")
        rows.append(row)
    against: list[list[str]] = []
    for system in (PACED, PACED_SPLIT, THREAD):
        row = [system]
        for t_b in backwards:
            ratio = report.ratio(
                SECTION,
                f"sequential / {system}, {_metric(t_b, labels[t_b])} (> 1: the overlap faster)",
                figures.get((SEQUENTIAL, t_b)),
                figures.get((system, t_b)),
            )
            row.append("—" if ratio is None else f"{ratio.value:.2f}x")
        against.append(row)
    for system in (ALONE, IDEAL):
        source = ideal if system == IDEAL else {t: figures.get((ALONE, t)) for t in backwards}
        if all(source.get(t) is not None for t in backwards):
            rows.append([system, *(format_value(source[t].value, "s") for t in backwards)])  # type: ignore[union-attr]
    header = [f"t_b = {t * 1e3:.3g} ms{labels[t]}" for t in backwards]
    report.tables.append(
        Table(
            SECTION,
            f"Paced backward, {_size(numel)} parameters (x the ideal)",
            ["system", *header],
            rows,
        )
    )
    report.tables.append(
        Table(
            SECTION,
            "Paced backward: the sequential step / each overlap (below 1: the overlap is slower "
            "than stepping after the backward)",
            ["system", *header],
            against,
        )
    )
