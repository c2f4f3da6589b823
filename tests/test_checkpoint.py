"""CheckpointEngine with its real writer process, real files and real fsync."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

import aoffload

from ._leaks import Snapshot, child_pids

MANIFEST = ".aoffload-manifest.json"


def nested_state(seed: int) -> dict[str, object]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(64, 32, generator=gen),
            "b": torch.randn(32, generator=gen).to(torch.bfloat16),
            "half": torch.randn(7, 3, generator=gen).half(),
            "ids": torch.randint(0, 1000, (5, 5), generator=gen, dtype=torch.int64),
            "mask": torch.rand(9, generator=gen) > 0.5,
            "transposed": torch.randn(4, 6, generator=gen).t(),
            "scalar": torch.tensor(float(seed)),
            "empty": torch.empty(0, 3),
        },
        "optim": [
            {"step": seed, "lr": 1e-3, "betas": (0.9, 0.999)},
            torch.ones(3, dtype=torch.uint8),
        ],
        "name": f"run-{seed}",
        "none": None,
    }


def assert_same(actual: object, expected: object) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor)
        assert actual.dtype == expected.dtype
        assert actual.shape == expected.shape
        assert torch.equal(actual, expected)
    elif isinstance(expected, dict):
        assert isinstance(actual, dict)
        assert actual.keys() == expected.keys()
        for key in expected:
            assert_same(actual[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected)
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            assert_same(a, e)
    else:
        assert actual == expected


@pytest.fixture(scope="module", autouse=True)
def _warm_up(tmp_path_factory: pytest.TempPathFactory) -> None:
    """First use starts multiprocessing's resource tracker and fills caches: not leaks."""

    async def warm() -> None:
        async with aoffload.CheckpointEngine(tmp_path_factory.mktemp("warm")) as engine:
            await engine.save({"w": torch.ones(1)}, "m.pt", tag="t")
            await engine.commit()
            await engine.load("m.pt")

    asyncio.run(warm())


async def test_round_trip_of_nested_state_readable_by_plain_torch_load(tmp_path: Path) -> None:
    before = Snapshot.take()
    expected = nested_state(1)
    async with aoffload.CheckpointEngine(tmp_path, keep_last=None) as engine:
        assert engine.pid is not None
        assert engine.latest() is None
        assert engine.tags() == []
        await engine.save(expected, "model.pt", tag="step-1")
        await engine.save({"extra": [1, "two", 3.0]}, "sub/extra.pt", tag="step-1")
        result = await engine.commit()
        assert result.tag == "step-1"
        assert result.path == tmp_path / "step-1"
        assert set(result.files) == {"model.pt", "sub/extra.pt"}
        assert result.bytes == sum(
            (tmp_path / "step-1" / name).stat().st_size for name in result.files
        )
        assert result.write_gb_per_second > 0
        assert result.commit_seconds > 0
        assert engine.latest() == "step-1"
        assert engine.tags() == ["step-1"]
        assert (tmp_path / "latest").read_text().strip() == "step-1"
        manifest = json.loads((tmp_path / "step-1" / MANIFEST).read_text())
        assert (
            manifest["files"]["model.pt"]["bytes"] == (tmp_path / "step-1/model.pt").stat().st_size
        )
        assert_same(await engine.load("model.pt"), expected)
        assert_same(await engine.load("sub/extra.pt", tag="step-1"), {"extra": [1, "two", 3.0]})
        # A plain torch.save file: torch.load reads it without aoffload.
        assert_same(torch.load(tmp_path / "step-1" / "model.pt", weights_only=True), expected)
        # names unlinked once the writer mapped them (the snapshot counts this process's tree:
        # the suite's background benchmark makes segments of its own meanwhile)
        assert not Snapshot.take().shm - before.shm
    assert_same(await aoffload.load_checkpoint(tmp_path, "model.pt"), expected)
    assert not Snapshot.take().leaked_since(before)


async def test_snapshot_is_taken_when_save_returns(
    aoffload_engine: aoffload.CheckpointEngine,
) -> None:
    state = nested_state(2)
    expected = {k: v.clone() for k, v in state["model"].items()}  # type: ignore[union-attr]
    engine = aoffload_engine
    await engine.save(state["model"], "model.pt", tag="t")
    for tensor in state["model"].values():  # type: ignore[union-attr]
        tensor.add_(1) if tensor.dtype != torch.bool else tensor.logical_not_()
        tensor.zero_()
    await engine.commit("t")
    assert_same(await engine.load("model.pt"), expected)


