"""OffloadAdam section: a real training step, and a backward paced as an accelerator's.

**Real model.** A small transformer trained on this host's CPU: forward, backward and the
optimizer step (``zero_grad`` included), with in-process ``torch.optim.AdamW`` (foreach and
fused) against :class:`aoffload.OffloadAdam` (its defaults; the backward runs on the event
loop's thread, the step is ``await opt.astep()``). With ``max_grad_norm``, against the fused
AdamW after ``clip_grad_norm_``; and with smaller buckets than the default (the model is
about 21 MB of fp32: the default 32 MiB makes one bucket, sent when the backward ends).
Here the backward and the worker share the same cores.

**Paced backward.** 16 parameters of 1M fp32, each one bucket; parameter ``i``'s gradient
reaches autograd at ``(i + 1) * t_b / 16`` after the step starts (a custom autograd
function waits with ``time.sleep`` in its backward, as a trainer waits for an accelerator,
so the post-accumulate-grad hooks run on the real autograd path, on the loop's thread).
Sequential: in-process ``torch.optim.AdamW(fused=True)`` after the backward; its optimizer
time is ``t_adam``. OffloadAdam uses ``backend="torch"``, the same kernel. The ideal is
``max(b, t_adam) + t_adam / 16``, with ``b`` the paced backward measured alone (the
gradients' own copies included) at each ``t_b`` of the ``overlap`` section, plus
``t_b = t_adam``.

In both parts the systems step in turn, one step each per round, so that a burst of a
shared host's noise lands on all of them alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from ._common import Figure, Report, Table, format_value, progress
from ._overlap_report import BACKWARDS

SECTION = "offload_adam"
PACED_PARAMS, PACED_NUMEL = 16, 1 << 20
PACED_BUCKET_MB = PACED_NUMEL * 4 / (1 << 20)  # one parameter per bucket
LR = 1e-3

FOREACH = "in-process torch.optim.AdamW(foreach=True)"
FUSED = "in-process torch.optim.AdamW(fused=True)"
OFFLOAD = "aoffload OffloadAdam (defaults)"
FUSED_CLIP = "in-process AdamW(fused=True) after clip_grad_norm_(1.0)"
OFFLOAD_CLIP = "aoffload OffloadAdam (max_grad_norm=1.0)"
SMALL_BUCKETS = (4.0, 1.0)  # MiB: the default makes one or two buckets of this model


def offload_buckets(bucket_mb: float) -> str:
    return f"aoffload OffloadAdam (bucket_mb={bucket_mb:g})"


SEQUENTIAL = "in-process AdamW(fused=True), after the backward (sequential)"
PACED = "aoffload OffloadAdam (backend='torch')"
SPLIT = 0.5
PACED_SPLIT = f"aoffload OffloadAdam (backend='torch', worker_cores={SPLIT:g}; run after)"
ALONE = "paced backward alone, no optimizer"
IDEAL = "ideal: max(b, t_adam) + t_adam / 16"


# -- the real model -----------------------------------------------------------------------


def _transformer() -> tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]:
    torch.manual_seed(0)
    width, vocab, length = 256, 4096, 64
    layer = torch.nn.TransformerEncoderLayer(
        width, nhead=8, dim_feedforward=4 * width, dropout=0.0, batch_first=True
    )
    model = torch.nn.Sequential(
        torch.nn.Embedding(vocab, width),
        torch.nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False),
        torch.nn.Linear(width, vocab),
    )
    tokens = torch.randint(0, vocab, (8, length + 1), generator=torch.Generator().manual_seed(1))

    def loss_of(m: torch.nn.Module) -> torch.Tensor:
        logits = m(tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].flatten())

    return model, loss_of


Step = Callable[[float], Awaitable[float]]  # one step at this t_b -> its seconds


async def _interleaved(systems: dict[str, Step], plan: list[float]) -> dict[str, list[float]]:
    """Every system steps once per entry of ``plan``, in turn: a burst of the shared host's
    noise lands on all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in systems}
    for t_b in plan:
        for name, step in systems.items():
            times[name].append(await step(t_b))
    return times


def _in_process(clip: float | None, **options: Any) -> Step:
    model, loss_of = _transformer()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, **options)

    async def step(_: float) -> float:
        started = time.perf_counter()
        torch.autograd.backward(loss_of(model))
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - started

    return step


async def _offloaded(
    stack: contextlib.AsyncExitStack, clip: float | None, **options: Any
) -> tuple[Step, str]:
    import aoffload

    model, loss_of = _transformer()
    opt = aoffload.OffloadAdam(model.parameters(), lr=LR, max_grad_norm=clip, **options)
    await stack.enter_async_context(opt)

    async def step(_: float) -> float:
        started = time.perf_counter()
        torch.autograd.backward(loss_of(model))  # the loop's thread: the loop does not turn
        await opt.astep()
        opt.zero_grad()
        return time.perf_counter() - started

    return step, f"backend={opt.backend}, {len(opt._off.buckets)} buckets"


