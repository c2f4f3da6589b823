"""OffloadAdam's threads and faults: a backward on a thread while the loop thread is blocked, a
killed worker (WorkerDiedError from astep(), never a hang), a cancelled astep(); and
checkpoints of what the worker steps, which are exact or fail loudly, never torn."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch

import aoffload
from aoffload._runtime.gate import GATE
from aoffload.testing import kill_worker

from . import _offload as o


@pytest.mark.blocks_loop  # on purpose: the loop's thread waits in join() while buckets flow
async def test_a_backward_on_a_thread_while_the_loop_thread_is_blocked() -> None:
    model, twin = o.mlp(), o.mlp()
    run = o.Run()
    where: set[str] = set()
    for p in model.parameters():  # the user's own hook, to see where autograd runs them
        p.register_post_accumulate_grad_hook(lambda p: where.add(threading.current_thread().name))
    async with o.offload_adam(model, run) as opt:
        core = opt._off.core
        assert core is not None
        buckets = len(opt._off.buckets)
        assert buckets > 1
        trainer = threading.Thread(
            target=o.backward, args=(model, 0, run, opt.no_sync), name="backward-thread"
        )
        trainer.start()
        trainer.join(timeout=120)  # the loop thread blocks here: the loop never turns
        assert not trainer.is_alive()
        # Still on the blocked loop thread: every bucket was submitted from the backward's
        # thread and its result recorded by the reader thread, with no turn of the loop.
        assert core.outcomes.wait(core.outcomes.idle, timeout=60)
        assert len(core.outcomes.completed) == buckets
        report = await opt.astep()
    assert where == {"backward-thread"}
    assert report == aoffload.StepReport(None, False, False)
    adamw = torch.optim.AdamW(o.groups(twin), lr=o.LR, fused=True)
    o.loss_of(twin, 0, 0, run).backward()
    adamw.step()
    o.assert_identical([p.detach() for p in model.parameters()], list(twin.parameters()))


@pytest.mark.parametrize("when", ["after the backward", "before the backward"])
async def test_a_killed_worker_fails_astep_with_worker_died(when: str) -> None:
    model = o.mlp()
    run = o.Run(clip=1.0)
    async with o.offload_adam(model, run) as opt:
        o.backward(model, 0, run, opt.no_sync)
        await opt.astep()
        if when == "before the backward":
            await kill_worker(opt)
            o.backward(model, 1, run, opt.no_sync)  # the hooks meet the death; never raise
        else:
            o.backward(model, 1, run, opt.no_sync)  # speculative steps in flight, or done
            await kill_worker(opt)
        with pytest.raises(aoffload.WorkerDiedError):
            await asyncio.wait_for(opt.astep(), timeout=60)  # a hang fails here
        with pytest.raises(aoffload.WorkerDiedError):
            await opt.astep()
    assert opt.pid is None


def test_a_killed_worker_fails_the_sync_step() -> None:
    model = o.mlp()
    run = o.Run()
    with o.offload_adam(model, run) as opt:
        o.backward(model, 0, run, opt.no_sync)
        aoffload.run(kill_worker(opt))
        started = time.monotonic()
        with pytest.raises(aoffload.WorkerDiedError):
            opt.step()
        assert time.monotonic() - started < 60


def _linear_pair() -> tuple[torch.nn.Linear, torch.nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4096, 4096)  # 16M parameters: a step the worker takes a while on
    twin = torch.nn.Linear(4096, 4096)
    twin.load_state_dict(model.state_dict())
    return model, twin, torch.randn(8, 4096)


def _twin_steps(twin: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    adamw = torch.optim.AdamW(twin.parameters(), lr=1e-3, fused=True)
    for _ in range(2):
        twin(x).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.1)
        adamw.step()
        adamw.zero_grad()
    return list(twin.parameters())


async def test_a_cancelled_astep_finishes_the_step_then_raises() -> None:
    model, twin, x = await o.off_loop(_linear_pair)  # 2 x 16M parameters, made off the loop
    opt = aoffload.OffloadAdam(model.parameters(), lr=1e-3, backend="torch", max_grad_norm=0.1)
    async with opt:
        for _ in range(2):
            await o.off_loop(lambda: model(x).square().mean().backward())  # 16M parameters
            task = asyncio.create_task(opt.astep())
            await asyncio.sleep(0)  # the step is submitted and waits for the worker
            assert not task.done()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert opt.last_step is not None
            assert opt.last_step.clipped  # the step went to its end: clipped and redone
            opt.zero_grad()
    expected = await o.off_loop(_twin_steps, twin, x)
    await o.off_loop(o.assert_identical, [p.detach() for p in model.parameters()], expected)


async def test_a_second_cancellation_leaves_the_step_to_a_thread() -> None:
    model, _, x = await o.off_loop(_linear_pair)
    async with aoffload.OffloadAdam(model.parameters(), backend="torch") as opt:
        await o.off_loop(lambda: model(x).square().mean().backward())
        task = asyncio.create_task(opt.astep())
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        unfinished = opt._off.unfinished
        assert unfinished is not None  # the step goes on, on a thread
        await opt.astep()  # waits for it first, then steps (with zero gradients)
        assert unfinished.done()
        assert opt._off.unfinished is None


# -- checkpoints of what the worker steps ---------------------------------------------------


def big_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 64))


def big_step(model: torch.nn.Module, step: int) -> None:
    x = torch.randn(16, 2048, generator=torch.Generator().manual_seed(step))
    model(x).square().mean().backward()


async def test_a_staging_across_a_step_fails_loudly(tmp_path: Path) -> None:
    model = big_model()
    async with (
        aoffload.CheckpointEngine(tmp_path, durable=False) as engine,
        aoffload.OffloadAdam(model.parameters(), backend="torch") as opt,
    ):
        big_step(model, 0)
        await opt.astep()
        opt.zero_grad()
        staged = engine.stage(model.state_dict(), "model.pt", tag="across")
        big_step(model, 1)  # its first send waits for the copy, then the worker steps...
        await opt.astep()  # ...and the step moves the versions: before the fence
        with pytest.raises(aoffload.CheckpointError, match="modified in place"):
            await staged
        assert "across" not in engine.tags()


async def test_a_bucket_is_sent_only_once_a_staging_copy_of_it_has_ended() -> None:
    """The worker writes resident parameters in place: a bucket the backward completes while
    a staging copy of its memory is in progress waits for the copy (here a hold taken by
    hand, as the checkpoint pipeline takes it at stage())."""
    model = big_model()
    async with aoffload.OffloadAdam(model.parameters(), backend="torch", bucket_mb=4) as opt:
        core = opt._off.core
        assert core is not None
        params = list(model.parameters())
        reading = GATE.begin_read({p.untyped_storage().data_ptr() for p in params})
        assert reading.busy is None
        assert len(reading.regions) == len(opt._off.buckets)
        before = [p.detach().clone() for p in params]
        backward = threading.Thread(target=big_step, args=(model, 0), name="backward-thread")
        try:
            backward.start()
            await o.off_loop(backward.join, 1.0)
            assert backward.is_alive()  # its first hook waits for the copy...
            assert core.outcomes.idle()
            assert not core.outcomes.completed
            await o.off_loop(o.assert_identical, [p.detach() for p in params], before)
        finally:
            GATE.end_read(reading)
        await o.off_loop(backward.join, 120)
        assert not backward.is_alive()
        await opt.astep()
        assert all(not torch.equal(p, b) for p, b in zip(params, before, strict=True))


async def test_staging_the_parameters_during_a_step_is_refused(tmp_path: Path) -> None:
    model = big_model()
    async with (
        aoffload.CheckpointEngine(tmp_path, durable=False) as engine,
        aoffload.OffloadAdam(model.parameters(), backend="torch") as opt,
    ):
        big_step(model, 0)  # the worker is stepping the parameters in place
        with pytest.raises(aoffload.CheckpointError, match="stepping now"):
            engine.stage(model.state_dict(), "model.pt", tag="during")
        await opt.astep()
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        await engine.save(model.state_dict(), "model.pt", tag="during")  # between steps: fine
        await engine.commit("during")
        loaded = await engine.load("model.pt", tag="during")
        assert _same(loaded, expected)


@pytest.mark.blocks_loop  # on purpose: a training step between stage() and its fence
async def test_stagings_while_the_worker_steps_are_exact(tmp_path: Path) -> None:
    """Model and optimizer state staged at the end of a step and fenced before the next
    step, the next backward running meanwhile (its sends wait for the copy of the memory the
    worker writes): the files hold exactly the values of stage() time, every time."""
    model = big_model()
    saved: dict[str, tuple[dict[str, torch.Tensor], dict[str, object]]] = {}
    async with (
        aoffload.CheckpointEngine(tmp_path, durable=False, max_pending=2) as engine,
        aoffload.OffloadAdam(model.parameters(), backend="torch", bucket_mb=4) as opt,
    ):
        core = opt._off.core
        assert core is not None
        for step in range(4):
            big_step(model, step)
            await opt.astep()
            opt.zero_grad()
            tag = f"step-{step}"
            weights = model.state_dict()
            state = await opt.astate_dict()
            saved[tag] = ({k: v.clone() for k, v in weights.items()}, _cloned(state))
            staged = [
                engine.stage(weights, "model.pt", tag=tag),
                engine.stage(state, "optim.pt", tag=tag),
            ]
            big_step(model, step + 1)  # the hooks submit the buckets once the copy is done
            submitted = not core.outcomes.idle() or len(core.outcomes.completed) > 0
            for one in staged:
                await one  # the fence, before the step returns
            assert submitted  # the worker stepped this backward's buckets meanwhile
            await engine.commit(tag)
            await opt.astep()
            opt.zero_grad()
        for tag, (weights, state) in saved.items():
            assert _same(await engine.load("model.pt", tag=tag), weights)
            assert _same(await engine.load("optim.pt", tag=tag), state)


def _cloned(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_cloned(v) for v in value]
    return value


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(_same(x, y) for x, y in zip(a, b, strict=True))
        )
    return bool(a == b)
