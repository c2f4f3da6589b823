"""aoffload.deepspeed.SuperOffloadCPUOptimizer against DeepSpeed's class of that name."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

pytest.importorskip(
    "deepspeed", reason="DeepSpeed is not installed (pip install aoffload[deepspeed])"
)

from deepspeed.runtime.superoffload import superoffload_utils as reference

import aoffload
from tests._leaks import Snapshot

pytestmark = pytest.mark.deepspeed

GROUPS = [
    {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False},
    {"lr": 3e-3, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1, "amsgrad": False},
]
# (param_group_id, sub_group_id, numel): three sub-groups over two parameter groups
SUBGROUPS = [(0, 0, 1000), (0, 1, 517), (1, 2, 2048)]
# Each round: (lr override or None, sub-groups to roll back after stepping)
ROUNDS: list[tuple[float | None, list[int]]] = [
    (None, []),
    (None, [1]),
    (5e-3, []),
    (None, [0, 2]),
    (2e-2, []),
]
Result = dict[str, Any]


def wait_result(opt: Any, expected: str | None = None, timeout: float = 30.0) -> Result:
    """get_result() is non-blocking by contract, so callers poll it, as DeepSpeed's stage 3 does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = opt.get_result(expected_event_type=expected)
        if result is not None:
            return dict(result)
        time.sleep(0.001)
    raise TimeoutError("no result")