async def _real_model_times(reps: int, notes: dict[str, str]) -> dict[str, list[float]]:
    async with contextlib.AsyncExitStack() as stack:
        systems: dict[str, Step] = {
            FOREACH: _in_process(None, foreach=True),
            FUSED: _in_process(None, fused=True),
            FUSED_CLIP: _in_process(1.0, fused=True),
        }
        for system, clip in ((OFFLOAD, None), (OFFLOAD_CLIP, 1.0)):
            systems[system], notes[system] = await _offloaded(stack, clip)
        for bucket_mb in SMALL_BUCKETS:
            system = offload_buckets(bucket_mb)
            systems[system], notes[system] = await _offloaded(stack, None, bucket_mb=bucket_mb)
        times = await _interleaved(systems, [0.0] * (reps + 2))
        return {name: samples[2:] for name, samples in times.items()}  # two warm-up rounds


def _real_model(report: Report, reps: int) -> None:
    model, _ = _transformer()
    numel = sum(p.numel() for p in model.parameters())
    metric = f"step (forward, backward, optimizer), transformer of {numel / 1e6:.1f}M parameters"
    progress(f"offload_adam: real model, {reps} rounds of 7 systems in turn")
    notes: dict[str, str] = {}
    try:
        measured = asyncio.run(_real_model_times(reps, notes))
    except Exception as exc:  # noqa: BLE001 - a failure is reported, the run goes on
        report.fail(SECTION, "real model", exc)
        return
    figures = {
        system: report.add(SECTION, system, metric, "s", times, note=notes.get(system, ""))
        for system, times in measured.items()
    }
    rows = []
    for system, anchor in (
        (FOREACH, FUSED),
        (FUSED, FUSED),
        (OFFLOAD, FUSED),
        *((offload_buckets(mb), FUSED) for mb in SMALL_BUCKETS),
        (FUSED_CLIP, FUSED_CLIP),
        (OFFLOAD_CLIP, FUSED_CLIP),
    ):
        figure = figures.get(system)
        if figure is None:
            continue
        ratio = report.ratio(
            SECTION, f"{system} / {anchor} (real model)", figure, figures.get(anchor)
        )
        cell = format_value(figure.value, "s")
        rows.append([system, cell if ratio is None else f"{cell} ({ratio.value:.2f}x)"])
    for system in (OFFLOAD, OFFLOAD_CLIP):
        report.ratio(
            SECTION, f"{system} / {FOREACH} (real model)", figures.get(system), figures.get(FOREACH)
        )
    report.tables.append(
        Table(SECTION, f"Real model on this host's CPU: {metric}", ["system", "step (x)"], rows)
    )


# -- the paced backward -------------------------------------------------------------------


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
    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(7)
        self.params = [
            torch.nn.Parameter(torch.randn(PACED_NUMEL, generator=gen)) for _ in range(PACED_PARAMS)
        ]
        self.clock = _Clock([torch.randn(PACED_NUMEL, generator=gen) for _ in self.params])

    def backward(self, t_b: float) -> None:
        carry = torch.zeros(())
        for index, param in enumerate(self.params):
            carry = _Paced.apply(param, carry, self.clock, index)  # type: ignore[no-untyped-call]
        self.clock.t_b = t_b
        self.clock.started = time.perf_counter()
        torch.autograd.backward(carry)


def _paced_in_process(adam: list[float] | None) -> Step:
    """Sequential: the paced backward, then AdamW(fused=True) (its time into ``adam``);
    with ``adam=None``, the backward alone."""
    model = _PacedModel()
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


async def _paced_offloaded(stack: contextlib.AsyncExitStack, **options: Any) -> Step:
    import aoffload

    model = _PacedModel()
    opt = aoffload.OffloadAdam(
        model.params, lr=LR, backend="torch", bucket_mb=PACED_BUCKET_MB, **options
    )
    await stack.enter_async_context(opt)
    if len(opt._off.buckets) != PACED_PARAMS:
        raise RuntimeError(f"expected {PACED_PARAMS} buckets, got {len(opt._off.buckets)}")

    async def step(t_b: float) -> float:
        model.backward(t_b)  # the hooks submit each bucket from the loop's blocked thread
        await opt.astep()
        opt.zero_grad()
        return time.perf_counter() - model.clock.started

    return step


