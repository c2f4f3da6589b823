"""A hard cap on staging memory (#35): a state larger than ``staging_bytes`` streams through
it, exactly, and leaves nothing behind.

On 4d44aee an engine staged each checkpoint whole (``max_pending`` copies of the state in
``/dev/shm``) and had no ``staging_bytes``. The oracles: the values saved, ``torch.load``
without aoffload, ``/dev/shm`` and this process's mappings.
"""

from __future__ import annotations

import asyncio
import glob
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import aoffload
from aoffload.checkpoint.core.staging import default_cap

from ._leaks import Snapshot
from .test_checkpoint import _warm_up  # noqa: F401 - the module's warm-up

MIB = 1 << 20
CAP = 4 * MIB


def state_of(mib: int, seed: int = 0) -> dict[str, Any]:
    """``mib`` MiB of tensors of several sizes, a parameter, a view, a large bytes value."""
    generator = torch.Generator().manual_seed(seed)
    big = torch.rand(mib * MIB // 4 - 4096, generator=generator)
    return {
        "big": big,
        "view": big[1000:3000],
        "weight": torch.nn.Parameter(torch.rand(32, 32, generator=generator)),
        "ids": torch.arange(4096 - 1024 - 1),
        "blob": bytes(range(256)) * 400,
        "step": seed,
    }


def assert_equal(loaded: dict[str, Any], state: dict[str, Any]) -> None:
    assert loaded.keys() == state.keys()
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(loaded[key].detach(), value.detach()), key
        else:
            assert loaded[key] == value, key
    ptr = loaded["big"].untyped_storage().data_ptr()
    assert loaded["view"].untyped_storage().data_ptr() == ptr


def staging_mappings() -> list[str]:
    """This process's mappings of aoffload's staging segments (unlinked or not)."""
    with open("/proc/self/maps") as maps:
        return [line.strip() for line in maps if "/aoffload-" in line and "/dev/shm" in line]


def tmp_file(directory: Path, name: str) -> Path | None:
    found = glob.glob(str(directory / ".tmp-*" / name))
    return Path(found[0]) if found else None


def wait_for_bytes(directory: Path, name: str, nbytes: int, timeout: float = 60.0) -> None:
    """Until the writer has written ``nbytes`` of the file (a test's poll, never the
    library's)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = tmp_file(directory, name)
        if path is not None and path.exists() and path.stat().st_size >= nbytes:
            return
        time.sleep(0.002)
    raise AssertionError(f"{name} did not reach {nbytes} bytes")


def compute_for(seconds: float) -> None:
    """A real step: matrix products on this thread for about ``seconds``."""
    a = torch.rand(256, 256)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        a = torch.tanh(a @ a)


@pytest.mark.parametrize("step", ["sleep", "compute"])
def test_a_state_8x_the_cap_commits_and_loads_equal(tmp_path: Path, step: str) -> None:
    """A synchronous trainer: stage, a step (sleeping, or computing), the fence, commit."""
    state = state_of(8 * CAP // MIB)
    before = Snapshot.take()
    with aoffload.CheckpointEngine(tmp_path, staging_bytes=CAP, keep_last=2) as engine:
        for number in range(3):
            staged = engine.stage(state, "m.pt", tag=f"t{number}")
            time.sleep(0.05) if step == "sleep" else compute_for(0.05)
            staged.result()
            result = engine.commit(f"t{number}").result()
            assert 0 < result.staging_bytes <= CAP
            assert 0 < result.staging_peak_bytes <= CAP
            assert result.bytes > 8 * CAP - MIB
        assert_equal(engine.load("m.pt").result(), state)
    assert_equal(torch.load(tmp_path / "t2" / "m.pt", weights_only=True), state)
    assert not Snapshot.take().leaked_since(before)
    assert not staging_mappings()


async def test_an_asyncio_trainer_streams_through_the_cap(tmp_path: Path) -> None:
    state = state_of(8 * CAP // MIB, seed=1)
    async with aoffload.CheckpointEngine(tmp_path, staging_bytes=CAP) as engine:
        staged = engine.stage(state, "m.pt", tag="t")
        await staged
        result = await engine.commit("t")
        assert result.staging_peak_bytes <= CAP
        assert_equal(await engine.load("m.pt"), state)


@pytest.mark.blocks_loop
def test_a_mutation_during_the_streaming_is_caught_naming_the_key(tmp_path: Path) -> None:
    """The tensor modified had been copied and written already: the fence still catches
    it, the tag is discarded, and ``latest`` stays where it was."""
    state = state_of(64)
    with aoffload.CheckpointEngine(tmp_path, staging_bytes=CAP) as engine:
        engine.save({"w": torch.ones(3)}, "m.pt", tag="good").result()
        engine.commit("good").result()
        staged = engine.stage(state, "m.pt", tag="torn")
        wait_for_bytes(tmp_path, "m.pt", 2 * CAP)  # streaming, its first chunks written
        state["big"][0] += 1.0  # in place, after its first chunk was copied and written
        with pytest.raises(aoffload.CheckpointError, match=r"state\['big'\]"):
            staged.result()
        # caught when the copy ended (nothing saved) or at the fence (the tag discarded)
        with pytest.raises(aoffload.CheckpointError, match=r"nothing was saved|discarded"):
            engine.commit("torn").result()
        assert engine.latest() == "good"
    assert sorted(os.listdir(tmp_path)) == [".aoffload.lock", ".aoffload.writer", "good", "latest"]


def test_a_writer_killed_mid_stream_leaves_latest_and_no_staging_memory(tmp_path: Path) -> None:
    state = state_of(64)
    before = Snapshot.take()
    engine = aoffload.CheckpointEngine(tmp_path, staging_bytes=CAP)
    with engine:
        engine.save({"w": torch.ones(3)}, "m.pt", tag="good").result()
        engine.commit("good").result()
        staged = engine.stage(state, "m.pt", tag="killed")
        wait_for_bytes(tmp_path, "m.pt", 2 * CAP)
        assert engine.pid is not None
        os.kill(engine.pid, signal.SIGKILL)
        with pytest.raises((aoffload.WorkerDiedError, aoffload.CheckpointError)):
            staged.result(timeout=60)  # the fence, or else the commit, says so
        with pytest.raises((aoffload.WorkerDiedError, aoffload.CheckpointError)):
            engine.commit("killed").result(timeout=60)
        assert engine.latest() == "good"
        with pytest.raises(aoffload.WorkerDiedError):
            engine.stage(state, "m.pt", tag="after")
    assert not staging_mappings()  # every segment unmapped
    assert not Snapshot.take().leaked_since(before)  # nothing in /dev/shm, no process
    with aoffload.CheckpointEngine(tmp_path) as reopened:
        assert reopened.latest() == "good"
        assert reopened.tags() == ["good"]


def test_two_tags_in_flight_share_the_cap(tmp_path: Path) -> None:
    """``max_pending=2``: the second tag stages while the first is being written; both
    stream through the one cap, and both commit exactly."""
    first, second = state_of(4 * CAP // MIB, seed=2), state_of(4 * CAP // MIB, seed=3)
    with aoffload.CheckpointEngine(tmp_path, staging_bytes=CAP, max_pending=2) as engine:
        engine.stage(first, "m.pt", tag="a")
        engine.commit_soon("a")
        engine.stage(second, "m.pt", tag="b").result()  # waits for room, as max_pending does
        results = [engine.commit("a").result(), engine.commit("b").result()]
        assert all(r.staging_peak_bytes <= CAP for r in results)
        assert_equal(engine.load("m.pt", tag="a").result(), first)
        assert_equal(engine.load("m.pt", tag="b").result(), second)


async def test_many_small_files_and_an_empty_one_stream_in_order(tmp_path: Path) -> None:
    """More files than chunks in flight, one of a single empty tensor, all under the cap."""
    files = {f"f{i}.pt": {"w": torch.full((1000 + i,), float(i))} for i in range(40)}
    files["empty.pt"] = {"e": torch.empty(0)}
    async with aoffload.CheckpointEngine(tmp_path, staging_bytes=1 * MIB) as engine:
        staged = [engine.stage(state, name, tag="t") for name, state in files.items()]
        for handle in staged:
            await handle
        await engine.commit("t")
        for name, state in files.items():
            loaded = await engine.load(name)
            assert all(torch.equal(loaded[k], v) for k, v in state.items()), name


def test_the_default_cap_shares_ram_and_shm_among_the_local_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    one, eight = default_cap(), default_cap(ranks=True)
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert one <= ram // 4
    assert eight <= one // 8 + 4096
    with pytest.raises(ValueError, match="staging_bytes"):
        aoffload.CheckpointEngine("unused", staging_bytes=1000)


def test_a_close_while_staging_waits_for_room_ends_promptly(tmp_path: Path) -> None:
    """A tag staged and never committed, blocked on a full cap behind a slow writer: the
    engine's close ends it (and logs it discarded) instead of hanging."""
    state = state_of(32)
    engine = aoffload.CheckpointEngine(tmp_path, staging_bytes=1 * MIB, durable=True)
    engine.start()
    engine.stage(state, "m.pt", tag="left")
    closer = threading.Thread(target=engine.close)
    started = time.monotonic()
    closer.start()
    closer.join(timeout=60)
    assert not closer.is_alive()
    assert time.monotonic() - started < 60
    assert not staging_mappings()


if not os.path.exists("/proc/self/maps"):  # pragma: no cover - Linux only
    pytestmark = pytest.mark.skip(reason="reads /proc/self/maps")

_ = asyncio  # the asyncio tests run on both loops (conftest)
