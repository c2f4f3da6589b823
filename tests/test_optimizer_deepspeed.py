"""The deepspeed backend against DeepSpeed itself: in-process DeepSpeedCPUAdam and DeepSpeed's
own SuperOffloadCPUOptimizer worker, on the same schedule of steps, lr changes and rollbacks;
and the op's two ways into a worker (its stamped build, or DeepSpeed), on copies of the build.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import aoffload
from aoffload import CPUAdam
from aoffload.optimizer.worker._calls import Info
from aoffload.optimizer.worker._deepspeed_stamp import STAMP, stamp_mismatch
from aoffload.optimizer.worker._deepspeed_start import AcceleratorNoticeFilter

from . import _adam_schedule as sched
from ._op_build import built_op, copy_of_build
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


async def test_auto_picks_deepspeed_and_exact_rollback_restores_bytes(built: str) -> None:
    """``built``: a worker has loaded (and stamped) the op, which "auto" then takes."""
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


# -- the op's start: from its stamped build without DeepSpeed, else through DeepSpeed ------------


@pytest.fixture(scope="module")
def built() -> str:
    """The build directory of DeepSpeed's op here, built if it was not."""
    return built_op()


@pytest.fixture
def build_copy(built: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stamp-less copy of the build, which this test's workers use."""
    return copy_of_build(built, tmp_path, monkeypatch)


@dataclass
class Started:
    """What a deepspeed-backed worker said and mapped, what the schedule left, what it logged."""

    info: Info
    mapped: set[str]
    params: dict[int, torch.Tensor]
    logged: str


def mapped_libraries(pid: int) -> set[str]:
    """The shared objects a process has mapped (``/proc/PID/maps`` names them by real path)."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {line.split(maxsplit=5)[5] for line in lines if line.endswith(".so")}


async def start_and_run(caplog: pytest.LogCaptureFixture) -> Started:
    caplog.clear()
    async with CPUAdam(sched.GROUPS, backend="deepspeed", worker_cores=None) as opt:
        pid, info = opt.pid, opt._core.info
        assert pid is not None
        assert info is not None
        mapped = mapped_libraries(pid)
        params = await run_schedule(opt)
    logged = "\n".join(
        r.getMessage()
        for r in caplog.records
        if r.name == "aoffload.optimizer.worker._deepspeed_op"
    )
    return Started(info, mapped, params, logged)


async def test_a_stamped_build_loads_without_deepspeed_and_steps_the_same(
    build_copy: Path,
    in_process_expected: dict[int, torch.Tensor],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="aoffload")
    library = str(build_copy / "cpu_adam.so")
    first = await start_and_run(caplog)  # no stamp: through DeepSpeed, which stamps the build
    assert first.info.deepspeed_imported, first.logged
    assert f"no {STAMP}" in first.logged
    assert first.info.op_library == library
    assert (build_copy / STAMP).is_file()
    second = await start_and_run(caplog)
    assert not second.info.deepspeed_imported, second.logged
    assert second.info.op_library == library
    assert library in second.mapped  # that very file, not the ambient build
    for sg, param in second.params.items():
        assert torch.equal(param, first.params[sg]), sg
        assert torch.equal(param, in_process_expected[sg]), sg


def _edit_stamp(key: str, value: object) -> Callable[[Path], None]:
    def edit(copy: Path) -> None:
        stamp = json.loads((copy / STAMP).read_text())
        stamp[key] = value
        (copy / STAMP).write_text(json.dumps(stamp))

    return edit


def _append(name: str) -> Callable[[Path], None]:
    def append(copy: Path) -> None:
        with open(copy / name, "a") as file:
            file.write("\n# edited\n")

    return append


STALE: dict[str, tuple[Callable[[Path], None], str]] = {
    # torch rewrites build.ninja from DeepSpeed's arguments; ninja's logged commands still match
    "build.ninja edited": (_append("build.ninja"), "build.ninja changed since the stamp"),
    "library touched": (lambda copy: os.utime(copy / "cpu_adam.so"), "cpu_adam.so changed"),
    "another DeepSpeed": (_edit_stamp("deepspeed", "0.0.1"), "DeepSpeed 0.0.1 is not one"),
    "another CPU": (_edit_stamp("cpu", "x86_64\nflags: sse2"), "cpu differs"),
    "stamp unreadable": (lambda copy: (copy / STAMP).write_text("{"), "is unreadable"),
}


@pytest.mark.parametrize("stale", sorted(STALE))
async def test_a_stale_stamp_loads_through_deepspeed_and_stamps_again(
    stale: str,
    build_copy: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="aoffload")
    change, reason = STALE[stale]
    stamped = await start_and_run(caplog)
    assert stamped.info.deepspeed_imported
    change(build_copy)
    fallback = await start_and_run(caplog)
    assert fallback.info.deepspeed_imported, fallback.logged
    assert reason in fallback.logged
    assert fallback.info.op_library == str(build_copy / "cpu_adam.so")
    again = await start_and_run(caplog)  # stamped afresh by the fallback
    assert not again.info.deepspeed_imported, again.logged
    for sg, param in again.params.items():
        assert torch.equal(param, stamped.params[sg]), sg
        assert torch.equal(param, fallback.params[sg]), sg


async def test_another_accelerator_loads_through_deepspeed(
    build_copy: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.DEBUG, logger="aoffload")
    stamped = await start_and_run(caplog)
    assert stamped.info.deepspeed_imported
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # the same builder, but not what was stamped
    chosen = await start_and_run(caplog)
    assert chosen.info.deepspeed_imported, chosen.logged
    assert "environment differs" in chosen.logged
    assert not (await start_and_run(caplog)).info.deepspeed_imported  # stamped with it
    assert stamp_mismatch(str(build_copy)) is None
    monkeypatch.setenv("DS_ACCELERATOR", "npu")  # another builder: never from the stamp
    assert stamp_mismatch(str(build_copy)) == "DS_ACCELERATOR=npu"


def test_no_build_or_no_stamp_is_no_proof(tmp_path: Path) -> None:
    missing = stamp_mismatch(str(tmp_path / "absent" / "cpu_adam"))
    assert f"no {STAMP}" in str(missing)
    (tmp_path / STAMP).write_text(json.dumps({"format": 0}))
    assert "another format" in str(stamp_mismatch(str(tmp_path)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="DeepSpeed says nothing with a GPU")
def test_a_worker_loading_through_deepspeed_starts_without_the_accelerator_notice(
    build_copy: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    async def start_and_step() -> tuple[str | None, Info | None]:
        async with CPUAdam([{"lr": 0.1}], backend="deepspeed", worker_cores=None) as opt:
            opt.submit(0, 0, torch.ones(8), torch.ones(8))
            await opt.drain()
            return opt.backend, opt._core.info

    backend, info = asyncio.run(start_and_step())  # the worker writes to this test's fds 1, 2
    out, err = capfd.readouterr()
    assert backend == "deepspeed"
    assert info is not None
    assert info.deepspeed_imported  # no stamp in the copy: DeepSpeed ran
    assert "Setting accelerator to CPU" not in out + err
