"""One small training run, by torch.optim.AdamW (the reference) and by OffloadAdam (async and
sync): an MLP with two param groups, a StepLR schedule, and the options every parity test
varies (clipping, an injected overflow, gradient accumulation, bf16 parameters)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

import aoffload
from aoffload._runtime.threads import run_in_thread

LR = 1e-2
_T = TypeVar("_T")


async def off_loop(fn: Callable[..., _T], *args: object) -> _T:
    """``fn(*args)`` on a thread of its own, awaited: a test's heavy backward or reference
    step, which the loop guard would otherwise time instead of ``astep()``."""
    return await run_in_thread(fn, *args, name="test-off-loop")


@dataclass(frozen=True)
class Run:
    steps: int = 24
    clip: float | None = None
    skip_nonfinite: bool = False
    overflow_at: int | None = None  # this step's loss is scaled by inf
    micro: int = 1  # micro-batches per step (gradient accumulation)
    dtype: torch.dtype = torch.float32
    bucket_mb: float = 0.01  # several buckets for this MLP
    backend: str = "torch"


def mlp(dtype: torch.dtype = torch.float32) -> torch.nn.Sequential:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 1),
    )  # fmt: skip
    return model.to(dtype)


def groups(model: torch.nn.Module) -> list[dict[str, object]]:
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0},
    ]


def twins() -> tuple[torch.nn.Sequential, torch.nn.Sequential, Run, torch.optim.AdamW]:
    """Two identical MLPs, the default run, and the reference AdamW over the second's groups."""
    model, twin = mlp(), mlp()
    return model, twin, Run(), torch.optim.AdamW(groups(twin), lr=LR, fused=True)


def loss_of(model: torch.nn.Module, step: int, micro: int, run: Run) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(32, 16, generator=gen)
    y = (x.sin().sum(dim=1, keepdim=True) * 3).to(run.dtype)
    loss = torch.nn.functional.mse_loss(model(x.to(run.dtype)), y) / run.micro
    return loss * math.inf if step == run.overflow_at else loss


def backward(model: torch.nn.Module, step: int, run: Run, no_sync: Callable[[], object]) -> None:
    for micro in range(run.micro):
        last = micro == run.micro - 1
        context = contextlib.nullcontext() if last else no_sync()
        with context:  # type: ignore[attr-defined]
            loss_of(model, step, micro, run).backward()


def reference(run: Run, *, fused: bool = True) -> list[torch.Tensor]:
    """torch.optim.AdamW: clip first, then step; an overflowed step is skipped (as a loss
    scaler skips it). bf16 parameters step through fp32 copies."""
    model = mlp(run.dtype)
    masters = mlp(torch.float32)  # fp32 masters, from the (maybe rounded) parameters
    with torch.no_grad():
        for p, q in zip(model.parameters(), masters.parameters(), strict=True):
            q.copy_(p)
    opt = torch.optim.AdamW(groups(masters), lr=LR, fused=fused, foreach=None if fused else True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    for step in range(run.steps):
        backward(model, step, run, contextlib.nullcontext)
        for p, q in zip(model.parameters(), masters.parameters(), strict=True):
            q.grad = p.grad.float()
        grads = [q.grad for q in masters.parameters()]
        finite = all(bool(torch.isfinite(g).all()) for g in grads)
        if finite:
            if run.clip is not None:  # over the optimizer's parameters, in its order
                ordered = [p for group in opt.param_groups for p in group["params"]]
                torch.nn.utils.clip_grad_norm_(ordered, run.clip)
            opt.step()
        opt.zero_grad()
        model.zero_grad()
        sched.step()
        with torch.no_grad():
            for p, q in zip(model.parameters(), masters.parameters(), strict=True):
                p.copy_(q)
    return [p.detach().clone() for p in model.parameters()]


def offload_adam(model: torch.nn.Module, run: Run) -> aoffload.OffloadAdam:
    return aoffload.OffloadAdam(
        groups(model),
        lr=LR,
        backend=run.backend,
        bucket_mb=run.bucket_mb,
        max_grad_norm=run.clip,
        skip_nonfinite=run.skip_nonfinite,
    )


async def offloaded(run: Run) -> tuple[list[torch.Tensor], list[aoffload.StepReport]]:
    """OffloadAdam, asyncio form."""
    model = mlp(run.dtype)
    opt = offload_adam(model, run)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    reports = []
    async with opt:
        for step in range(run.steps):
            backward(model, step, run, opt.no_sync)
            reports.append(await opt.astep())
            opt.zero_grad()
            sched.step()
    return [p.detach().clone() for p in model.parameters()], reports


def offloaded_sync(run: Run) -> tuple[list[torch.Tensor], list[aoffload.StepReport]]:
    """OffloadAdam, synchronous form: no event loop anywhere."""
    model = mlp(run.dtype)
    opt = offload_adam(model, run)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    reports = []
    with opt:
        for step in range(run.steps):
            backward(model, step, run, opt.no_sync)
            opt.step()
            assert opt.last_step is not None
            reports.append(opt.last_step)
            opt.zero_grad()
            sched.step()
    return [p.detach().clone() for p in model.parameters()], reports


def assert_identical(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for index, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(a, b), f"parameter {index}: max diff {(a - b).abs().max().item()}"


def assert_relative(got: list[torch.Tensor], expected: list[torch.Tensor], rtol: float) -> None:
    for index, (a, b) in enumerate(zip(got, expected, strict=True)):
        error = (a.double() - b.double()).abs().max().item() / b.double().abs().max().item()
        assert error <= rtol, f"parameter {index}: relative error {error:.3g} > {rtol:g}"
