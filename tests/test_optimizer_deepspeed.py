"""The deepspeed backend against DeepSpeed itself: in-process DeepSpeedCPUAdam and DeepSpeed's
own SuperOffloadCPUOptimizer worker, on the same schedule of steps, lr changes and rollbacks."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterator

import pytest
import torch

import aoffload
from aoffload import CPUAdam
from aoffload.optimizer._deepspeed_start import AcceleratorNoticeFilter

from . import _adam_schedule as sched
from .test_optimizer import run_schedule, steps_then_rollback

deepspeed_adam = pytest.importorskip(
    "deepspeed.ops.adam", reason="deepspeed is not importable: the deepspeed backend is untested"
)
pytestmark = pytest.mark.deepspeed


@pytest.fixture(scope="module")
def in_process_expected() -> dict[int, torch.Tensor]:
    """DeepSpeedCPUAdam in this process, stepping one sub-group at a time."""
    params = {sg: torch.nn.Parameter(t) for sg, t in sched.initial_params().items()}
    groups = []
    for gid, cfg in enumerate(sched.GROUPS):
        group = dict(cfg)
        group["params"] = [params[sg] for g, sg, _ in sched.SUBGROUPS if g == gid]
        groups.append(group)
    first = sched.GROUPS[0]
    opt = deepspeed_adam.DeepSpeedCPUAdam(
        groups, lr=first["lr"], betas=first["betas"], eps=first["eps"],
        weight_decay=first["weight_decay"],
    )  # fmt: skip
    grads = {sg: torch.zeros(n) for sg, n in sched.NUMEL.items()}
    for ops in sched.iterations():
        for op in ops:
            p = params[op.subgroup_id]
            if not op.rollback:
                grads[op.subgroup_id].copy_(sched.grad_for(op, p.numel()))
            if op.lr is not None:
                opt.param_groups[op.group_id]["lr"] = op.lr
            for q in params.values():
                q.grad = None
            p.grad = grads[op.subgroup_id]
            if op.rollback:
                opt.rollback_subgroup(op.subgroup_id)
            else:
                opt.step_subgroup(op.subgroup_id)
    return {sg: p.detach().clone() for sg, p in params.items()}


@pytest.fixture(scope="module")
def superoffload_expected() -> Iterator[dict[int, torch.Tensor]]:
    """DeepSpeed's own SuperOffloadCPUOptimizer worker (it re-pins this process: undone after)."""
    from deepspeed.runtime.superoffload.superoffload_utils import SuperOffloadCPUOptimizer

    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    reference = SuperOffloadCPUOptimizer([dict(g) for g in sched.GROUPS], max_grad_numel=1000)
    try:
        params = sched.initial_params()
        grads = {sg: torch.zeros(n) for sg, n in sched.NUMEL.items()}
        for ops in sched.iterations():
            for op in ops:
                if not op.rollback:
                    grads[op.subgroup_id].copy_(sched.grad_for(op, sched.NUMEL[op.subgroup_id]))
                reference.async_step(
                    op.group_id, op.subgroup_id, params[op.subgroup_id], grads[op.subgroup_id],
                    rollback=op.rollback, lr=op.lr,
                )  # fmt: skip
                deadline = time.monotonic() + 60
                while (result := reference.get_result()) is None:  # its API offers only polling
                    assert time.monotonic() < deadline
                    time.sleep(0.001)
                params[op.subgroup_id] = result["updated_param"].clone()
        yield params
    finally:
        reference.close()
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)


async def test_bit_identical_to_deepspeed(
    in_process_expected: dict[int, torch.Tensor],
    superoffload_expected: dict[int, torch.Tensor],
) -> None:
    async with CPUAdam(sched.GROUPS, backend="deepspeed", worker_cores=None) as opt:
        assert opt.backend == "deepspeed"
        params = await run_schedule(opt)
    for sg in params:
        assert torch.equal(params[sg], in_process_expected[sg]), sg
        assert torch.equal(params[sg], superoffload_expected[sg]), sg


async def test_auto_picks_deepspeed_and_exact_rollback_restores_bytes() -> None:
    async with CPUAdam(sched.GROUPS, exact_rollback=True, worker_cores=None) as opt:
        assert opt.backend == "deepspeed"
        await steps_then_rollback(opt, exact_check=True)
        p, g = torch.ones(8), torch.ones(8)
        opt.submit(1, 9, p, g, rollback=True)
        with pytest.raises(aoffload.RemoteError, match="no step"):
            await opt.drain()
        opt.submit(1, 9, p, g)
        [result] = await opt.drain()
        assert result.step == 1


def test_the_accelerator_notice_is_filtered_and_nothing_else() -> None:
    notice = (
        "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to "
        "detect it."
    )
    drop = AcceleratorNoticeFilter()

    def record(level: int, message: str) -> logging.LogRecord:
        return logging.LogRecord("DeepSpeed", level, __file__, 1, message, None, None)

    assert not drop.filter(record(logging.WARNING, notice))
    assert drop.filter(record(logging.WARNING, "Setting accelerator to something else"))
    assert drop.filter(record(logging.WARNING, "cpu_adam: a real warning"))
    assert drop.filter(record(logging.ERROR, notice))  # only the warning is expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="DeepSpeed says nothing with a GPU")
def test_a_deepspeed_worker_starts_without_the_accelerator_notice(
    capfd: pytest.CaptureFixture[str],
) -> None:
    async def start_and_step() -> str | None:
        async with CPUAdam([{"lr": 0.1}], backend="deepspeed", worker_cores=None) as opt:
            opt.submit(0, 0, torch.ones(8), torch.ones(8))
            await opt.drain()
            return opt.backend

    backend = asyncio.run(start_and_step())  # the worker writes to this test's fds 1 and 2
    out, err = capfd.readouterr()
    assert backend == "deepspeed"
    assert "Setting accelerator to CPU" not in out + err
