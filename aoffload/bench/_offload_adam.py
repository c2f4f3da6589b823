"""OffloadAdam section: a real training step, and a backward paced as an accelerator's.

**Real model.** A small transformer trained on this host's CPU: forward, backward and the
optimizer step (``zero_grad`` included), with in-process ``torch.optim.AdamW`` (foreach and
fused) against :class:`aoffload.OffloadAdam` (its defaults; the backward runs on the event
loop's thread, the step is ``await opt.astep()``). With ``max_grad_norm``, against the fused
AdamW after ``clip_grad_norm_``; and with smaller buckets than the default (the model is
about 21 MB of fp32: the default 32 MiB makes one bucket, sent when the backward ends).
Here the backward and the worker share the same cores.

**Paced backward** (:mod:`._offload_adam_paced`): 16 buckets whose gradients arrive on an
accelerator's schedule, against the sequential step, the ideal, and the most any overlap
can reach on this host.

In both parts the systems step in turn, one step each per round, so that a burst of a
shared host's noise lands on all of them alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from ._common import Report, Table, format_value, progress
from ._offload_adam_paced import (
    ADAM_ONE,
    ALONE,
    AT_ONCE,
    COPIES,
    IDEAL,
    LR,
    PACED,
    PACED_SPLIT,
    SECTION,
    SEQUENTIAL,
    THREAD,
    Step,
    at_once,
    interleaved,
    paced,
)
from ._overlap_report import BACKWARDS

__all__ = [
    "ADAM_ONE",
    "ALONE",
    "AT_ONCE",
    "BACKWARDS",
    "COPIES",
    "FOREACH",
    "FUSED",
    "FUSED_CLIP",
    "IDEAL",
    "OFFLOAD",
    "OFFLOAD_CLIP",
    "PACED",
    "PACED_SPLIT",
    "SECTION",
    "SEQUENTIAL",
    "THREAD",
    "run",
]

FOREACH = "in-process torch.optim.AdamW(foreach=True)"
FUSED = "in-process torch.optim.AdamW(fused=True)"
OFFLOAD = "aoffload OffloadAdam (defaults)"
FUSED_CLIP = "in-process AdamW(fused=True) after clip_grad_norm_(1.0)"
OFFLOAD_CLIP = "aoffload OffloadAdam (max_grad_norm=1.0)"
SMALL_BUCKETS = (4.0, 1.0)  # MiB: the default makes one or two buckets of this model


def offload_buckets(bucket_mb: float) -> str:
    return f"aoffload OffloadAdam (bucket_mb={bucket_mb:g})"


# -- the real model -----------------------------------------------------------------------


def _transformer(
    small: bool = False,
) -> tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]:
    """The model (``small``, for --smoke: about 1M parameters, still several 1 MiB buckets)."""
    torch.manual_seed(0)
    width, vocab, length, layers = (128, 2048, 32, 2) if small else (256, 4096, 64, 4)
    layer = torch.nn.TransformerEncoderLayer(
        width, nhead=8, dim_feedforward=4 * width, dropout=0.0, batch_first=True
    )
    model = torch.nn.Sequential(
        torch.nn.Embedding(vocab, width),
        torch.nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False),
        torch.nn.Linear(width, vocab),
    )
    tokens = torch.randint(0, vocab, (8, length + 1), generator=torch.Generator().manual_seed(1))

    def loss_of(m: torch.nn.Module) -> torch.Tensor:
        logits = m(tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].flatten())

    return model, loss_of


def _in_process(small: bool, clip: float | None, **options: Any) -> Step:
    model, loss_of = _transformer(small)
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
    stack: contextlib.AsyncExitStack, small: bool, clip: float | None, **options: Any
) -> tuple[Step, str]:
    import aoffload

    model, loss_of = _transformer(small)
    opt = aoffload.OffloadAdam(model.parameters(), lr=LR, max_grad_norm=clip, **options)
    await stack.enter_async_context(opt)

    async def step(_: float) -> float:
        started = time.perf_counter()
        torch.autograd.backward(loss_of(model))  # the loop's thread: the loop does not turn
        await opt.astep()
        opt.zero_grad()
        return time.perf_counter() - started

    return step, f"backend={opt.backend}, {len(opt._off.buckets)} buckets"


async def _real_model_times(
    reps: int, notes: dict[str, str], small: bool
) -> dict[str, list[float]]:
    async with contextlib.AsyncExitStack() as stack:
        systems: dict[str, Step] = {
            FOREACH: _in_process(small, None, foreach=True),
            FUSED: _in_process(small, None, fused=True),
            FUSED_CLIP: _in_process(small, 1.0, fused=True),
        }
        for system, clip in ((OFFLOAD, None), (OFFLOAD_CLIP, 1.0)):
            systems[system], notes[system] = await _offloaded(stack, small, clip)
        for bucket_mb in SMALL_BUCKETS:
            system = offload_buckets(bucket_mb)
            systems[system], notes[system] = await _offloaded(
                stack, small, None, bucket_mb=bucket_mb
            )
        times = await interleaved(systems, [0.0] * (reps + 2))
        return {name: samples[2:] for name, samples in times.items()}  # two warm-up rounds


def _real_model(report: Report, reps: int, small: bool) -> None:
    model, _ = _transformer(small)
    numel = sum(p.numel() for p in model.parameters())
    metric = f"step (forward, backward, optimizer), transformer of {numel / 1e6:.1f}M parameters"
    progress(f"offload_adam: real model, {reps} rounds of 7 systems in turn")
    notes: dict[str, str] = {}
    try:
        measured = asyncio.run(_real_model_times(reps, notes, small))
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


def run(report: Report, *, quick: bool, smoke: bool = False) -> None:
    """A real model's step against in-process AdamW; a paced backward against the ideal."""
    reps = 3 if quick else 7
    threads = torch.get_num_threads()
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        _real_model(report, reps, smoke)
        paced(report, reps)
        at_once(report, 3 * reps)
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