async def test_bad_input_is_named_and_the_engine_stays_usable(
    aoffload_engine: aoffload.CheckpointEngine,
) -> None:
    engine = aoffload_engine
    await engine.save({"w": torch.ones(2)}, "model.pt", tag="good")
    await engine.commit()
    for name in ("../x", "/abs", "", "a/../b", MANIFEST):
        with pytest.raises(aoffload.InvalidStateError, match="file name"):
            await engine.save({"w": torch.ones(1)}, name, tag="t")
    for tag in ("", "a/b", ".hidden", "latest"):
        with pytest.raises(aoffload.InvalidStateError, match="tag"):
            await engine.save({"w": torch.ones(1)}, "m.pt", tag=tag)
    with pytest.raises(aoffload.InvalidStateError, match=r"\['opt'\]\['fn'\]") as info:
        await engine.save({"w": torch.ones(1), "opt": {"fn": lambda x: x}}, "m.pt", tag="t")
    assert isinstance(info.value, TypeError)
    assert isinstance(info.value, ValueError)
    with pytest.raises(aoffload.InvalidStateError, match=r"\['sparse'\].*layout"):
        await engine.save({"sparse": torch.eye(3).to_sparse()}, "m.pt", tag="t")
    with pytest.raises(aoffload.InvalidStateError, match=r"\[0\].*meta"):
        await engine.save([torch.empty(3, device="meta")], "m.pt", tag="t")
    with pytest.raises(aoffload.InvalidStateError, match="already committed"):
        await engine.save({"w": torch.ones(1)}, "m.pt", tag="good")
    with pytest.raises(aoffload.InvalidStateError, match="nothing was saved"):
        await engine.commit("never-saved")
    with pytest.raises(aoffload.CheckpointError, match="no committed checkpoint 'nope'"):
        await engine.load("model.pt", tag="nope")
    with pytest.raises(aoffload.CheckpointError, match=r"no file 'other\.pt'"):
        await engine.load("other.pt")
    await engine.save({"w": torch.ones(1)}, "m.pt", tag="t")
    with pytest.raises(aoffload.InvalidStateError, match="already saved"):
        await engine.save({"w": torch.ones(1)}, "m.pt", tag="t")
    await engine.commit("t")
    assert engine.tags() == ["good", "t"]
    assert_same(await engine.load("model.pt", tag="good"), {"w": torch.ones(2)})


async def test_a_flipped_byte_is_a_corrupt_checkpoint_naming_the_file(tmp_path: Path) -> None:
    async with aoffload.CheckpointEngine(tmp_path) as engine:
        await engine.save({"w": torch.arange(1000.0)}, "model.pt", tag="t")
        await engine.save({"v": torch.arange(10.0)}, "other.pt", tag="t")
        await engine.commit()
    path = tmp_path / "t" / "model.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(data)
    with pytest.raises(aoffload.CorruptCheckpointError, match=r"model\.pt.*checksum"):
        await aoffload.load_checkpoint(tmp_path, "model.pt")
    # verify=False skips the check (the flipped bit lies inside the tensor data).
    loaded = await aoffload.load_checkpoint(tmp_path, "model.pt", verify=False)
    assert not torch.equal(loaded["w"], torch.arange(1000.0))
    path.write_bytes(data[:-10])
    with pytest.raises(aoffload.CorruptCheckpointError, match=r"model\.pt.*bytes"):
        await aoffload.load_checkpoint(tmp_path, "model.pt")
    (tmp_path / "t" / "other.pt").unlink()
    with pytest.raises(aoffload.CorruptCheckpointError, match=r"other\.pt.*missing"):
        await aoffload.load_checkpoint(tmp_path, "other.pt", tag="t")


