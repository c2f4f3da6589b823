"""What users do to the gradients between ``backward()`` and ``step()`` (``clip_grad_norm_``,
``GradScaler``, a hand edit) stays exact with OffloadAdam: the buckets the backward had
already sent are rolled back and stepped again, and the result is ``AdamW(fused=True)``'s
after the same edit, bit for bit (``backend="torch"``)."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable

import pytest
import torch

import aoffload

from . import _offload as o

Edit = Callable[[torch.nn.Module], None]


def _linear_run(
    make: Callable[[torch.nn.Module], torch.optim.Optimizer], edit: Edit, steps: int = 5
) -> tuple[list[torch.Tensor], list[aoffload.StepReport | None]]:
    """The issue's reproduction: a Linear(64, 8), lr 1e-2, ``edit`` before every step, in a
    plain synchronous loop."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 8)
    opt = make(model)
    reports = []
    with opt if isinstance(opt, aoffload.OffloadAdam) else contextlib.nullcontext():
        for step in range(steps):
            gen = torch.Generator().manual_seed(step)
            x, y = torch.randn(16, 64, generator=gen), torch.randn(16, 8, generator=gen)
            torch.nn.functional.mse_loss(model(x), y).backward()
            edit(model)
            opt.step()
            opt.zero_grad()
            reports.append(getattr(opt, "last_step", None))
    return [p.detach().clone() for p in model.parameters()], reports


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)


def _offload_adam(model: torch.nn.Module) -> torch.optim.Optimizer:
    return aoffload.OffloadAdam(model.parameters(), lr=1e-2, backend="torch")


def _clip(model: torch.nn.Module) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)


def _halve_weight(model: torch.nn.Module) -> None:
    model.weight.grad.mul_(0.5)  # type: ignore[union-attr]


def _replace_bias(model: torch.nn.Module) -> None:
    model.bias.grad = model.bias.grad * 3.0  # type: ignore[operator]


@pytest.mark.parametrize(
    "edit", [_clip, _halve_weight, _replace_bias], ids=["clip_grad_norm_", "mul_", "replaced"]
)
def test_a_gradient_edited_before_the_step_is_bit_identical_to_adamw_fused(edit: Edit) -> None:
    expected, _ = _linear_run(_adamw, edit)
    got, reports = _linear_run(_offload_adam, edit)
    o.assert_identical(got, expected)  # before: 0.019-0.050 apart with clip_grad_norm_
    assert all(r is not None and r.redone == 1 for r in reports)  # one bucket, redone


def test_nothing_is_redone_when_nothing_is_edited() -> None:
    expected, _ = _linear_run(_adamw, lambda model: None)
    got, reports = _linear_run(_offload_adam, lambda model: None)
    o.assert_identical(got, expected)
    assert all(r is not None and r.redone == 0 for r in reports)


@pytest.fixture
def twins() -> tuple[torch.nn.Sequential, torch.nn.Sequential, o.Run, torch.optim.AdamW]:
    """The MLPs and the reference AdamW, made outside the test's event loop."""
    return o.twins()


async def test_astep_redoes_only_the_edited_bucket(
    twins: tuple[torch.nn.Sequential, torch.nn.Sequential, o.Run, torch.optim.AdamW],
) -> None:
    """Several buckets: an edit of one parameter's gradient redoes its bucket alone. The
    training's own work runs on a thread, so the loop guard watches the library alone."""
    model, twin, run, adamw = twins

    def backward_and_edit(step: int) -> None:
        for m in (model, twin):
            o.loss_of(m, step, 0, run).backward()
            m[2].weight.grad.mul_(0.25)  # type: ignore[union-attr]
        adamw.step()

    async with o.offload_adam(model, run) as opt:
        assert len(opt._off.buckets) > 2
        for step in range(4):
            await asyncio.to_thread(backward_and_edit, step)
            report = await opt.astep()
            assert report.redone == 1, report
            opt.zero_grad()
            adamw.zero_grad()
    o.assert_identical([p.detach() for p in model.parameters()], list(twin.parameters()))


def _scaled_run(
    make: Callable[[torch.nn.Module], torch.optim.Optimizer], unscale: bool, inf_at: int
) -> tuple[list[torch.Tensor], list[float], list[aoffload.StepReport | None]]:
    """A GradScaler loop (``torch.amp.GradScaler("cpu")``) with an inf loss at ``inf_at``;
    with ``unscale``, ``unscale_`` then ``clip_grad_norm_`` before ``scaler.step``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 8)
    opt = make(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    scales, reports = [], []
    with opt if isinstance(opt, aoffload.OffloadAdam) else contextlib.nullcontext():
        for step in range(6):
            gen = torch.Generator().manual_seed(step)
            x, y = torch.randn(16, 64, generator=gen), torch.randn(16, 8, generator=gen)
            loss = torch.nn.functional.mse_loss(model(x), y)
            scaler.scale(loss * math.inf if step == inf_at else loss).backward()
            if unscale:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            scales.append(scaler.get_scale())
            reports.append(getattr(opt, "last_step", None))
    return [p.detach().clone() for p in model.parameters()], scales, reports


@pytest.mark.parametrize("unscale", [True, False], ids=["unscale_+clip", "step only"])
def test_grad_scaler_is_bit_identical_and_an_inf_step_is_skipped(unscale: bool) -> None:
    expected, expected_scales, _ = _scaled_run(_adamw, unscale, inf_at=2)
    got, scales, reports = _scaled_run(_offload_adam, unscale, inf_at=2)
    o.assert_identical(got, expected)
    assert scales == expected_scales  # the scaler saw the same overflow: 1024 at step 2
    assert expected_scales[2] == expected_scales[0] == 2.0**10
    skipped = [i for i, r in enumerate(reports) if r is not None and r.skipped]
    assert skipped == [2]  # step 2 was skipped, every other step was taken and redone
    assert all(r is not None and r.redone == 1 for i, r in enumerate(reports) if i != 2)
