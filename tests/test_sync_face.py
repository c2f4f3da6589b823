"""One engine, two faces: a synchronous trainer (``with``, ``.result()``) and an asyncio one
(``async with``, ``await``) get the same values and the same errors from the same handles."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from pathlib import Path

import pytest
import torch

import aoffload
from aoffload._runtime.handle import Handle
from aoffload._runtime.resource import State
from aoffload._runtime.threads import running_future


def _state(value: float = 1.0) -> dict[str, torch.Tensor]:
    return {"w": torch.full((1 << 16,), value), "b": torch.arange(8.0) * value}


def test_a_synchronous_trainer_saves_commits_and_loads_with_no_loop(tmp_path: Path) -> None:
    with aoffload.CheckpointEngine(tmp_path, keep_last=2) as engine:
        assert engine.latest() is None
        for step in range(3):
            state = _state(float(step))
            staged = engine.stage(state, "model.pt", tag=f"step-{step}")
            time.sleep(0.05)  # the training step blocks this thread; the copy overlaps it
            assert staged.result(timeout=30) is None
            assert staged.done()
            state["w"].add_(100)  # after the fence: mutating is allowed
            result = engine.commit(f"step-{step}", metadata={"step": step}).result(timeout=30)
            assert result.tag == f"step-{step}"
            assert result.files == ("model.pt",)
        loaded = engine.load("model.pt").result(timeout=30)
        torch.testing.assert_close(loaded["w"], torch.full((1 << 16,), 2.0))
        assert engine.tags() == ["step-1", "step-2"]
        assert engine.metadata() == {"step": 2}
    assert engine.pid is None
    from_dir = aoffload.load_checkpoint(tmp_path, "model.pt", tag="step-1").result(timeout=30)
    torch.testing.assert_close(from_dir["b"], torch.arange(8.0))
    assert aoffload.load_metadata(tmp_path).result(timeout=30) == {"step": 2}


async def test_an_asyncio_trainer_awaits_the_same_handles(tmp_path: Path) -> None:
    async with aoffload.CheckpointEngine(tmp_path) as engine:
        staged = engine.stage(_state(3.0), "model.pt", tag="a")
        assert isinstance(staged, aoffload.Handle)
        await staged
        commit = engine.commit("a")
        assert isinstance(commit, aoffload.Handle)
        result = await commit
        assert result is commit.result()  # the same value, both ways
        loaded = await engine.load("model.pt")
        torch.testing.assert_close(loaded["w"], torch.full((1 << 16,), 3.0))
    assert (await aoffload.load_metadata(tmp_path)) == {}
    again = await aoffload.load_checkpoint(tmp_path, "model.pt")
    torch.testing.assert_close(again["b"], torch.arange(8.0) * 3)


def test_start_and_close_without_with(tmp_path: Path) -> None:
    engine = aoffload.CheckpointEngine(tmp_path)
    engine.start()
    try:
        assert engine.pid is not None
        engine.save(_state(), "m.pt", tag="t").result()
        engine.commit_soon("t")
    finally:
        engine.close()
    engine.close()  # idempotent
    assert engine.pid is None
    assert aoffload.load_checkpoint(tmp_path, "m.pt").result()["b"].shape == (8,)
    with pytest.raises(aoffload.ClosedError, match="already started"):
        engine.start()


def test_an_error_is_the_same_through_result_and_await(tmp_path: Path) -> None:
    with aoffload.CheckpointEngine(tmp_path) as engine:
        missing = engine.load("nothing.pt")
        with pytest.raises(aoffload.CheckpointError, match="holds no committed") as first:
            missing.result(timeout=30)

        async def awaited() -> None:
            await missing

        with pytest.raises(aoffload.CheckpointError, match="holds no committed") as second:
            asyncio.run(awaited())
        assert first.value is second.value


def test_an_error_leaving_a_with_block_still_closes_the_engine(tmp_path: Path) -> None:
    engine = aoffload.CheckpointEngine(tmp_path)

    def train() -> None:
        with engine:
            engine.save(_state(), "m.pt", tag="t").result()
            raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        train()
    assert engine.pid is None
    assert engine.state is State.CLOSED


def test_result_from_another_thread_and_a_timeout_that_abandons_only_the_wait() -> None:
    future = running_future()
    handle: Handle[int] = Handle(future)
    assert not handle.done()
    with pytest.raises(TimeoutError, match=r"did not finish within 0\.01 s"):
        handle.result(timeout=0.01)
    seen: list[int] = []
    waiter = threading.Thread(target=lambda: seen.append(handle.result(timeout=30)))
    waiter.start()
    future.set_result(7)
    waiter.join(30)
    assert seen == [7]
    assert handle.done()
    assert handle.result() == 7


def test_a_future_whose_error_is_a_timeout_is_not_mistaken_for_a_wait_that_ran_out() -> None:
    future = running_future()
    future.set_exception(TimeoutError("the work itself timed out"))
    handle: Handle[None] = Handle(future)
    with pytest.raises(TimeoutError, match="the work itself"):
        handle.result(timeout=0)


async def test_a_cancelled_await_abandons_the_wait_only() -> None:
    future = running_future()
    handle: Handle[str] = Handle(future)
    task = asyncio.ensure_future(handle)
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not future.cancelled()
    threading.Timer(0.01, future.set_result, ("done",)).start()
    assert await handle == "done"  # awaited again, from a thread's completion


async def test_awaiting_a_finished_handle_does_not_suspend() -> None:
    handle = Handle.of(5)
    with pytest.raises(StopIteration) as done:
        handle.__await__().send(None)
    assert done.value.value == 5


def test_seen_is_told_once_an_error_reaches_a_caller() -> None:
    future: concurrent.futures.Future[int] = running_future()
    seen: list[BaseException] = []
    handle: Handle[int] = Handle(future, seen=seen.append)
    error = ValueError("x")
    future.set_exception(error)
    assert seen == []  # nobody has waited yet
    with pytest.raises(ValueError, match="x"):
        handle.result()
    assert seen == [error]
