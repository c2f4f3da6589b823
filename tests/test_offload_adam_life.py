"""OffloadAdam's lifecycle, as the rest of the library's: ``with`` / ``start()`` / ``close()``
and ``async with`` / ``astart()`` / ``aclose()``. The optimizer outlives its worker: its state
is there before the first start and after a close, and a closed one starts again with it, so
train and eval blocks alternate and every next step is the one an unbroken run would take."""

from __future__ import annotations

import asyncio

import pytest
import torch

import aoffload
from aoffload.testing import kill_worker

from . import _offload as o


def _adamw_run(steps: int, run: o.Run) -> tuple[list[torch.Tensor], torch.optim.AdamW]:
    model = o.mlp(run.dtype)
    adamw = torch.optim.AdamW(o.groups(model), lr=o.LR, fused=True)
    for step in range(steps):
        o.loss_of(model, step, 0, run).backward()
        adamw.step()
        adamw.zero_grad()
    return [p.detach().clone() for p in model.parameters()], adamw


def _backward(model: torch.nn.Module, step: int, run: o.Run) -> None:
    o.loss_of(model, step, 0, run).backward()


def _train(model: torch.nn.Module, opt: aoffload.OffloadAdam, steps: range, run: o.Run) -> None:
    for step in steps:
        o.loss_of(model, step, 0, run).backward()
        opt.step()
        opt.zero_grad()


def test_state_dict_after_the_block_and_blocks_that_alternate_with_eval() -> None:
    run = o.Run()
    expected, adamw = _adamw_run(6, run)
    model = o.mlp()
    opt = o.offload_adam(model, run)
    assert opt.state_dict()["state"] == {}  # before the first start: no state yet
    for block in range(3):
        with opt:
            _train(model, opt, range(2 * block, 2 * block + 2), run)
        with torch.no_grad():  # an eval block between the train blocks
            model(torch.randn(4, 16))
        saved = opt.state_dict()  # after the block: the state the worker had
        assert saved["state"][0]["step"].item() == 2 * block + 2
        assert opt.pid is None
    o.assert_identical([p.detach() for p in model.parameters()], expected)
    reference = adamw.state_dict()["state"]
    for index, entry in saved["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(entry[name], reference[index][name]), (index, name)


def test_bf16_masters_are_carried_from_one_block_to_the_next() -> None:
    run = o.Run(dtype=torch.bfloat16)
    unbroken_model = o.mlp(run.dtype)
    unbroken = o.offload_adam(unbroken_model, run)
    with unbroken:
        _train(unbroken_model, unbroken, range(6), run)
    model = o.mlp(run.dtype)
    opt = o.offload_adam(model, run)
    for steps in (range(3), range(3, 6)):
        with opt:
            _train(model, opt, steps, run)
    o.assert_identical(list(model.parameters()), list(unbroken_model.parameters()))


@pytest.fixture
def four_steps() -> list[torch.Tensor]:
    """AdamW's parameters after four steps, computed outside the test's event loop."""
    return _adamw_run(4, o.Run())[0]


async def test_the_asyncio_face_restarts_with_astart_and_aclose(
    four_steps: list[torch.Tensor],
) -> None:
    run, expected = o.Run(), four_steps
    model = o.mlp()
    opt = o.offload_adam(model, run)
    assert not hasattr(opt, "open")
    for steps in (range(2), range(2, 4)):
        await opt.astart()
        for step in steps:  # the backward on a thread: the loop guard watches the library
            await asyncio.to_thread(_backward, model, step, run)
            await opt.astep()
            opt.zero_grad()
        await opt.aclose()
        await opt.aclose()  # idempotent
    async with opt:  # and once more, for a state read by the worker
        saved = await opt.astate_dict()
    assert saved["state"][0]["step"].item() == 4
    o.assert_identical([p.detach() for p in model.parameters()], expected)


def _backward_then_fail(
    model: torch.nn.Module, opt: aoffload.OffloadAdam, step: int, run: o.Run
) -> None:
    with opt:
        o.loss_of(model, step, 0, run).backward()
        assert opt._off.in_step()  # every bucket was sent, and stepped
        raise RuntimeError("a failed validation")


def test_a_block_left_between_backward_and_step_undoes_the_step() -> None:
    """An exception between the backward (which sent every bucket) and the step: the close
    undoes the buckets' steps, and the next block goes on as if that step never was."""
    run = o.Run(clip=1.0)
    model, twin = o.mlp(), o.mlp()
    adamw = torch.optim.AdamW(o.groups(twin), lr=o.LR, fused=True)
    opt = o.offload_adam(model, run)
    for step in range(4):
        o.loss_of(twin, step, 0, run).backward()
        if step != 1:
            ordered = [p for group in adamw.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(ordered, 1.0)
            adamw.step()
        adamw.zero_grad()
        if step == 1:
            with pytest.raises(RuntimeError, match="a failed validation"):
                _backward_then_fail(model, opt, step, run)
        else:
            with opt:
                o.loss_of(model, step, 0, run).backward()
                opt.step()
        opt.zero_grad()
    assert opt.state_dict()["state"][0]["step"].item() == 3
    o.assert_identical([p.detach() for p in model.parameters()], list(twin.parameters()))


def test_a_state_lost_with_its_worker_is_refused_until_one_is_loaded() -> None:
    run = o.Run()
    model = o.mlp()
    opt = o.offload_adam(model, run)
    with opt:
        _train(model, opt, range(2), run)
    saved = opt.state_dict()
    with opt:
        _train(model, opt, range(2, 3), run)
        aoffload.run(kill_worker(opt))
    with pytest.raises(aoffload.ClosedError, match="lost its state") as lost:
        opt.state_dict()
    assert isinstance(lost.value.__cause__, aoffload.WorkerDiedError)
    with pytest.raises(aoffload.ClosedError, match="load_state_dict"), opt:
        pass
    opt.load_state_dict(saved)
    with opt:
        assert opt.state_dict()["state"][0]["step"].item() == 2


def test_a_group_added_between_blocks_starts_afresh() -> None:
    run = o.Run()
    model, twin = o.mlp(), o.mlp()
    params, twins = list(model.parameters()), list(twin.parameters())
    opt = aoffload.OffloadAdam(params[:4], lr=o.LR, backend="torch", bucket_mb=0.01)
    adamw = torch.optim.AdamW(twins[:4], lr=o.LR, fused=True)
    for steps, added in ((range(2), False), (range(2, 4), True)):
        if added:
            opt.add_param_group({"params": params[4:], "weight_decay": 0.0})
            adamw.add_param_group({"params": twins[4:], "weight_decay": 0.0})
        with opt:
            for step in steps:
                for m in (model, twin):
                    o.loss_of(m, step, 0, run).backward()
                opt.step()
                adamw.step()
                opt.zero_grad()
                adamw.zero_grad()
    o.assert_identical([p.detach() for p in params], twins)
