"""Staging memory that cannot leak (#20 finding 5). A trainer SIGKILLed while staging left
its ``/dev/shm`` segment behind, and neither a new engine nor ``aoffload clean`` removed
it (5 of 6 kills in the audit). Segments are now named by their owner (pid and start
time): an engine's start and ``clean`` remove a dead owner's, never a live one's. The
start also checks that ``/dev/shm`` can hold ``max_pending`` checkpoints as large as
the latest, naming the fix."""

from __future__ import annotations

import asyncio
import io
import json
import multiprocessing
import os
import signal
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

import pytest
import torch

import aoffload
from aoffload._cli import EXIT_OK, main
from aoffload.checkpoint.core.staging import Segment

MANIFEST = ".aoffload-manifest.json"


def _stage_and_hang(paths: Queue[Any]) -> None:
    segment = Segment(1 << 20)  # what the engine stages into
    paths.put(segment.path)
    signal.pause()  # until SIGKILLed, its segment still named in /dev/shm


def leave_dead_segment() -> str:
    """A segment of a trainer that was SIGKILLed while it still held it."""
    context = multiprocessing.get_context("spawn")
    paths: Queue[Any] = context.Queue()
    child = context.Process(target=_stage_and_hang, args=(paths,))
    child.start()
    try:
        path: str = paths.get(timeout=60)
    finally:
        os.kill(child.pid or 0, signal.SIGKILL)
        child.join(30)
    assert child.exitcode == -signal.SIGKILL
    assert os.path.exists(path), "the kill left no segment: the test proves nothing"
    return path


def present(path: str) -> bool:
    """Whether ``path`` exists (a stat of /dev/shm: no I/O to speak of)."""
    return os.path.exists(path)


async def test_an_engine_start_removes_a_dead_trainers_segment_and_keeps_a_live_one(
    tmp_path: Path,
) -> None:
    dead = await asyncio.to_thread(leave_dead_segment)
    live = await asyncio.to_thread(Segment, 1 << 20)  # this process's: alive
    try:
        async with aoffload.CheckpointEngine(tmp_path, durable=False) as engine:
            assert not present(dead)
            assert present(live.path)
            await engine.save({"w": torch.ones(4)}, "m.pt", tag="t")
            await engine.commit("t")
    finally:
        live.close()


def _clean(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(["clean", *argv], out=out), out.getvalue()


async def test_clean_removes_a_dead_trainers_segment(tmp_path: Path) -> None:
    async with aoffload.CheckpointEngine(tmp_path, durable=False) as engine:
        await engine.save({"w": torch.ones(4)}, "m.pt", tag="t")
        await engine.commit("t")
    dead = await asyncio.to_thread(leave_dead_segment)
    status, out = await asyncio.to_thread(_clean, str(tmp_path), "--dry-run")
    assert status == EXIT_OK
    assert dead in out
    assert present(dead)
    status, out = await asyncio.to_thread(_clean, str(tmp_path))
    assert status == EXIT_OK
    assert dead in out
    assert not present(dead)


async def test_start_refuses_a_staging_cap_shared_memory_cannot_hold(tmp_path: Path) -> None:
    """A latest checkpoint larger than /dev/shm no longer stops a start (the default cap
    keeps within it, and a larger state streams through); a cap chosen larger than what
    /dev/shm has free, for checkpoints that large, is refused at start, naming the fix."""
    async with aoffload.CheckpointEngine(tmp_path, durable=False) as engine:
        await engine.save({"w": torch.ones(4)}, "m.pt", tag="t")
        await engine.commit("t")
    # the latest checkpoint says it is larger than any /dev/shm
    manifest_path = tmp_path / "t" / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["m.pt"]["bytes"] = 1 << 50
    manifest_path.write_text(json.dumps(manifest))
    engine = aoffload.CheckpointEngine(tmp_path, durable=False, staging_bytes=1 << 49)
    with pytest.raises(aoffload.CheckpointError, match=r"--shm-size") as caught:
        await engine.astart()
    assert f"staging_bytes={1 << 49}" in str(caught.value)
    assert engine.pid is None  # nothing was left running
    async with aoffload.CheckpointEngine(tmp_path, durable=False, max_pending=2) as engine:
        await engine.save({"w": torch.ones(4)}, "m.pt", tag="u")
        await engine.commit("u")
