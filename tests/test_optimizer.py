"""CPUAdam with real spawned workers: the torch backend's numbers, rollbacks, errors, hygiene."""

from __future__ import annotations

import asyncio
import copy
import os
import pickle
import signal
import threading
import time

import pytest
import torch

import aoffload
from aoffload import CPUAdam, StepKind, StepResult
from aoffload.optimizer._affinity import split_cores
from aoffload.optimizer.worker._calls import Step

from . import _adam_schedule as sched
from ._leaks import Snapshot, child_pids


async def run_schedule(opt: CPUAdam) -> dict[int, torch.Tensor]:
    params = sched.initial_params()
    grads = {sg: torch.zeros(n) for sg, n in sched.NUMEL.items()}
    for ops in sched.iterations():
        for op in ops:
            if not op.rollback:  # a rollback needs the gradient of the step it undoes
                grads[op.subgroup_id].copy_(sched.grad_for(op, sched.NUMEL[op.subgroup_id]))
            opt.submit(
                op.group_id, op.subgroup_id, params[op.subgroup_id], grads[op.subgroup_id],
                lr=op.lr, rollback=op.rollback,
            )  # fmt: skip
        results = await opt.drain()
        assert [(r.subgroup_id, r.kind) for r in results] == [
            (op.subgroup_id, StepKind.ROLLBACK if op.rollback else StepKind.STEP) for op in ops
        ]
    return params


def adamw_reference() -> dict[int, torch.Tensor]:
    """torch.optim.AdamW on the same schedule; a rollback restores the pre-step copy."""
    params = {sg: torch.nn.Parameter(t) for sg, t in sched.initial_params().items()}
    groups = [dict(g) for g in sched.GROUPS]
    for gid, group in enumerate(groups):
        group.pop("amsgrad")
        group["params"] = [params[sg] for g, sg, _ in sched.SUBGROUPS if g == gid]
    opt = torch.optim.AdamW(groups, foreach=False)
    before: dict[int, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}
    for ops in sched.iterations():
        for op in ops:
            p = params[op.subgroup_id]
            if op.rollback:
                data, state = before[op.subgroup_id]
                p.data.copy_(data)
                opt.state[p] = state
                continue
            if op.lr is not None:
                opt.param_groups[op.group_id]["lr"] = op.lr
            before[op.subgroup_id] = (p.data.clone(), copy.deepcopy(opt.state[p]))
            for q in params.values():
                q.grad = None
            p.grad = sched.grad_for(op, p.numel())
            opt.step()
    return {sg: p.detach() for sg, p in params.items()}


@pytest.fixture(scope="module")
def adamw_expected() -> dict[int, torch.Tensor]:
    return adamw_reference()


async def test_torch_backend_matches_adamw(adamw_expected: dict[int, torch.Tensor]) -> None:
    async with CPUAdam(sched.GROUPS, backend="torch", worker_cores=None) as opt:
        assert opt.backend == "torch"
        params = await run_schedule(opt)
    for sg, expected in adamw_expected.items():
        torch.testing.assert_close(params[sg], expected, rtol=1e-5, atol=1e-6)


