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
        for name in ("aoffload-stage", "aoffload-commit"):
            (thread,) = [t for t in threading.enumerate() if t.name == name]
            assert thread.native_id is not None
            assert _policy(thread.native_id) == mine
        assert engine.pid is not None
        # The writer's serving thread (its main thread) and its I/O thread.
        writer = [_policy(int(t)) for t in os.listdir(f"/proc/{engine.pid}/task")]
        assert _policy(engine.pid) == os.SCHED_BATCH
        assert writer.count(os.SCHED_BATCH) >= 2
        assert _policy(threading.get_native_id()) == mine
        assert await asyncio.to_thread(lambda: _policy(threading.get_native_id())) == mine
