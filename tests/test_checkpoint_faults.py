"""CheckpointEngine under faults: a SIGKILLed writer, a full disk, 100 checkpoints in a row."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

import aoffload
from aoffload._runtime.threads import run_in_thread

from ._leaks import Snapshot


def state_for(step: int, rows: int = 256) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((rows, 1024), float(step)) for i in range(4)}  # 4 MiB


def _holds(loaded: dict[str, torch.Tensor], step: int) -> bool:
    return all(
        torch.equal(tensor, torch.full((256, 1024), float(step))) for tensor in loaded.values()
    )


async def verify_directory(directory: Path) -> str | None:
    """``latest`` (if any) names a complete checkpoint that loads and verifies.

    The test's own tensor work (building and comparing 4 MiB) runs off the loop: on the
    loop's thread, torch's intra-op threads made it 50-70 ms whenever another process kept
    a core busy (#33.8), and the guard rightly timed it."""
    async with aoffload.CheckpointEngine(directory, writer=False) as replica:
        latest, tags = replica.latest(), replica.tags()
        assert all(not tag.startswith(".") for tag in tags)
        if latest is None:
            return None
        assert latest in tags
        step = int(latest.split("-")[1])
        loaded = await replica.load("model.pt")
        assert await run_in_thread(_holds, loaded, step, name="test-verify")
        return latest


async def crash_once(directory: Path, seed: int) -> None:
    rng = random.Random(seed)
    async with aoffload.CheckpointEngine(directory, keep_last=2) as engine:
        pid = engine.pid
        assert pid is not None

        async def train() -> None:
            for step in range(seed * 100, seed * 100 + 50):
                state = await run_in_thread(state_for, step, name="test-state")  # off the loop
                await engine.save(state, "model.pt", tag=f"step-{step}")
                await engine.commit()

        training = asyncio.create_task(train())
        await asyncio.sleep(rng.uniform(0.0, 0.4))
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(aoffload.WorkerDiedError):
            await training


def test_sigkill_at_random_points_never_leaves_a_partial_latest(tmp_path: Path) -> None:
    """20 seeds, one writer each (run once, not per event loop, to bound the time)."""
    before: Snapshot | None = None
    seen = set()
    for seed in range(1, 21):
        asyncio.run(crash_once(tmp_path, seed))
        before = before or Snapshot.take()  # after the first spawn started the resource tracker
        seen.add(asyncio.run(verify_directory(tmp_path)))
        assert not Snapshot.take().shm  # this tree's: the background benchmark makes its own
    assert len(seen) > 1  # the kills landed at different points
    assert before is not None
    after = Snapshot.take()
    assert not after.children - before.children
    assert not after.shm - before.shm


@pytest.fixture
def small_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A real 6 MiB tmpfs, so a write really fails with ENOSPC."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


async def test_full_disk_is_a_checkpoint_error_and_the_old_one_survives(
    small_filesystem: Path,
) -> None:
    async with aoffload.CheckpointEngine(small_filesystem) as engine:
        await engine.save({"w": torch.ones(256, 1024)}, "model.pt", tag="step-1")  # 1 MiB
        await engine.commit()
        await engine.save({"w": torch.ones(2048, 1024)}, "model.pt", tag="step-2")  # 8 MiB
        with pytest.raises(aoffload.CheckpointError, match=r"model\.pt.*No space left") as info:
            await engine.commit()
        assert isinstance(info.value.__cause__, aoffload.RemoteError)
        assert engine.latest() == "step-1"
        assert engine.tags() == ["step-1"]
        assert sorted(os.listdir(small_filesystem)) == [
            ".aoffload.lock",
            ".aoffload.writer",
            "latest",
            "step-1",
        ]
        assert torch.equal((await engine.load("model.pt"))["w"], torch.ones(256, 1024))
        await engine.save({"w": torch.zeros(256, 1024)}, "model.pt", tag="step-3")
        assert (await engine.commit()).tag == "step-3"
        assert torch.equal((await engine.load("model.pt"))["w"], torch.zeros(256, 1024))


async def test_memory_stays_bounded_over_100_checkpoints(tmp_path: Path) -> None:
    """RSS of trainer + writer after 100 checkpoints of 1 MiB stays near that after 10."""
    trainer = psutil.Process()
    async with aoffload.CheckpointEngine(tmp_path, keep_last=2, max_pending=2) as engine:
        assert engine.pid is not None
        writer = psutil.Process(engine.pid)
        rss = {}
        state = state_for(0, rows=64)
        for step in range(100):  # no tensor ops on the loop here: the guard would time them
            await engine.save(state, "model.pt", tag=f"step-{step}")
            await engine.commit()
            if step in (9, 99):
                rss[step] = trainer.memory_info().rss + writer.memory_info().rss
        assert engine.tags() == ["step-98", "step-99"]
    growth = rss[99] - rss[9]
    print(
        f"RSS trainer+writer after 10: {rss[9] / 2**20:.1f} MiB, after 100: "
        f"{rss[99] / 2**20:.1f} MiB (growth {growth / 2**20:.1f} MiB)"
    )
    assert growth < 16 << 20


def test_the_example_runs(tmp_path: Path) -> None:
    example = Path(__file__).parent.parent / "examples" / "train_with_checkpoints.py"
    args = [sys.executable, str(example), "--steps", "40", "--every", "10"]
    args += ["--directory", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(example.parent.parent)}  # this checkout's aoffload
    first = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False, env=env)
    assert first.returncode == 0, first.stderr
    assert "stall" in first.stdout
    resumed = subprocess.run(
        [*args, "--resume"], capture_output=True, text=True, timeout=120, check=False, env=env
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from step-40" in resumed.stdout


async def test_too_little_shared_memory_is_a_clear_error_not_a_sigbus(
    small_filesystem: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A container's /dev/shm is often 64 MiB; here a real 6 MiB tmpfs stands in for it.
    monkeypatch.setattr("aoffload.checkpoint.format.shm.SHM_DIR", str(small_filesystem))
    big, small = {"w": torch.ones(4096, 1024)}, {"w": torch.ones(256, 1024)}  # 16, 1 MiB
    # A staging cap larger than /dev/shm can hold fails the save that needs it, clearly.
    async with aoffload.CheckpointEngine(tmp_path / "ckpt", staging_bytes=16 << 20) as engine:
        with pytest.raises(aoffload.CheckpointError, match=r"shared memory.*--shm-size"):
            await engine.save(big, "model.pt", tag="big")
        assert os.listdir(small_filesystem) == []
        await engine.save(small, "model.pt", tag="small")  # fits
        assert (await engine.commit()).tag == "small"
    # The default cap keeps within what /dev/shm has free: the 16 MiB state streams.
    async with aoffload.CheckpointEngine(tmp_path / "ckpt") as engine:
        await engine.save(big, "model.pt", tag="big")
        result = await engine.commit()
        assert 0 < result.staging_bytes <= 3 << 20
        assert torch.equal((await engine.load("model.pt"))["w"], big["w"])