async def steps_then_rollback(opt: CPUAdam, exact_check: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps and a rollback; returns sub-group (0, 0)'s registered param and grad."""
    a, b = torch.randn(300), None
    b = a.clone()
    ga, gb = torch.zeros(300), torch.zeros(300)
    for _i in range(3):
        ga.copy_(torch.randn(300)), gb.copy_(ga)
        opt.submit(0, 0, a, ga)
        opt.submit(0, 1, b, gb)
        await opt.drain()
    before = a.clone()
    ga.copy_(torch.randn(300) * 1e3)
    opt.submit(0, 0, a, ga)
    opt.submit(0, 0, a, ga, rollback=True)
    step, rollback = await opt.drain()
    assert (step.step, rollback.step) == (4, 3)
    if exact_check:
        assert torch.equal(a, before)  # bit-exact, not just close
    else:
        torch.testing.assert_close(a, before, rtol=1e-4, atol=1e-5)  # close, if not exact
    ga.copy_(torch.randn(300)), gb.copy_(ga)
    opt.submit(0, 0, a, ga)
    opt.submit(0, 1, b, gb)
    await opt.drain()
    assert torch.equal(a, b) == exact_check
    return a, ga


async def test_exact_rollback_restores_bytes() -> None:
    async with CPUAdam(
        sched.GROUPS, backend="torch", exact_rollback=True, worker_cores=None
    ) as opt:
        p, g = await steps_then_rollback(opt, exact_check=True)
        opt.submit(0, 0, p, g, rollback=True)
        opt.submit(0, 0, p, g, rollback=True)  # exact rollback keeps one pre-step copy
        with pytest.raises(aoffload.RemoteError, match="no step since its last rollback"):
            await opt.drain()


@pytest.fixture
def aoffload_optimizer_options() -> dict[str, object]:
    """The plugin's optimizer, without the CPU split (as every test here but the affinity one)."""
    return {"backend": "torch", "worker_cores": None}


async def test_algebraic_rollback_is_close_but_not_exact() -> None:
    async with CPUAdam(sched.GROUPS, backend="torch", worker_cores=None) as opt:
        await steps_then_rollback(opt, exact_check=False)


async def test_param_updated_in_place_and_step_payload_holds_no_tensors() -> None:
    payload = pickle.dumps(Step(0, 7, 1e-3, False))
    assert len(payload) < 200
    assert b"torch" not in payload  # ids and scalars only: no tensor crosses the pipe
    param = torch.nn.Parameter(torch.ones(1000))
    view = param.data[10:20]  # another view of the same storage sees the update too
    grad = torch.ones(1000)
    async with CPUAdam([{"lr": 0.1}], backend="torch", worker_cores=None) as opt:
        opt.submit(0, 3, param, grad)
        [result] = [r async for r in opt.results()]
        assert isinstance(result, StepResult)
        assert result.param is param
        assert result.kind is StepKind.STEP
        assert result.step == 1
        assert (result.group_id, result.subgroup_id) == (0, 3)
        assert result.seconds >= 0
        assert param.is_shared()
        assert grad.is_shared()
        torch.testing.assert_close(param.data, torch.full((1000,), 0.9))
        torch.testing.assert_close(view, torch.full((10,), 0.9))


async def test_several_groups_step_independently() -> None:
    groups = [{"lr": 0.1}, {"lr": 0.01}, {"lr": 0.001, "weight_decay": 0.5}]
    async with CPUAdam(groups, backend="torch", worker_cores=None) as opt:
        params = [torch.ones(8) for _ in groups]
        for gid, p in enumerate(params):
            opt.submit(gid, gid, p, torch.ones(8))
        await opt.drain()
    deltas = [1.0 - p[0].item() for p in params]
    assert deltas[0] == pytest.approx(0.1, rel=1e-4)
    assert deltas[1] == pytest.approx(0.01, rel=1e-4)
    assert deltas[2] == pytest.approx(0.001 + 0.001 * 0.5, rel=1e-3)


async def test_rollback_of_unstepped_subgroup_is_remote_error_and_worker_serves_on(
    aoffload_optimizer: CPUAdam,
) -> None:
    opt = aoffload_optimizer
    pid = opt.pid
    p, g = torch.ones(16), torch.ones(16)
    opt.submit(0, 0, p, g, rollback=True)
    opt.submit(0, 1, torch.ones(4), torch.ones(4))
    results = opt.results()
    with pytest.raises(aoffload.RemoteError, match="has no step") as info:
        await results.__anext__()
    assert "NoStepError" in info.value.remote_type
    ok = await results.__anext__()  # the iteration goes on after a failed step
    assert ok.subgroup_id == 1
    opt.submit(0, 0, p, g)
    [result] = await opt.drain()
    assert result.step == 1
    assert opt.pid == pid


async def test_grad_other_than_registered_is_copied_when_idle() -> None:
    async with CPUAdam([{"lr": 0.1}], backend="torch", worker_cores=None) as opt:
        p, g = torch.ones(16), torch.zeros(16)
        opt.submit(0, 0, p, g)
        other = torch.ones(16)
        with pytest.raises(aoffload.OptimizerError, match="in flight"):
            opt.submit(0, 0, p, other)
        await opt.drain()
        opt.submit(0, 0, p, other)  # copied into the registered (shared) grad
        await opt.drain()
        assert torch.equal(g, other)
        assert not other.is_shared()
        assert p[0].item() < 1.0


async def test_a_grad_repointed_after_registration_is_copied_into_the_shared_buffer() -> None:
    async with CPUAdam([{"lr": 0.1}], backend="torch", worker_cores=None) as opt:
        p, g = torch.zeros(8), torch.ones(8)
        opt.submit(0, 0, p, g)
        first = (await opt.drain())[0].param.clone()
        g.set_(torch.full((8,), -1.0))  # the caller's grad object now points elsewhere
        opt.submit(0, 0, p, g)
        await opt.drain()
        # The worker saw the -1 gradient (copied into the registered buffer): p moved back up.
        assert torch.all(p > first)


async def test_bad_input_raises_before_anything_is_sent() -> None:
    async with CPUAdam([{"lr": 0.1}, {"lr": 0.2}], backend="torch", worker_cores=None) as opt:
        p, g = torch.ones(16), torch.ones(16)
        bad = [
            ((0, 0, p.double(), g.double()), "float32"),
            ((0, 0, torch.ones(4, 4).t(), torch.ones(4, 4)), "not contiguous"),
            ((0, 0, torch.ones(16, device="meta"), g), "on meta"),
            ((0, 0, p, torch.ones(15)), "shape"),
            ((2, 0, p, g), "unknown param group id 2"),
            ((-1, 0, p, g), "unknown param group id"),
            ((0, 0, p, [1.0] * 16), "torch.Tensor"),
        ]
        for args, message in bad:
            with pytest.raises(aoffload.OptimizerError, match=message):
                opt.submit(*args)  # type: ignore[arg-type]
        with pytest.raises(aoffload.OptimizerError, match="lr"):
            opt.submit(0, 0, p, g, lr=float("nan"))
        assert not p.is_shared()
        assert not g.is_shared()
        assert opt.outstanding == 0
        assert await opt.drain() == []
        opt.submit(0, 0, p, g)
        with pytest.raises(aoffload.OptimizerError, match="registered on its first submit"):
            opt.submit(0, 0, torch.ones(16), g)
        with pytest.raises(aoffload.OptimizerError, match="registered on its first submit"):
            opt.submit(0, 0, torch.ones(32), torch.ones(32))
        assert opt.outstanding == 1
        await opt.drain()
        with pytest.raises(aoffload.OptimizerError, match="lr"):
            opt.submit(0, 0, p, g, lr=-1.0)  # the registered tensors take a fast path
        p.set_(torch.ones(16))  # the same object, re-pointed at other memory
        with pytest.raises(aoffload.OptimizerError, match="registered on its first submit"):
            opt.submit(0, 0, p, g)
        assert opt.outstanding == 0
    with pytest.raises(aoffload.OptimizerError, match="amsgrad is not supported"):
        CPUAdam([{"lr": 0.1, "amsgrad": True}])
    with pytest.raises(aoffload.OptimizerError, match=r"unknown keys \['momentum'\]"):
        CPUAdam([{"lr": 0.1, "momentum": 0.9}])
    with pytest.raises(aoffload.OptimizerError, match=r"backend must be one of .* got 'jax'"):
        CPUAdam([{"lr": 0.1}], backend="jax")
    with pytest.raises(aoffload.OptimizerError, match=r"worker_cores must be in \(0, 1\]"):
        CPUAdam([{"lr": 0.1}], worker_cores=0.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_cuda_tensor_is_rejected(aoffload_optimizer: CPUAdam) -> None:
    with pytest.raises(aoffload.OptimizerError, match="cuda"):
        aoffload_optimizer.submit(0, 0, torch.ones(4, device="cuda"), torch.ones(4, device="cuda"))


async def test_sigkill_mid_stream_raises_worker_died_promptly() -> None:
    async with CPUAdam([{"lr": 0.1}], backend="torch", worker_cores=None) as opt:
        pid = opt.pid
        assert pid is not None
        # Made off the loop: the guard would time the test's own 16 MB of randn.
        p, g = await asyncio.to_thread(lambda: (torch.randn(1 << 21), torch.randn(1 << 21)))
        await opt.register(0, 0, p, g)  # shares 16 MB off the event loop
        for _ in range(40):
            opt.submit(0, 0, p, g)
        results = opt.results()
        await results.__anext__()
        os.kill(pid, signal.SIGKILL)
        started = time.perf_counter()
        with pytest.raises(aoffload.WorkerDiedError) as info:
            async for _ in results:
                pass
        assert time.perf_counter() - started < 2.0  # sanity bound; the benchmark measures it
        assert info.value.exitcode == -signal.SIGKILL
        with pytest.raises(aoffload.WorkerDiedError):
            await opt.drain()
        with pytest.raises(aoffload.WorkerDiedError):
            opt.submit(0, 0, p, g)
        assert opt.pid is None
    assert pid not in child_pids()


async def test_break_leaves_the_rest_for_later() -> None:
    async with CPUAdam([{"lr": 0.1}], backend="torch", worker_cores=None) as opt:
        p, g = torch.ones(8), torch.ones(8)
        for _ in range(3):
            opt.submit(0, 0, p, g)
        async for result in opt.results():
            assert result.step == 1
            break
        assert [r.step for r in await opt.drain()] == [2, 3]
        assert [r async for r in opt.results()] == []


async def test_cancelled_wait_leaves_the_optimizer_usable() -> None:
    async with CPUAdam([{"lr": 0.1}], backend="torch", worker_cores=None) as opt:
        # Made off the loop: the guard would time the test's own 8 MB of randn.
        p, g = await asyncio.to_thread(lambda: (torch.randn(1 << 20), torch.randn(1 << 20)))
        await opt.register(0, 0, p, g)
        for _ in range(20):
            opt.submit(0, 0, p, g)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.001):
                await opt.drain()
        assert opt.outstanding == 20
        assert [r.step for r in await opt.drain()] == list(range(1, 21))


def test_split_cores_never_leaves_a_side_empty() -> None:
    assert split_cores([0, 1], 0.8) == ([0], [1])
    assert split_cores([0, 1], 0.5) == ([0], [1])
    assert split_cores([0, 1], 1.0) == ([0], [1])
    assert split_cores([3], 0.8) == ([3], [3])
    assert split_cores(list(range(16)), 0.8) == (list(range(3)), list(range(3, 16)))
    assert split_cores(list(range(16)), 0.05) == ([*range(15)], [15])


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs at least two allowed CPUs",
)
async def test_affinity_split_and_restore() -> None:
    original, threads = os.sched_getaffinity(0), torch.get_num_threads()
    trainer, worker = split_cores(sorted(original), 0.5)
    async with CPUAdam([{"lr": 0.1}], backend="torch", worker_cores=0.5) as opt:
        assert opt.pid is not None
        assert os.sched_getaffinity(0) == set(trainer)
        assert os.sched_getaffinity(opt.pid) == set(worker)
        assert torch.get_num_threads() == min(threads, len(trainer))
    assert os.sched_getaffinity(0) == original
    assert torch.get_num_threads() == threads