async def _paced_times(reps: int) -> tuple[list[float], list[float], dict[str, list[float]]]:
    """(t_adam's samples, measured first at t_b = 0; the plan of t_b; each system's step
    times along the plan)."""
    adam: list[float] = []
    async with contextlib.AsyncExitStack() as stack:
        sequential = _paced_in_process(adam)
        systems: dict[str, Step] = {
            ALONE: _paced_in_process(None),
            SEQUENTIAL: sequential,
            PACED: await _paced_offloaded(stack),
        }
        await _interleaved(systems, [0.0, 0.0])  # warm-up
        adam.clear()
        for _ in range(reps):
            await sequential(0.0)
        samples = list(adam)
        plan = [t_b for t_b in (*BACKWARDS, statistics.median(samples)) for _ in range(reps)]
        return samples, plan, await _interleaved(systems, plan)


async def _paced_split_times(plan: list[float]) -> list[float]:
    """OffloadAdam with the cores split: it pins this process's threads to the other
    cores while it runs, so it cannot step in turn with the in-process systems."""
    async with contextlib.AsyncExitStack() as stack:
        step = await _paced_offloaded(stack, worker_cores=SPLIT)
        await _interleaved({PACED_SPLIT: step}, [0.0, 0.0])
        return (await _interleaved({PACED_SPLIT: step}, plan))[PACED_SPLIT]


def _by_t_b(plan: list[float], times: list[float]) -> dict[float, list[float]]:
    out: dict[float, list[float]] = {}
    for t_b, seconds in zip(plan, times, strict=True):
        out.setdefault(t_b, []).append(seconds)
    return out


def _metric(t_b: float, label: str = "") -> str:
    return f"step, t_b = {t_b * 1e3:.3g} ms{label}"


def _paced(report: Report, reps: int) -> None:
    progress(f"offload_adam: paced backward, {reps} rounds of 3 systems in turn per t_b")
    try:
        adam, plan, times = asyncio.run(_paced_times(reps))
    except Exception as exc:  # noqa: BLE001 - a failure is reported, the run goes on
        report.fail(SECTION, "paced backward", exc)
        return
    t_adam = report.add(SECTION, SEQUENTIAL, "optimizer alone (t_adam), 16 x 1M", "s", adam)
    backwards = list(dict.fromkeys(plan))
    labels = {t_b: "" for t_b in BACKWARDS} | {backwards[-1]: " (= t_adam)"}
    measured = {system: _by_t_b(plan, samples) for system, samples in times.items()}
    progress(f"offload_adam: paced backward, {PACED_SPLIT}")
    try:
        measured[PACED_SPLIT] = _by_t_b(plan, asyncio.run(_paced_split_times(plan)))
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
        for t_b in backwards:
            alone = figures[ALONE, t_b].value
            ideal[t_b] = report.add(
                SECTION,
                IDEAL,
                _metric(t_b, labels[t_b]),
                "s",
                [max(alone, a) + a / PACED_PARAMS for a in t_adam.samples],
                note="b: the paced backward alone (median); from each t_adam sample",
            )
    for system in (SEQUENTIAL, PACED, PACED_SPLIT):
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
    for t_b in backwards:
        for system in (PACED, PACED_SPLIT):
            report.ratio(
                SECTION,
                f"sequential / {system}, {_metric(t_b, labels[t_b])} (> 1: OffloadAdam faster)",
                figures.get((SEQUENTIAL, t_b)),
                figures.get((system, t_b)),
            )
    for system in (ALONE, IDEAL):
        source = ideal if system == IDEAL else {t: figures.get((ALONE, t)) for t in backwards}
        if all(source.get(t) is not None for t in backwards):
            rows.append([system, *(format_value(source[t].value, "s") for t in backwards)])  # type: ignore[union-attr]
    header = [f"t_b = {t * 1e3:.3g} ms{labels[t]}" for t in backwards]
    report.tables.append(
        Table(
            SECTION,
            "Paced backward, 16 x 1M parameters (x the ideal)",
            ["system", *header],
            rows,
        )
    )


def run(report: Report, *, quick: bool) -> None:
    """A real model's step against in-process AdamW; a paced backward against the ideal."""
    reps = 3 if quick else 7
    threads = torch.get_num_threads()
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        _real_model(report, reps)
        _paced(report, reps)
    finally:
        torch.set_num_threads(threads)
        if affinity is not None:
            os.sched_setaffinity(0, affinity)
    report.notes.append(
        "offload_adam: the backward and the step run on the event loop's thread (the loop "
        "does not turn until astep() awaits); the paced backward waits with time.sleep in a "
        "custom autograd function, so OffloadAdam's hooks run on autograd's real path; the "
        "systems of each part step in turn, one step each per round"
    )
