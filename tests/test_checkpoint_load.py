"""Files whose non-tensor values are large load in a worker: exactly, and leaving nothing.

torch's weights-only unpickler holds the GIL for the whole decoding of a large value, which
would stall the trainer's loop from any thread, so such a file loads in a worker process
(the engine's writer, or one started by ``load_checkpoint``). These tests check that path
gives what ``torch.load`` gives, leaks no ``/dev/shm`` file or process, and reports what
``weights_only`` refuses; the loop lag it saves is measured by ``python -m aoffload.bench
looplag``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import aoffload
from aoffload.checkpoint.core import load as _load

from ._leaks import Snapshot
from .test_checkpoint import _warm_up, assert_same  # noqa: F401 - the module's warm-up

BIG = 12 * 10**6  # bytes: its pickle is past the size from which a worker loads the file


def big_state() -> dict[str, object]:
    weights = torch.randn(256, 64)
    return {
        "blob": os.urandom(BIG),
        "weights": weights,
        "rows": weights[3:7],
        "trained": torch.randn(5).requires_grad_(),
        "nested": {"small": b"abc", "step": 3, "ids": torch.arange(5), "none": None},
        "empty": torch.empty(0, 2),
    }


@pytest.fixture
def big_and_plain(tmp_path: Path) -> tuple[dict[str, object], dict[str, object]]:
    """A state with a large ``bytes`` value, and what plain torch.save + torch.load make of
    it: the oracle. Built outside the event loop (a synchronous fixture): torch.load holds
    the GIL while it unpickles the value, on whatever thread, which would stall the loop."""
    state = big_state()
    plain = tmp_path / "plain.pt"
    torch.save(state, plain)
    return state, torch.load(plain, weights_only=True)


async def test_large_non_tensor_values_load_exactly_and_leave_nothing(
    tmp_path: Path, big_and_plain: tuple[dict[str, object], dict[str, object]]
) -> None:
    state, expected = big_and_plain
    await asyncio.to_thread(len, "")  # starts the loop's default executor before the census
    before = Snapshot.take()
    async with aoffload.CheckpointEngine(tmp_path / "ckpt") as engine:
        await engine.save(state, "m.pt", tag="t")
        await engine.commit("t")
        path = tmp_path / "ckpt" / "t" / "m.pt"
        assert _load._pickle_bytes(path) >= _load.REMOTE_PICKLE
        loaded = await engine.load("m.pt")
    assert_same(loaded, expected)
    assert_same(loaded, state)
    assert loaded["trained"].requires_grad
    assert not loaded["weights"].requires_grad
    assert_same(await aoffload.load_checkpoint(tmp_path / "ckpt", "m.pt"), expected)
    assert not Snapshot.take().leaked_since(before)  # no /dev/shm file, no loader process


@pytest.mark.parametrize(
    "engine",
    [
        pytest.param(True, id="engine"),
        # weights_only=False, the caller's opt-in, unpickles the 12 MB value in this process:
        # its loader thread holds the GIL for it (50-70 ms here), which the loop guard's
        # ticker sees; the value comes back whole, as the test checks.
        pytest.param(False, id="load_checkpoint", marks=pytest.mark.blocks_loop),
    ],
)
async def test_a_value_weights_only_refuses_is_a_checkpoint_error(
    tmp_path: Path, engine: bool
) -> None:
    state = {"blob": await asyncio.to_thread(os.urandom, BIG), "odd": collections.deque([1])}
    async with aoffload.CheckpointEngine(tmp_path) as writer:
        with pytest.warns(UserWarning, match=r"state\['odd'\] is pickled as collections.deque"):
            await writer.save(state, "m.pt", tag="t")  # flagged at the fence
        await writer.commit("t")
        if engine:
            with pytest.raises(
                aoffload.CheckpointError, match=r"(?s)weights_only=True.*collections\.deque"
            ):
                await writer.load("m.pt")
            await writer.save({"w": torch.ones(2)}, "m.pt", tag="u")  # the engine serves on
            await writer.commit("u")
    if not engine:
        with pytest.raises(
            aoffload.CheckpointError, match=r"(?s)weights_only=True.*collections\.deque"
        ):
            await aoffload.load_checkpoint(tmp_path, "m.pt")
        # The caller's opt-in, for a file it trusts: loaded in the trainer, large value too.
        loaded = await aoffload.load_checkpoint(tmp_path, "m.pt", weights_only=False)
        assert loaded["odd"] == collections.deque([1])
        assert loaded["blob"] == state["blob"]


def _mapped(path: Path) -> bool:
    with open("/proc/self/maps") as maps:
        return any(line.rstrip().endswith(str(path)) for line in maps)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps")
async def test_a_dropped_state_unmaps_its_file_at_once(tmp_path: Path) -> None:
    """No reference cycle keeps the file mapped until a garbage collection (which then
    unmaps it, maybe freeing a deleted file's blocks, on whatever thread collects)."""
    state = await asyncio.to_thread(big_state)
    async with aoffload.CheckpointEngine(tmp_path) as engine:
        await engine.save(state, "m.pt", tag="t")
        await engine.commit("t")
        loaded = await engine.load("m.pt")
    path = (tmp_path / "t" / "m.pt").resolve()
    assert _mapped(path)
    gc.disable()
    try:
        del loaded
        assert not _mapped(path)
    finally:
        gc.enable()


@pytest.fixture
def eager_thread_switches() -> Iterator[None]:
    """The GIL changes hands every microsecond: a thread that completes a future then loses
    it at once, and the loop runs ahead of it, as it does when the host is busy."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


@pytest.mark.parametrize("engine", [True, False], ids=["engine", "load_checkpoint"])
async def test_a_loaded_state_is_freed_where_its_caller_drops_it(
    tmp_path: Path, eager_thread_switches: None, engine: bool
) -> None:
    """Never on the load thread: the loop had run ahead, dropped its reference, and the
    thread's, dropped after, freed the state there, holding the GIL (a 64 MB ``bytes``
    value's unmap stalled the loop 3-5 ms). Without the hand-off, 20-40 of 200 engine
    loads were."""
    freed_on: collections.Counter[str] = collections.Counter()

    def note() -> None:
        freed_on[threading.current_thread().name] += 1

    async with aoffload.CheckpointEngine(tmp_path, durable=False) as checkpoints:
        await checkpoints.save({"w": torch.zeros(1000)}, "m.pt", tag="t")
        await checkpoints.commit("t")
        for _ in range(200 if engine else 60):
            if engine:
                loaded = await checkpoints.load("m.pt", verify=False)
            else:
                loaded = await aoffload.load_checkpoint(tmp_path, "m.pt", verify=False)
            weakref.finalize(loaded["w"], note)
            del loaded
    await asyncio.sleep(0.05)  # a thread that still held one would free it by now
    assert freed_on == {threading.current_thread().name: 200 if engine else 60}


@pytest.mark.blocks_loop
async def test_a_load_lands_while_the_loop_is_blocked_and_its_caller_frees_it(
    tmp_path: Path,
) -> None:
    """A synchronous step holds the loop: the load verifies and loads 256 MiB on its own
    thread meanwhile (32 blocks to read and hash), so the state is there within a few loop
    turns after the step, and it is still freed where the caller drops it."""
    freed_on: list[str] = []
    async with aoffload.CheckpointEngine(tmp_path, durable=False) as checkpoints:
        await checkpoints.save({"w": torch.ones(64 << 20)}, "m.pt", tag="t")
        await checkpoints.commit("t")
        loading = asyncio.ensure_future(checkpoints.load("m.pt"))
        await asyncio.sleep(0)  # the load is handed to its thread
        time.sleep(1.0)  # noqa: ASYNC251 - the trainer's step, on the loop's thread
        for _ in range(10):  # loop turns, no waiting
            if loading.done():
                break
            await asyncio.sleep(0)
        assert loading.done()
        loaded = loading.result()
        del loading
        assert loaded["w"].shape == (64 << 20,)
        assert bool((loaded["w"][-4:] == 1).all())
        weakref.finalize(loaded["w"], lambda: freed_on.append(threading.current_thread().name))
        del loaded
        assert freed_on == [threading.current_thread().name]


async def test_a_load_cancelled_while_the_writer_answers_leaves_no_shared_memory(
    tmp_path: Path,
) -> None:
    state = await asyncio.to_thread(big_state)
    async with aoffload.CheckpointEngine(tmp_path) as engine:
        await engine.save(state, "m.pt", tag="t")
        await engine.commit("t")
        assert engine.pid is not None
        prefix = f"aoffload-load-{engine.pid}-"

        def blobs() -> list[str]:
            return [name for name in os.listdir("/dev/shm") if name.startswith(prefix)]

        load = asyncio.ensure_future(engine.load("m.pt"))
        # Another process makes the file: nothing to await but its appearance.
        while not blobs() and not load.done():  # noqa: ASYNC110
            await asyncio.sleep(0.001)
        assert blobs(), "the load ended before the writer made its /dev/shm file"
        load.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await load
        assert load.cancelled()
        assert_same(await engine.load("m.pt"), state)  # its reply comes after the first one's
        assert blobs() == []