async def test_retention_keeps_the_newest_and_a_restart_sees_commit_order(tmp_path: Path) -> None:
    (tmp_path / ".tmp-crashed-1234").mkdir(parents=True)
    (tmp_path / ".tmp-crashed-1234" / "model.pt").write_bytes(b"partial")
    async with aoffload.CheckpointEngine(tmp_path, keep_last=2) as engine:
        assert not (tmp_path / ".tmp-crashed-1234").exists()
        for step in (30, 10, 20, 5):  # commit order, not name order, is what counts
            await engine.save({"step": torch.tensor(step)}, "m.pt", tag=f"s{step}")
            await engine.commit()
            assert engine.latest() == f"s{step}"
            assert engine.tags()[-1] == f"s{step}"
            assert len(engine.tags()) <= 2
        assert engine.tags() == ["s20", "s5"]
    assert sorted(os.listdir(tmp_path)) == [
        ".aoffload.lock",
        ".aoffload.writer",
        "latest",
        "s20",
        "s5",
    ]
    async with aoffload.CheckpointEngine(tmp_path, writer=False) as replica:
        assert replica.tags() == ["s20", "s5"]
        assert replica.latest() == "s5"
        assert (await replica.load("m.pt"))["step"].item() == 5


async def test_cancelled_commit_goes_on_and_later_commits_succeed(tmp_path: Path) -> None:
    async with aoffload.CheckpointEngine(tmp_path) as engine:
        await engine.save({"w": torch.randn(256, 1024)}, "m.pt", tag="a")
        waiter = asyncio.ensure_future(engine.commit("a"))
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        result = await engine.commit("a")
        assert result.tag == "a"
        assert engine.latest() == "a"
        await engine.save({"w": torch.ones(3)}, "m.pt", tag="b")
        assert (await engine.commit()).tag == "b"
        assert engine.tags() == ["a", "b"]
        assert_same(await engine.load("m.pt"), {"w": torch.ones(3)})


async def test_replica_runs_the_same_code_and_writes_nothing(tmp_path: Path) -> None:
    before = Snapshot.take()
    async with aoffload.CheckpointEngine(tmp_path / "ckpt", writer=False) as engine:
        assert engine.pid is None
        await engine.save(nested_state(3), "model.pt", tag="step-1")
        result = await engine.commit("step-1")
        assert result.files == ()
        assert result.bytes == 0
        with pytest.raises(aoffload.InvalidStateError):
            await engine.save({}, "../x", tag="step-1")
    assert not (tmp_path / "ckpt").exists()
    assert not Snapshot.take().leaked_since(before)


async def test_backpressure_waits_for_the_oldest_pending_checkpoint(tmp_path: Path) -> None:
    async with aoffload.CheckpointEngine(tmp_path, max_pending=1) as engine:
        await engine.save({"w": torch.randn(512, 1024)}, "m.pt", tag="a")
        with pytest.raises(aoffload.CheckpointError, match="max_pending"):
            await engine.save({"w": torch.ones(1)}, "m.pt", tag="b")  # would wait forever
        commit_a = asyncio.ensure_future(engine.commit("a"))  # the commit starts at the call
        await engine.save({"w": torch.ones(1)}, "m.pt", tag="b")
        assert engine.tags() == ["a"]  # b took the slot a's commit freed
        assert (tmp_path / "a" / MANIFEST).exists()
        assert (await commit_a).tag == "a"
        await engine.commit("b")


async def test_dead_writer_fails_save_and_commit_and_leaks_nothing(tmp_path: Path) -> None:
    before = Snapshot.take()
    async with aoffload.CheckpointEngine(tmp_path) as engine:
        await engine.save({"w": torch.ones(4)}, "m.pt", tag="good")
        await engine.commit()
        pid = engine.pid
        assert pid is not None
        await engine.save({"w": torch.randn(1024, 1024)}, "m.pt", tag="doomed")
        commit = asyncio.ensure_future(engine.commit("doomed"))
        await asyncio.sleep(0)
        os.kill(pid, signal.SIGKILL)
        started = time.perf_counter()
        with pytest.raises(aoffload.WorkerDiedError):
            await commit
        assert time.perf_counter() - started < 1.0  # sanity bound; ~ms in practice
        with pytest.raises(aoffload.WorkerDiedError):
            await engine.save({"w": torch.ones(4)}, "m.pt", tag="later")
        with pytest.raises(aoffload.WorkerDiedError):
            await engine.commit("later")
    assert pid not in child_pids()
    assert not Snapshot.take().leaked_since(before)
    assert not (tmp_path / "doomed").exists()
    assert (tmp_path / "latest").read_text().strip() == "good"
    assert_same(await aoffload.load_checkpoint(tmp_path, "m.pt"), {"w": torch.ones(4)})
