"""The library changes nothing process-wide that the user did not ask for."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from pathlib import Path

import pytest
import torch

import aoffload
from aoffload._runtime.threads import BACKGROUND_SLICE_NS, background_policy


def _threads_in_a_new_thread() -> int:
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return seen[0]


async def test_checkpoints_and_the_default_optimizer_leave_threads_and_affinity_alone(
    tmp_path: Path,
) -> None:
    threads, fresh = torch.get_num_threads(), _threads_in_a_new_thread()
    affinity = os.sched_getaffinity(0)
    state = {"w": torch.randn(1 << 18)}
    async with aoffload.CheckpointEngine(tmp_path, durable=False) as engine:
        await engine.save(state, "model.pt", tag="t")
        await engine.commit("t")
        await engine.load("model.pt")
        param, grad = torch.zeros(1 << 16), torch.ones(1 << 16)
        async with aoffload.CPUAdam([{"lr": 0.1}], backend="torch") as opt:
            opt.submit(0, 0, param, grad)
            await opt.drain()
            assert os.sched_getaffinity(0) == affinity
            assert torch.get_num_threads() == threads
        # A thread the library created copied and loaded the state; new threads see no change.
        assert await asyncio.to_thread(_threads_in_a_new_thread) == fresh
    assert torch.get_num_threads() == threads
    assert os.sched_getaffinity(0) == affinity


def _policy(thread_id: int) -> int:
    return os.sched_getscheduler(thread_id)


def _slice(thread_id: int) -> int | None:
    """The thread's EEVDF time slice in ns, where the kernel shows it (Linux 6.6+)."""
    try:
        text = Path(f"/proc/{thread_id}/sched").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("se.slice"):
            return int(line.split(":")[1])
    return None


def _custom_slices() -> bool:
    """Whether this kernel takes a fair thread's slice from sched_setattr (Linux 6.12+)."""
    release = tuple(int(p) for p in os.uname().release.split(".")[:2] if p.isdigit())
    return release >= (6, 12) and _slice(threading.get_native_id()) is not None


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread scheduling policies are Linux's")
async def test_background_work_is_batch_work_and_the_trainer_keeps_its_policy(
    tmp_path: Path,
) -> None:
    """The copy threads and the writer run as SCHED_BATCH: they never preempt the trainer,
    and (unlike SCHED_IDLE) keep their share of a loaded host, so a trainer waiting for
    them is never starved. The threads the trainer waits on directly keep its policy."""
    mine = _policy(threading.get_native_id())
    assert mine not in (os.SCHED_IDLE, os.SCHED_BATCH)
    async with aoffload.CheckpointEngine(tmp_path, durable=False) as engine:
        await engine.save({"w": torch.randn(1 << 16)}, "model.pt", tag="t")
        await engine.commit("t")
        copiers = [t for t in threading.enumerate() if t.name.startswith("aoffload-copy-")]
        assert copiers
        for thread in copiers:
            assert thread.native_id is not None
            assert _policy(thread.native_id) == os.SCHED_BATCH
            if _custom_slices():  # the long slice that lets the loop preempt them at wakeup
                assert _slice(thread.native_id) == BACKGROUND_SLICE_NS
                assert _slice(threading.get_native_id()) != BACKGROUND_SLICE_NS
        for name in ("aoffload-stage", "aoffload-commit"):
            (thread,) = [t for t in threading.enumerate() if t.name == name]
            assert thread.native_id is not None
            assert _policy(thread.native_id) == mine
        assert engine.pid is not None
        # The writer's serving thread (its main thread) and its I/O thread.
        writer = [_policy(int(t)) for t in os.listdir(f"/proc/{engine.pid}/task")]
        assert _policy(engine.pid) == os.SCHED_BATCH
        assert writer.count(os.SCHED_BATCH) >= 2
        if _custom_slices():
            assert _slice(engine.pid) == BACKGROUND_SLICE_NS
        assert _policy(threading.get_native_id()) == mine
        assert await asyncio.to_thread(lambda: _policy(threading.get_native_id())) == mine


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread scheduling policies are Linux's")
def test_background_policy_keeps_the_threads_nice_value() -> None:
    """sched_setattr sets the nice value too: a trainer run under ``nice`` keeps it in the
    background threads (lowering it back to 0 would need a privilege, and fail)."""
    seen: list[tuple[int, int]] = []

    def run() -> None:
        os.setpriority(os.PRIO_PROCESS, 0, 5)  # Linux: this thread only
        background_policy()
        seen.append((os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0)))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [(os.SCHED_BATCH, 5)]
