"""CPUAdam's thread-safe core: steps submitted from other threads, results recorded while the
event loop thread is blocked, and the synchronous core driven with no loop at all."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator

import pytest
import torch

import aoffload
from aoffload import CPUAdam, StepResult
from aoffload.optimizer._core import OptimizerCore
from aoffload.optimizer._subgroups import check_options

from ._leaks import Snapshot
from ._loop_ticker import PERIOD
from .test_optimizer import settled

STEPS = 24


@contextlib.asynccontextmanager
async def loop_blocked_on_purpose() -> AsyncIterator[None]:
    """The test blocks the loop thread deliberately: keep the conftest's guard (asyncio's
    debug-mode slow-callback warning, and the ticker that sees a late wake-up) quiet for that
    one task step, and only for it."""
    loop = asyncio.get_running_loop()
    threshold = loop.slow_callback_duration
    loop.slow_callback_duration = 3600.0
    try:
        yield
        # the blocking step ends here, and the ticker's overdue tick runs, under the raised
        # threshold
        await asyncio.sleep(2 * PERIOD)
    finally:
        loop.slow_callback_duration = threshold


def adamw_once(param: torch.Tensor, grad: torch.Tensor, lr: float) -> torch.Tensor:
    """torch.optim.AdamW's first step on a copy of ``param``."""
    p = torch.nn.Parameter(param.clone())
    p.grad = grad.clone()
    torch.optim.AdamW([p], lr=lr, weight_decay=0.0, foreach=False).step()
    return p.detach()


async def test_a_thread_submits_and_waits_while_the_loop_thread_is_blocked() -> None:
    async with CPUAdam([{"lr": 0.1}], backend="torch", worker_cores=None) as opt:
        p, g = torch.ones(1 << 16), torch.ones(1 << 16)
        await opt.register(0, 0, p, g)
        got: list[StepResult] = []
        where: list[str] = []

        def trainer() -> None:
            where.append(threading.current_thread().name)
            for _ in range(STEPS):
                opt.submit(0, 0, p, g)  # from a thread that is not the loop's
            got.extend(opt._core.drain(timeout=60))  # blocks on the core, no loop involved

        thread = threading.Thread(target=trainer, name="trainer-thread")
        async with loop_blocked_on_purpose():
            thread.start()
            # The loop thread blocks until the other thread has every result: if recording
            # a reply needed a turn of the loop, this join would time out.
            thread.join(timeout=60)
            assert not thread.is_alive(), "results were not delivered while the loop was blocked"
        assert where == ["trainer-thread"]
        assert [r.step for r in got] == list(range(1, STEPS + 1))
        assert opt.outstanding == 0
        assert await opt.drain() == []


async def test_results_are_recorded_while_the_loop_thread_sleeps_then_drain_at_once() -> None:
    async with CPUAdam([{"lr": 0.1}], backend="torch", worker_cores=None) as opt:
        p, g = torch.ones(1 << 16), torch.ones(1 << 16)
        await opt.register(0, 0, p, g)
        outcomes = opt._core.outcomes
        async with loop_blocked_on_purpose():
            for _ in range(STEPS):
                opt.submit(0, 0, p, g)
            # A step that blocks the loop thread (time.sleep stands in for forward and
            # backward) while the worker steps; then the loop thread waits on the core's
            # condition: the reader thread records every outcome with no turn of the loop.
            time.sleep(0.3)  # noqa: ASYNC251 - the point of the test
            idle = outcomes.wait(outcomes.idle, timeout=60)
            recorded = len(outcomes.completed)
        assert idle
        assert recorded == STEPS  # recorded before the loop turned even once
        started = time.perf_counter()
        results = await opt.drain()  # nothing left to wait for: no wake-up needed
        assert time.perf_counter() - started < 1.0  # sanity bound only
        assert [r.step for r in results] == list(range(1, STEPS + 1))


