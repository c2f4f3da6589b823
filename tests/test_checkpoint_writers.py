"""One writer per checkpoint directory, and committed tags that never change (#20, finding 4).

Two engines writing into one directory numbered their tags alike, retired only their own
and merged files into a tag the other had committed. Each test failed on 0bebd2f.
"""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import aoffload
from aoffload._cli import EXIT_OK, main

ROOT = Path(__file__).resolve().parent.parent

_HOLDER = """
import sys, torch, aoffload

async def hold():
    async with aoffload.CheckpointEngine(sys.argv[1], durable=False):
        print("ready", flush=True)
        sys.stdin.readline()

aoffload.run(hold())
"""


def small(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64,), float(step))}


async def test_a_second_writer_in_this_process_refuses_and_replicas_share(tmp_path: Path) -> None:
    async with aoffload.CheckpointEngine(tmp_path, durable=False) as first:
        await first.save(small(1), "model.pt", tag="step-1")
        second = aoffload.CheckpointEngine(tmp_path, durable=False)
        pattern = rf"another live checkpoint engine \(pid {os.getpid()} on .*\) writes in"
        with pytest.raises(aoffload.CheckpointError, match=pattern):
            await second.astart()
        async with aoffload.CheckpointEngine(tmp_path, writer=False) as replica:
            await first.commit("step-1")  # the writer goes on while a reader shares
            loaded = await replica.load("model.pt", tag="step-1")
            assert torch.equal(loaded["w"], small(1)["w"])
    async with aoffload.CheckpointEngine(tmp_path, durable=False) as third:  # once it closed
        assert third.tags() == ["step-1"]


async def test_a_second_writer_in_another_process_refuses_naming_it(tmp_path: Path) -> None:
    holder = await asyncio.to_thread(
        subprocess.Popen,
        [sys.executable, "-c", _HOLDER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert holder.stdout is not None
        assert (await asyncio.to_thread(holder.stdout.readline)).strip() == b"ready"
        engine = aoffload.CheckpointEngine(tmp_path, durable=False)
        with pytest.raises(aoffload.CheckpointError, match=rf"\(pid {holder.pid} on "):
            await engine.astart()
    finally:
        await asyncio.to_thread(holder.communicate, b"\n", 60)
    assert holder.returncode == 0
    async with aoffload.CheckpointEngine(tmp_path, durable=False) as engine:  # now it may
        await engine.save(small(1), "model.pt", tag="step-1")
        await engine.commit()


async def test_a_committed_tag_is_never_rewritten(tmp_path: Path) -> None:
    """A tag published under the engine meanwhile (copied in by a tool, say) is refused
    when the engine commits the same tag; the published one stays intact."""
    elsewhere = tmp_path / "elsewhere"
    async with aoffload.CheckpointEngine(elsewhere, durable=False) as other:
        await other.save(small(1), "a.pt", tag="x")
        await other.commit()
    directory = tmp_path / "ck"
    async with aoffload.CheckpointEngine(directory, durable=False) as engine:
        await asyncio.to_thread(shutil.copytree, elsewhere / "x", directory / "x")
        await engine.save(small(2), "b.pt", tag="x")
        with pytest.raises(aoffload.CheckpointError, match="never rewritten"):
            await engine.commit("x")
        assert engine.tags() == []
    assert sorted(os.listdir(directory / "x")) == [".aoffload-manifest.json", "a.pt"]
    out = io.StringIO()
    status = await asyncio.to_thread(main, ["verify", str(directory), "--tag", "x"], out)
    assert status == EXIT_OK, out.getvalue()
