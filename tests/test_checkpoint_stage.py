"""stage(): the snapshot copy starts at once and runs off the loop; the fence; background commits.

Real writer process, real files; a mutation during a copy is a real in-place op on another
thread, and a failing commit is a real rename onto a non-empty directory.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import logging
import os
import random
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import aoffload

from .test_checkpoint import assert_same

MIB = 1 << 20


def filled(value: float, mib: int = 1) -> dict[str, torch.Tensor]:
    return {"w": torch.full((mib * MIB // 4,), value)}


@pytest.fixture(scope="module")
def big() -> dict[str, torch.Tensor]:
    """128 MiB, made before any event loop runs (filling it is the test's work, not ours)."""
    return {f"w{i}": filled(float(i), 32)["w"] for i in range(4)}


def never_retrieved(caplog: pytest.LogCaptureFixture) -> list[str]:
    gc.collect()  # asyncio reports an unretrieved exception when its future is collected
    return [r.getMessage() for r in caplog.records if "never retrieved" in r.getMessage()]


async def test_stage_returns_at_once_and_the_fence_ends_the_copy(tmp_path: Path) -> None:
    state = {"model": {"w": torch.ones(64, 1024), "t": torch.randn(64, 32).t()}, "step": 7}
    expected = {"model": {k: v.clone() for k, v in state["model"].items()}, "step": 7}  # type: ignore[union-attr]
    async with aoffload.CheckpointEngine(tmp_path) as engine:
        assert not inspect.iscoroutinefunction(engine.stage)
        staged = engine.stage(state, "model.pt", tag="a")
        assert isinstance(staged, aoffload.Staged)
        assert await staged is None
        assert staged.done()
        for tensor in state["model"].values():  # type: ignore[union-attr]
            tensor.zero_()  # allowed after the fence
        await engine.commit("a")
        assert_same(await engine.load("model.pt"), expected)


async def test_commit_awaits_the_tags_staging(tmp_path: Path) -> None:
    async with aoffload.CheckpointEngine(tmp_path) as engine:
        engine.stage(filled(1.0), "a.pt", tag="t")
        engine.stage(filled(2.0), "b.pt", tag="t")
        result = await engine.commit("t")  # no `await staged`: commit fences first
        assert set(result.files) == {"a.pt", "b.pt"}
        assert_same(await engine.load("a.pt"), filled(1.0))
        assert_same(await engine.load("b.pt"), filled(2.0))


async def test_bad_name_or_tag_raises_from_the_call_itself(tmp_path: Path) -> None:
    async with aoffload.CheckpointEngine(tmp_path) as engine:
        with pytest.raises(aoffload.InvalidStateError, match="file name"):
            engine.stage({"w": torch.ones(1)}, "../x", tag="t")
        with pytest.raises(aoffload.InvalidStateError, match="tag"):
            engine.stage({"w": torch.ones(1)}, "m.pt", tag="a/b")
        staged = engine.stage({"w": torch.ones(1)}, "m.pt", tag="t")
        with pytest.raises(aoffload.InvalidStateError, match="already saved"):
            engine.stage({"w": torch.ones(1)}, "m.pt", tag="t")
        bad = engine.stage({"fn": lambda x: x}, "bad.pt", tag="t")  # found while pickling
        with pytest.raises(aoffload.InvalidStateError, match=r"\['fn'\]"):
            await bad
        await staged
        assert (await engine.commit("t")).files == ("m.pt",)


def mutate_until(tensor: torch.Tensor, stop: threading.Event) -> threading.Thread:
    def run() -> None:
        while not stop.is_set():
            tensor.add_(1)
            time.sleep(0.0005)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


async def test_a_tensor_mutated_during_its_copy_fails_the_staging_naming_its_key(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, big: dict[str, torch.Tensor]
) -> None:
    counter = torch.zeros(1)
    state = {"model": big, "opt": {"step": counter}}
    stop = threading.Event()
    async with aoffload.CheckpointEngine(tmp_path) as engine:
        await engine.save(filled(1.0), "m.pt", tag="good")
        await engine.commit("good")
        thread = mutate_until(counter, stop)
        try:
            with pytest.raises(aoffload.CheckpointError, match=r"state\['opt'\]\['step'\]"):
                await engine.save(state, "model.pt", tag="torn")
            # Nobody awaits this one: commit() raises it, and publishes nothing.
            engine.stage(filled(2.0), "other.pt", tag="torn2")
            engine.stage(state, "model.pt", tag="torn2")
            with pytest.raises(aoffload.CheckpointError, match="could not be staged"):
                await engine.commit("torn2")
        finally:
            stop.set()
            await asyncio.to_thread(thread.join)
        assert engine.latest() == "good"
        # The engine stays usable, and the tags can be staged again.
        await engine.save(state, "model.pt", tag="torn")
        await engine.commit("torn")
    assert sorted(os.listdir(tmp_path)) == [
        ".aoffload.lock",
        ".aoffload.writer",
        "good",
        "latest",
        "torn",
    ]
    assert not never_retrieved(caplog)


async def test_a_failed_commit_leaves_no_directory_behind_a_write_still_queued(
    tmp_path: Path, big: dict[str, torch.Tensor]
) -> None:
    counter = torch.zeros(1)
    stop = threading.Event()
    async with aoffload.CheckpointEngine(tmp_path, max_pending=2) as engine:
        await engine.save(big, "slow.pt", tag="slow")  # keeps the writer busy a while
        await engine.save(filled(2.0), "other.pt", tag="torn")  # queued behind it
        thread = mutate_until(counter, stop)
        try:
            engine.stage({"step": counter, **big}, "model.pt", tag="torn")
            with pytest.raises(aoffload.CheckpointError, match="could not be staged"):
                await engine.commit("torn")
        finally:
            stop.set()
            await asyncio.to_thread(thread.join)
        await engine.commit("slow")  # the writer has now written everything queued
        assert sorted(os.listdir(tmp_path)) == [
            ".aoffload.lock",
            ".aoffload.writer",
            "latest",
            "slow",
        ]
        assert engine.tags() == ["slow"]


async def test_a_staging_that_fails_after_the_commit_started_fails_the_commit(
    tmp_path: Path, big: dict[str, torch.Tensor]
) -> None:
    async with aoffload.CheckpointEngine(tmp_path, max_pending=2) as engine:
        first = engine.stage(big, "big.pt", tag="first")  # the stage thread plans this first
        engine.stage(filled(1.0), "good.pt", tag="t")
        bad = engine.stage({"fn": lambda x: x}, "bad.pt", tag="t")  # fails when planned
        commit = engine.commit("t")  # requested before the bad file is planned
        with pytest.raises(aoffload.CheckpointError, match=r"'bad\.pt'"):
            await commit
        with pytest.raises(aoffload.InvalidStateError, match=r"\['fn'\]"):
            await bad
        await first
        assert engine.latest() is None
        assert not (tmp_path / "t").exists()
        await engine.commit("first")


async def test_readme_pattern_waits_for_room_instead_of_raising(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with aoffload.CheckpointEngine(tmp_path, max_pending=1) as engine:
        commits = []
        for step in range(4):  # the loop never yields but in save()
            await engine.save(filled(float(step)), "m.pt", tag=f"s{step}")
            commits.append(asyncio.ensure_future(engine.commit(f"s{step}")))
        assert [r.tag for r in await asyncio.gather(*commits)] == ["s0", "s1", "s2", "s3"]
        for step in range(4, 8):  # the engine owns the commit
            staged = engine.stage(filled(float(step)), "m.pt", tag=f"s{step}")
            await staged  # the fence, before the next optimizer step
            engine.commit_soon(f"s{step}")
        assert (await engine.commit("s7")).tag == "s7"
        assert engine.tags() == [f"s{i}" for i in range(8)]
        assert_same(await engine.load("m.pt"), filled(7.0))
    assert not never_retrieved(caplog)


async def test_a_failed_background_commit_is_raised_by_the_next_call(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with aoffload.CheckpointEngine(tmp_path, max_pending=1) as engine:
        await engine.save(filled(1.0), "m.pt", tag="bad")
        # A file where the tag's directory goes: publishing cannot rename the tag onto it.
        # (A directory there would be adopted: DeepSpeed puts NVMe files in <tag>/ itself.)
        (tmp_path / "bad").write_text("the tag cannot be renamed onto this")
        engine.commit_soon("bad")
        await engine.save(filled(2.0), "m.pt", tag="next")  # waits for room, does not raise
        with pytest.raises(aoffload.CheckpointError, match="could not publish checkpoint 'bad'"):
            engine.stage(filled(2.0), "x.pt", tag="next")  # the next call raises it
        engine.commit_soon("next")  # raised once; the engine goes on
        assert (await engine.commit("next")).tag == "next"
        assert engine.latest() == "next"
    assert not never_retrieved(caplog)


async def test_a_failed_background_commit_is_raised_by_aclose(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = aoffload.CheckpointEngine(tmp_path)
    await engine.astart()
    await engine.save(filled(1.0), "m.pt", tag="bad")
    (tmp_path / "bad").write_text("")  # a file where the tag's directory goes
    engine.commit_soon("bad")
    with pytest.raises(aoffload.CheckpointError, match="could not publish"):
        await engine.aclose()
    assert engine.latest() is None
    assert not never_retrieved(caplog)


def block_until(condition: Callable[[], bool], seconds: float = 60.0) -> bool:
    """A synchronous training step: the loop thread is busy (never yields) until ``condition``
    holds, or ``seconds`` pass; whether it held."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


@pytest.mark.blocks_loop
async def test_a_step_that_blocks_the_loop_finds_the_copy_done(
    tmp_path: Path, big: dict[str, torch.Tensor]
) -> None:
    async with aoffload.CheckpointEngine(tmp_path) as engine:
        staged = engine.stage(big, "m.pt", tag="t")
        # The loop thread is busy in a synchronous step; the copy runs on aoffload's threads.
        assert block_until(staged.done)
        await staged  # returns without waiting
        for tensor in big.values():
            assert tensor._version == 0  # nothing here modified them (the fence would say so)
        await engine.commit("t")
        assert_same(await engine.load("m.pt"), big)


@pytest.mark.blocks_loop
async def test_commit_soon_publishes_latest_while_the_loop_is_blocked(tmp_path: Path) -> None:
    async with aoffload.CheckpointEngine(tmp_path, keep_last=1) as engine:
        await engine.save(filled(1.0, 4), "m.pt", tag="a")
        engine.commit_soon("a")
        await engine.save(filled(2.0, 4), "m.pt", tag="b")  # waits for room: a's commit ends
        engine.commit_soon("b")

        def published() -> bool:
            latest = tmp_path / "latest"
            return latest.exists() and latest.read_text() == "b\n"

        # Durable, manifest, tag, `latest` and retention, all while the loop never turns.
        assert block_until(published)
        assert block_until(lambda: not (tmp_path / "a").exists())
        assert (tmp_path / "b" / ".aoffload-manifest.json").exists()
        assert engine.latest() == "b"
        assert_same(await engine.load("m.pt"), filled(2.0, 4))


@pytest.mark.blocks_loop
async def test_a_mutation_before_the_loop_turns_is_caught(
    tmp_path: Path, big: dict[str, torch.Tensor]
) -> None:
    counter = torch.zeros(1)
    state = {"model": big, "opt": {"step": counter}}
    async with aoffload.CheckpointEngine(tmp_path) as engine:
        await engine.save(filled(1.0), "m.pt", tag="good")
        await engine.commit("good")
        staged = engine.stage(state, "model.pt", tag="torn")
        counter.add_(1.0)  # no await in between: the loop has not turned since stage()
        with pytest.raises(aoffload.CheckpointError, match=r"state\['opt'\]\['step'\]"):
            await staged
        # Caught when its copy ended (nothing was written) or at the fence (the tag is
        # discarded): either way nothing of the tag is published.
        with pytest.raises(aoffload.CheckpointError, match=r"nothing was saved|discarded"):
            await engine.commit("torn")
        assert engine.latest() == "good"
        assert engine.tags() == ["good"]
        await engine.save(state, "model.pt", tag="next")  # the engine goes on
        await engine.commit("next")
    assert sorted(os.listdir(tmp_path)) == [
        ".aoffload.lock",
        ".aoffload.writer",
        "good",
        "latest",
        "next",
    ]


@pytest.mark.blocks_loop
@pytest.mark.parametrize("seed", range(6))
async def test_a_mutation_at_any_point_is_caught_or_not_written(tmp_path: Path, seed: int) -> None:
    """Before the loop turns, during the copy (the loop blocked in a step), after the
    fence: the file holds the values as of stage(), or the staging fails naming the key,
    never the modified values silently."""
    rng = random.Random(seed)
    weights = torch.zeros(4 << 20)  # 16 MiB: its copy takes a few ms
    async with aoffload.CheckpointEngine(tmp_path) as engine:
        for step in range(4):
            tag, when = f"s{step}", rng.choice(["at once", "during", "after the fence"])
            staged = engine.stage({"w": weights}, "m.pt", tag=tag)
            if when == "at once":
                weights.add_(1.0)
            elif when == "during":
                time.sleep(rng.uniform(0.0, 0.01))  # noqa: ASYNC251 - a synchronous step
                weights.add_(1.0)
            as_staged = float(weights[0]) - (when != "after the fence")
            failure: aoffload.CheckpointError | None = None
            try:
                await staged
            except aoffload.CheckpointError as exc:
                failure = exc
            if failure is not None:
                assert when != "after the fence"
                assert "state['w']" in str(failure)
                with pytest.raises(aoffload.CheckpointError, match=r"nothing was saved|discarded"):
                    await engine.commit(tag)
                continue
            assert when == "after the fence" or float(weights[0]) == as_staged
            if when == "after the fence":
                weights.add_(1.0)
            await engine.commit(tag)
            loaded = (await engine.load("m.pt"))["w"]
            assert torch.equal(loaded, torch.full_like(weights, as_staged))


def test_caplog_sees_asyncio_errors(caplog: pytest.LogCaptureFixture) -> None:
    """The "never retrieved" checks above can fail: asyncio's report reaches caplog."""

    async def main() -> None:
        async def fail() -> None:
            raise RuntimeError("boom")

        task = asyncio.get_running_loop().create_task(fail())
        await asyncio.sleep(0.01)
        del task

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(main())
        assert never_retrieved(caplog)


async def test_a_saved_state_is_not_kept_alive_by_its_checkpoint(tmp_path: Path) -> None:
    async with aoffload.CheckpointEngine(tmp_path) as engine:
        saved = {"w": torch.ones(1000)}
        await engine.save(saved, "m.pt", tag="a")
        staged = weakref.ref(saved["w"])
        del saved
        await engine.commit("a")  # by then the copy's threads are long done with it
        assert staged() is None, "the staged file's plan keeps the saved tensors alive"