async def _one_lifecycle() -> None:
    async with CPUAdam(
        [{"lr": 0.1}], backend="torch", exact_rollback=True, worker_cores=0.8
    ) as opt:
        p, g = torch.randn(4096), torch.randn(4096)
        await opt.register(0, 0, p, g)
        opt.submit(0, 0, p, g)
        opt.submit(0, 1, torch.randn(100), torch.randn(100))
        opt.submit(0, 0, p, g, rollback=True)
        await opt.drain()
        opt.submit(0, 0, p, g)  # left unconsumed: aclose() drains and drops it
    await opt.aclose()  # idempotent
    assert opt.pid is None
    with pytest.raises(aoffload.ClosedError):
        opt.submit(0, 0, torch.ones(2), torch.ones(2))


def settled(before: set[threading.Thread]) -> None:
    """Let aoffload's threads that are already on their way out finish (a thread that has
    resolved the future aclose() awaited can still be returning from its function); one
    that does not end within seconds is a leak, and the snapshot after this reports it."""
    for thread in set(threading.enumerate()) - before:
        # A worker server's threads live as long as the process by design (tests/_leaks.py).
        if thread.name.startswith("aoffload") and not thread.name.startswith("aoffload-server-"):
            thread.join(timeout=5.0)


async def test_no_leaks_after_close() -> None:
    await _one_lifecycle()  # warms process-wide singletons (multiprocessing's fd sharer)
    await asyncio.to_thread(settled, set())  # ...and the loop's executor thread used below
    threads = set(threading.enumerate())
    before = Snapshot.take()
    await _one_lifecycle()
    await asyncio.to_thread(settled, threads)
    assert Snapshot.take().leaked_since(before) == []


async def test_torch_backend_without_bias_correction() -> None:
    groups = [{"lr": 0.01, "bias_correction": False}, {"lr": 0.01}]
    async with CPUAdam(groups, backend="torch", worker_cores=None) as opt:
        params = [torch.ones(8), torch.ones(8)]
        for gid, p in enumerate(params):
            opt.submit(gid, gid, p, torch.ones(8))
        await opt.drain()
    # Uncorrected first step: lr * (1 - b1) / sqrt(1 - b2); corrected: lr.
    assert 1.0 - params[0][0].item() == pytest.approx(0.01 * 0.1 / 0.001**0.5, rel=1e-4)
    assert 1.0 - params[1][0].item() == pytest.approx(0.01, rel=1e-4)


async def test_a_failed_start_raises_its_own_error_and_leaves_nothing() -> None:
    before = Snapshot.take()
    opt = CPUAdam([{"lr": 1e-3}], start_timeout=0.01)  # no worker imports torch that fast
    with pytest.raises(aoffload.WorkerStartupError, match="did not become ready"):
        await opt.astart()
    with pytest.raises(aoffload.ClosedError):
        opt.submit(0, 0, torch.zeros(4), torch.zeros(4))
    await opt.aclose()
    assert set(child_pids()) <= before.children
