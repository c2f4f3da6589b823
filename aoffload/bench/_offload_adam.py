"""OffloadAdam section: a real training step, and a backward paced as an accelerator's.

**Real model.** A small transformer trained on this host's CPU (or, with ``--device cuda``,
on the GPU): forward, backward and the optimizer step (``zero_grad`` included), with
in-process ``torch.optim.AdamW`` (foreach and fused) against :class:`aoffload.OffloadAdam`
(its defaults; the backward runs on the event loop's thread, the step is ``await
opt.astep()``). With ``max_grad_norm``, against the fused AdamW after ``clip_grad_norm_``
and against DeepSpeed's ZeRO-Offload (ZeRO stage 2 with ``offload_optimizer: cpu``:
DeepSpeed's CPU Adam in the trainer's process, after the backward) with
``gradient_clipping``: like for like, since ZeRO-Offload always computes the global norm
and skips a step whose norm is not finite (DeepSpeed 0.19.8 refuses
``compute_grad_norm: false`` with an offloaded optimizer), as ``max_grad_norm`` does; and
with smaller buckets than the default (the model is about 21 MB of fp32: the default 32 MiB
makes one bucket, sent when the backward ends). On the CPU the backward and the worker share
the same cores. On a GPU each step ends with ``torch.cuda.synchronize()``: it ends when the
parameters on the device are updated.

**Paced backward** (:mod:`._offload_adam_paced`): 16 buckets whose gradients arrive on an
accelerator's schedule, against the sequential step, the ideal, and the most any overlap
can reach on this host.

In both parts the systems step in turn, one step each per round, so that a burst of a
shared host's noise lands on all of them alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
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
    "ZERO_OFFLOAD",
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
OFFLOAD_CLIP = "aoffload OffloadAdam (max_grad_norm=1.0: clips, skips a non-finite step)"
ZERO_OFFLOAD = (
    "DeepSpeed ZeRO-Offload (stage 2, offload_optimizer: cpu, gradient_clipping=1.0: "
    "clips, skips a non-finite step)"
)
CLIP = 1.0
SMALL_BUCKETS = (4.0, 1.0)  # MiB: the default makes one or two buckets of this model


def offload_buckets(bucket_mb: float) -> str:
    return f"aoffload OffloadAdam (bucket_mb={bucket_mb:g})"


# -- the real model -----------------------------------------------------------------------


BATCH = 8


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _transformer(
    small: bool = False, device: str = "cpu"
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
    ).to(device)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (BATCH, length + 1), generator=generator).to(device)

    def loss_of(m: torch.nn.Module) -> torch.Tensor:
        logits = m(tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].flatten())

    return model, loss_of


def _in_process(small: bool, device: str, clip: float | None, **options: Any) -> Step:
    model, loss_of = _transformer(small, device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, **options)

    async def step(_: float) -> float:
        started = time.perf_counter()
        torch.autograd.backward(loss_of(model))
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        _sync(device)
        return time.perf_counter() - started

    return step


def _zero_offload(small: bool, device: str) -> tuple[Step, str]:
    """DeepSpeed's own CPU-offloaded AdamW on the same model, in this process (a world of
    one, gloo): ``deepspeed.initialize`` with ZeRO stage 2, ``offload_optimizer: cpu`` and
    ``gradient_clipping``, compared with ``OffloadAdam(max_grad_norm=...)``: both compute the
    global norm, clip by it and skip a non-finite step."""
    import deepspeed

    from ._checkpoint_systems import init_single_process_group

    init_single_process_group()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    model, loss_of = _transformer(small, device)
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 1e-2}},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    }
    engine, *_ = deepspeed.initialize(
        model=model, config=config, model_parameters=model.parameters()
    )

    async def step(_: float) -> float:
        started = time.perf_counter()
        engine.backward(loss_of(engine))
        engine.step()  # the optimizer step and zero_grad
        _sync(device)
        return time.perf_counter() - started

    optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)
    return step, f"DeepSpeed {deepspeed.__version__}, {type(optimizer).__name__}"


async def _offloaded(
    stack: contextlib.AsyncExitStack, small: bool, device: str, clip: float | None, **options: Any
) -> tuple[Step, str]:
    import aoffload

    model, loss_of = _transformer(small, device)
    opt = aoffload.OffloadAdam(model.parameters(), lr=LR, max_grad_norm=clip, **options)
    await stack.enter_async_context(opt)

    async def step(_: float) -> float:
        started = time.perf_counter()
        torch.autograd.backward(loss_of(model))  # the loop's thread: the loop does not turn
        await opt.astep()
        opt.zero_grad()
        _sync(device)
        return time.perf_counter() - started

    return step, f"backend={opt.backend}, {len(opt._off.buckets)} buckets"


async def _real_model_times(
    reps: int, notes: dict[str, str], small: bool, device: str, report: Report
) -> dict[str, list[float]]:
    async with contextlib.AsyncExitStack() as stack:
        systems: dict[str, Step] = {
            FOREACH: _in_process(small, device, None, foreach=True),
            FUSED: _in_process(small, device, None, fused=True),
            FUSED_CLIP: _in_process(small, device, CLIP, fused=True),
        }
        for system, clip in ((OFFLOAD, None), (OFFLOAD_CLIP, CLIP)):
            systems[system], notes[system] = await _offloaded(stack, small, device, clip)
        for bucket_mb in SMALL_BUCKETS:
            system = offload_buckets(bucket_mb)
            systems[system], notes[system] = await _offloaded(
                stack, small, device, None, bucket_mb=bucket_mb
            )
        try:
            systems[ZERO_OFFLOAD], notes[ZERO_OFFLOAD] = _zero_offload(small, device)
        except Exception as exc:  # noqa: BLE001 - a failure is reported, the rest is measured
            report.fail(SECTION, ZERO_OFFLOAD, exc)
        warm = 1 if reps == 1 else 2  # --smoke: one warm-up round, one measured
        times = await interleaved(systems, [0.0] * (reps + warm))
        return {name: samples[warm:] for name, samples in times.items()}


def _real_model(report: Report, reps: int, small: bool, device: str) -> None:
    model, _ = _transformer(small)
    numel = sum(p.numel() for p in model.parameters())
    on_gpu = " on the GPU" if device == "cuda" else ""
    where = on_gpu or " on the CPU"
    metric = f"step (forward, backward, optimizer), transformer of {numel / 1e6:.1f}M parameters"
    metric += on_gpu
    progress(f"offload_adam: real model{where}, {reps} rounds of 8 systems in turn")
    notes: dict[str, str] = {}
    try:
        measured = asyncio.run(_real_model_times(reps, notes, small, device, report))
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
        (ZERO_OFFLOAD, FUSED_CLIP),
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
    report.ratio(  # like for like: both clip by the global norm and skip a non-finite step
        SECTION,
        f"{OFFLOAD_CLIP} / {ZERO_OFFLOAD} (real model, like for like; < 1: OffloadAdam faster)",
        figures.get(OFFLOAD_CLIP),
        figures.get(ZERO_OFFLOAD),
    )
    report.tables.append(
        Table(SECTION, f"Real model{where}: {metric}", ["system", "step (x)"], rows)
    )


def run(report: Report, *, quick: bool, smoke: bool = False, device: str = "cpu") -> None:
    """A real model's step against in-process AdamW and ZeRO-Offload (on ``device``); a
    paced backward against the ideal (on the CPU)."""
    reps = 1 if smoke else 3 if quick else 7  # --smoke: every system steps once, measured
    threads = torch.get_num_threads()
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        if device == "cuda" and not torch.cuda.is_available():
            report.skip(SECTION, "real model on the GPU", "no CUDA device")
        else:
            _real_model(report, reps, smoke, device)
        paced(report, reps, smoke=smoke)
        at_once(report, 3 * reps, smoke=smoke)
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