async def test_backward_hooks_submit_from_autograds_thread() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    params = [p for p in model.parameters()]
    masters = [p.detach().clone() for p in params]
    before = [m.clone() for m in masters]
    grads = [torch.zeros_like(m) for m in masters]
    threads: set[str] = set()
    loop_thread = threading.current_thread().name
    errors: list[BaseException] = []
    async with CPUAdam([{"lr": 0.01}], backend="torch", worker_cores=None) as opt:
        for i, master in enumerate(masters):
            await opt.register(0, i, master, grads[i])

        def hook(index: int, param: torch.Tensor) -> None:
            threads.add(threading.current_thread().name)
            assert param.grad is not None
            grads[index].copy_(param.grad)
            try:
                opt.submit(0, index, masters[index], grads[index])  # <- straight from the hook
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)

        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(lambda p, i=i: hook(i, p))
        x = torch.randn(32, 8)
        loss = model(x).square().mean()
        await asyncio.to_thread(loss.backward)  # autograd runs the hooks on that thread
        assert not errors, errors
        results = await opt.drain()
    assert threads, "no hook ran"
    assert loop_thread not in threads, threads  # the hooks ran off the loop
    assert sorted(r.subgroup_id for r in results) == list(range(len(params)))
    # torch.optim's first step imports for seconds: off the loop, which the guard times.
    expected = await asyncio.to_thread(
        lambda: [adamw_once(b, grad, lr=0.01) for b, grad in zip(before, grads, strict=True)]
    )
    for master, reference in zip(masters, expected, strict=True):
        torch.testing.assert_close(master, reference, rtol=1e-6, atol=1e-7)


async def test_many_threads_submit_at_once() -> None:
    workers, rounds = 4, 10
    async with CPUAdam([{"lr": 0.1}], backend="torch", worker_cores=None) as opt:
        params = [torch.ones(256) for _ in range(workers)]
        grads = [torch.ones(256) for _ in range(workers)]
        barrier = threading.Barrier(workers)

        def submitter(index: int) -> None:
            barrier.wait()
            for _ in range(rounds):  # the first submit registers the sub-group, racing others
                opt.submit(0, index, params[index], grads[index])

        await asyncio.gather(*(asyncio.to_thread(submitter, i) for i in range(workers)))
        results = await opt.drain()
    steps: dict[int, list[int]] = {}
    for result in results:
        steps.setdefault(result.subgroup_id, []).append(result.step)
    assert steps == {i: list(range(1, rounds + 1)) for i in range(workers)}
    assert all(torch.equal(p, params[0]) for p in params)


def _sync_lifecycle() -> None:
    """Start the core, submit from three threads, drain, snapshot, load, close: no loop."""
    core = OptimizerCore(
        check_options([{"lr": 0.1}], "torch", None),
        backend="torch",
        worker_cores=None,
        exact_rollback=False,
        close_timeout=30.0,
    )
    params = [torch.ones(64) for _ in range(3)]
    grads = [torch.ones(64) for _ in range(3)]
    try:
        core.start(120.0)

        def submitter(i: int) -> None:
            for _ in range(5):
                core.submit((0, i), params[i], grads[i])

        threads = [threading.Thread(target=submitter, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        results = core.drain(timeout=60)
        assert sorted((r.subgroup_id, r.step) for r in results) == [
            (i, step) for i in range(3) for step in range(1, 6)
        ]
        state = core.state_dict().result(timeout=60)
        assert [state["state"][0][i]["step"] for i in range(3)] == [5, 5, 5]
        core.submit((0, 0), params[0], grads[0])
        core.load_state_dict(state).result(timeout=60)
        assert core.state_dict().result(timeout=60)["state"][0][0]["step"] == 5
        assert [r.step for r in core.drain(timeout=60)] == [6]  # sent before the load
    finally:
        core.close()
    with pytest.raises(aoffload.ClosedError):
        core.submit((0, 0), params[0], grads[0])


def test_the_core_runs_with_no_event_loop_at_all() -> None:
    _sync_lifecycle()  # warms process-wide singletons (multiprocessing's fd sharer)
    threads = set(threading.enumerate())
    before = Snapshot.take()
    _sync_lifecycle()
    settled(threads)
    assert Snapshot.take().leaked_since(before) == []