def run_sequence(opt: Any, *, fresh: bool = False) -> dict[int, torch.Tensor]:
    """Drive one optimizer through ROUNDS exactly as DeepSpeed's stage 3 would.

    ``fresh``: pass new tensors (copies) on every call, which DeepSpeed's class accepts.
    """

    def give(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone() if fresh else tensor

    gen = torch.Generator().manual_seed(1234)
    params = {sub: torch.randn(numel, generator=gen) for _, sub, numel in SUBGROUPS}
    grads = {sub: torch.empty(numel) for _, sub, numel in SUBGROUPS}
    updated: dict[int, torch.Tensor] = {}
    for lr, rollbacks in ROUNDS:
        for group, sub, _ in SUBGROUPS:
            grads[sub].copy_(torch.randn(grads[sub].shape, generator=gen))
            opt.async_step(group, sub, give(params[sub]), give(grads[sub]), lr=lr)
        for _ in SUBGROUPS:
            result = wait_result(opt)
            assert result[reference.ResultKeys.EVENT_TYPE] == reference.EventTypes.ADAM_STEP
            sub = result[reference.TaskKeys.SUB_GROUP_ID]
            updated[sub] = result[reference.ResultKeys.UPDATED_PARAM].clone()
            params[sub].copy_(updated[sub])
        for sub in rollbacks:
            group = next(g for g, s, _ in SUBGROUPS if s == sub)
            opt.async_step(group, sub, give(params[sub]), give(grads[sub]), rollback=True)
            result = wait_result(opt, expected=reference.EventTypes.ROLLBACK)
            assert result[reference.TaskKeys.PARAM_GROUP_ID] == group
            updated[sub] = result[reference.ResultKeys.UPDATED_PARAM].clone()
            params[sub].copy_(updated[sub])
    return updated


def make_ours(**kwargs: Any) -> Any:
    """aoffload's drop-in; the pure-torch backend (quicker to start) unless told otherwise."""
    from aoffload.deepspeed import SuperOffloadCPUOptimizer

    kwargs.setdefault("backend", "torch")
    return SuperOffloadCPUOptimizer(GROUPS, max_grad_numel=4096, **kwargs)


def closing(factory: Callable[[], Any], *, fresh: bool = False) -> Any:
    opt = factory()
    try:
        return run_sequence(opt, fresh=fresh)
    finally:
        opt.close()


@pytest.fixture(autouse=True)
def keep_affinity() -> Iterator[None]:
    """DeepSpeed's class re-pins this process's CPUs and never restores them; put them back."""
    original = os.sched_getaffinity(0)
    yield
    os.sched_setaffinity(0, original)


def test_bit_identical_to_deepspeeds_class() -> None:
    theirs = closing(
        lambda: reference.SuperOffloadCPUOptimizer(
            GROUPS, cpuadam_cores_perc=1.0, max_grad_numel=4096, pin_memory=False
        )
    )
    ours = closing(lambda: make_ours(cpuadam_cores_perc=1.0, backend="deepspeed"))
    # Run again under a leak check, now that the process-wide one-time state exists
    # (multiprocessing's resource tracker, libuv's signal pipe).
    before = Snapshot.take()
    # ...and with new tensors on every call, which DeepSpeed's class accepts too.
    again = closing(lambda: make_ours(cpuadam_cores_perc=1.0, backend="deepspeed"), fresh=True)
    assert theirs.keys() == ours.keys()
    for sub, param in theirs.items():
        assert torch.equal(ours[sub], param), sub
        assert torch.equal(again[sub], param), sub
    assert Snapshot.take().leaked_since(before) == []


def test_state_dict_round_trip_and_new_tensors_while_a_step_is_in_flight() -> None:
    opt = make_ours()
    try:
        param, grad = torch.randn(64), torch.randn(64)
        opt.async_step(0, 0, param, grad)
        opt.async_step(0, 0, param.clone(), grad.clone())  # waits for the first, then copies
        first, second = wait_result(opt), wait_result(opt)
        assert (
            first[reference.ResultKeys.UPDATED_PARAM] is second[reference.ResultKeys.UPDATED_PARAM]
        )
        saved = opt.state_dict()
        assert saved["state"][0][0]["step"] == 2
        kept = saved["state"][0][0]["exp_avg"].clone()
        opt.async_step(0, 0, torch.randn(64), torch.randn(64))
        wait_result(opt)
        opt.load_state_dict(saved)
        again = opt.state_dict()
        assert again["state"][0][0]["step"] == 2
        assert torch.equal(again["state"][0][0]["exp_avg"], kept)
        with pytest.raises(aoffload.OptimizerError, match="registered with 64 elements"):
            opt.async_step(0, 0, torch.randn(65), torch.randn(65))
    finally:
        opt.close()


def test_get_result_is_non_blocking_and_raises_promptly_after_sigkill() -> None:
    opt = make_ours()
    try:
        assert opt.get_result() is None
        param, grad = torch.randn(64), torch.randn(64)
        opt.async_step(0, 0, param, grad)
        wait_result(opt)
        os.kill(opt.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(aoffload.WorkerDiedError):
            wait_result(opt, timeout=10.0)
        assert time.monotonic() - start < 2.0
        with pytest.raises(aoffload.WorkerDiedError):
            opt.get_result()  # and keeps raising
        with pytest.raises(aoffload.WorkerDiedError):
            opt.async_step(0, 0, param, grad)
    finally:
        opt.close()
        opt.close()


def test_outstanding_step_fails_when_the_worker_is_killed() -> None:
    opt = make_ours()
    try:
        param, grad = torch.randn(64), torch.randn(64)
        opt.async_step(0, 0, param, grad)
        wait_result(opt)
        for _ in range(50):
            opt.async_step(0, 0, param, grad)
        os.kill(opt.pid, signal.SIGKILL)
        with pytest.raises(aoffload.WorkerDiedError):  # noqa: PT012 - drain what finished first
            for _ in range(51):
                wait_result(opt, timeout=10.0)
    finally:
        opt.close()


def test_bad_input_raises_at_once_and_the_worker_keeps_serving() -> None:
    from aoffload.deepspeed import SuperOffloadCPUOptimizer

    with pytest.raises(ValueError, match="cpuadam_cores_perc"):
        SuperOffloadCPUOptimizer(GROUPS, cpuadam_cores_perc=0.0)
    with pytest.raises(aoffload.OptimizerError, match="lacks required keys"):
        SuperOffloadCPUOptimizer({"lr": 1e-3})
    opt = make_ours()
    try:
        with pytest.raises(aoffload.OptimizerError, match="max_grad_numel"):
            opt.async_step(0, 0, torch.zeros(5000), torch.zeros(5000))
        # Rolling back a sub-group that never stepped fails that request only.
        param, grad = torch.randn(8), torch.randn(8)
        opt.async_step(0, 7, param, grad, rollback=True)
        with pytest.raises(aoffload.RemoteError):
            wait_result(opt)
        opt.async_step(0, 7, param, grad)
        with pytest.raises(aoffload.OptimizerError, match="Event type mismatch"):
            wait_result(opt, expected=reference.EventTypes.ROLLBACK)
    finally:
        opt.close()
    with pytest.raises(aoffload.ClosedError):
        opt.async_step(0, 0, param, grad)


def test_install_superoffload_swaps_the_stage3_cpu_optimizer() -> None:
    # SuperOffloadOptimizer_Stage3 needs CUDA to construct; the swap only touches the attributes
    # set below, so a bare instance of the real class (no __init__) stands in for it here.
    from deepspeed.runtime.superoffload.superoffload_stage3 import SuperOffloadOptimizer_Stage3

    from aoffload.deepspeed import SuperOffloadCPUOptimizer, install_superoffload

    stage3 = SuperOffloadOptimizer_Stage3.__new__(SuperOffloadOptimizer_Stage3)
    stage3.optimizer = torch.optim.Adam(
        [{"params": [torch.nn.Parameter(torch.zeros(3))], **g} for g in GROUPS]
    )
    stage3.max_grad_numel = 4096
    stage3.offload_optimizer_pin_memory = False
    stage3.async_cpuadam_num = 0
    old = reference.SuperOffloadCPUOptimizer(
        GROUPS, cpuadam_cores_perc=1.0, max_grad_numel=4096, pin_memory=False
    )
    stage3.superoffload_cpu_optimizer = old
    new = install_superoffload(stage3, backend="torch")
    try:
        assert stage3.superoffload_cpu_optimizer is new
        assert isinstance(new, SuperOffloadCPUOptimizer)
        assert not old.cpuadam_process.is_alive()
        assert new.max_grad_numel == 4096
    finally:
        new.close()


def test_async_step_from_autograds_thread_and_results_on_another() -> None:
    """Stage 3 calls async_step from gradient hooks, on autograd's thread: the step is sent
    from that thread and its result taken on this one, with no event loop anywhere."""
    import threading

    opt = make_ours()
    try:
        layer = torch.nn.Linear(16, 16)
        params = [p.detach().clone() for p in layer.parameters()]
        grads = [torch.zeros_like(p) for p in params]
        where: set[str] = set()

        def hook(index: int, param: torch.Tensor) -> None:
            where.add(threading.current_thread().name)
            assert param.grad is not None
            grads[index].copy_(param.grad)
            opt.async_step(0, index, params[index], grads[index])

        for i, p in enumerate(layer.parameters()):
            p.register_post_accumulate_grad_hook(lambda p, i=i: hook(i, p))
        loss = layer(torch.randn(4, 16)).sum()
        backward = threading.Thread(target=loss.backward, name="autograd-caller")
        backward.start()
        backward.join(timeout=60)
        assert where == {"autograd-caller"}
        results = [wait_result(opt) for _ in params]
        assert sorted(r[reference.TaskKeys.SUB_GROUP_ID] for r in results) == [0, 1]
        assert all(r[reference.ResultKeys.EVENT_TYPE] == "adam_step" for r in results)
        assert opt.get_result() is None
    finally:
        opt.close()
