"""engine.dcp under the engine's staging cap: a state larger than ``staging_bytes`` streams
through it in waves, each wave a file of the tag (``aoffload/dcp/_waves.py``).

Checked with independent readers: DCP's own ``FileSystemReader``, the tag's manifest and
its files hashed here (``complete_tags``), ``/dev/shm`` listed by this test.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader

import aoffload
from aoffload.checkpoint.format import shm
from tests._leaks import Snapshot
from tests._ranks import complete_tags, run_ranks
from tests.test_dcp_write import same

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

MIB = 1 << 20
CAP = 2 * MIB


def state(step: int) -> dict[str, Any]:
    """16 MiB of tensors (8x the cap), of every shape a wave must take: many small ones,
    one larger than half the cap, a view that is not dense, bf16, an empty one, values."""
    generator = torch.Generator().manual_seed(step)
    layers = {
        f"layer{i}": torch.rand(MIB // 4 * 3 // 2, generator=generator) for i in range(9)
    }  # 1.5 MiB each: larger than half the cap, alone in a wave
    return {
        "model": {
            **layers,
            "small": [torch.full((1000,), float(i + step)) for i in range(40)],
            "strided": torch.arange(2 * 256 * 1024, dtype=torch.float32).view(512, 1024)[:, ::2],
            "half": torch.rand(MIB // 2, generator=generator).to(torch.bfloat16),
            "empty": torch.zeros(0, 3),
        },
        "optim": {"step": torch.tensor(step), "lr": 0.1},
        "step": step,
    }


def blank() -> dict[str, Any]:
    return {
        "model": {
            **{f"layer{i}": torch.zeros(MIB // 4 * 3 // 2) for i in range(9)},
            "small": [torch.zeros(1000) for _ in range(40)],
            "strided": torch.zeros(512, 512),
            "half": torch.zeros(MIB // 2, dtype=torch.bfloat16),
            "empty": torch.zeros(0, 3),
        },
        "optim": {"step": torch.tensor(0), "lr": 0.0},
        "step": 0,
    }


def staging_bytes() -> int:
    """The bytes of this process's staging segments in /dev/shm."""
    prefix = shm.segment_prefix()
    return sum(
        entry.stat().st_size for entry in os.scandir(shm.SHM_DIR) if entry.name.startswith(prefix)
    )


def test_a_state_8x_the_cap_streams_through_it_and_loads_equal(tmp_path: Path) -> None:
    before = Snapshot.take()
    with aoffload.CheckpointEngine(tmp_path, staging_bytes=CAP, keep_last=1) as engine:
        held = staging_bytes()
        for step in (1, 2):
            response = engine.dcp.async_save(state(step), checkpoint_id=f"step-{step}")
            response.staging_completion.result()
            assert response.upload_completion.result().tag == f"step-{step}"
            assert staging_bytes() - held <= CAP  # the face's one segment of the cap
        into = blank()
        engine.dcp.load(into).result()
        assert same(into, state(2))
        files = sorted(p.name for p in (tmp_path / "step-2").glob("*.distcp"))
        assert len(files) >= 8  # a file per wave
    assert complete_tags(tmp_path) == ["step-2"]  # every file in the manifest, hashed equal
    plain = blank()
    dcp.load(plain, storage_reader=FileSystemReader(tmp_path / "step-2"), no_dist=True)
    assert same(plain, state(2))
    assert not Snapshot.take().leaked_since(before)  # the segment went with the engine


def test_a_state_that_fits_the_cap_stages_whole(tmp_path: Path) -> None:
    with aoffload.CheckpointEngine(tmp_path, staging_bytes=64 * MIB) as engine:
        engine.dcp.save(state(1), checkpoint_id="step-1").result()
    assert [p.name for p in (tmp_path / "step-1").glob("*.distcp")] == ["__0_0.distcp"]


def test_a_tensor_modified_during_the_streaming_fails_naming_its_key(tmp_path: Path) -> None:
    with aoffload.CheckpointEngine(tmp_path, staging_bytes=CAP) as engine:
        engine.dcp.save(state(1), checkpoint_id="step-1").result()
        mutated = state(2)
        response = engine.dcp.async_save(mutated, checkpoint_id="step-2")
        mutated["model"]["half"].add_(1)  # the last wave's: copied long after this
        with pytest.raises(aoffload.CheckpointError, match=r"state\['model'\]\['half'\]"):
            response.staging_completion.result()
        with pytest.raises(aoffload.CheckpointError, match="modified in place"):
            response.upload_completion.result()
        assert engine.latest() == "step-1"
        engine.dcp.save(state(3), checkpoint_id="step-3").result()  # still usable
        into = blank()
        engine.dcp.load(into).result()
        assert same(into, state(3))
    assert complete_tags(tmp_path) == ["step-1", "step-3"]


def test_an_item_larger_than_the_cap_fails_saying_what_to_do(tmp_path: Path) -> None:
    with aoffload.CheckpointEngine(tmp_path, staging_bytes=CAP) as engine:
        response = engine.dcp.async_save({"big": torch.zeros(CAP)}, checkpoint_id="t")
        with pytest.raises(aoffload.CheckpointError, match="larger staging_bytes"):
            response.staging_completion.result()
        with pytest.raises(aoffload.CheckpointError, match="big"):
            response.upload_completion.result()
        assert engine.latest() is None
        engine.dcp.save(state(1), checkpoint_id="step-1").result()
    assert complete_tags(tmp_path) == ["step-1"]


def staging_mappings() -> list[str]:
    with open("/proc/self/maps") as maps:
        return [line.strip() for line in maps if "/aoffload-" in line and "/dev/shm" in line]


def test_a_writer_killed_mid_stream_leaves_latest_and_no_staging(tmp_path: Path) -> None:
    before = Snapshot.take()
    big = {f"t{i}": torch.rand(MIB // 4) for i in range(256)}  # 256 MiB through 2 MiB
    engine = aoffload.CheckpointEngine(tmp_path, staging_bytes=CAP)
    with engine:
        engine.dcp.save(state(1), checkpoint_id="step-1").result()
        response = engine.dcp.async_save(big, checkpoint_id="step-2")
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(".tmp-step-2-*/__0_3.distcp")):  # some waves written
            assert time.monotonic() < deadline, "no wave was written"
            time.sleep(0.005)
        assert engine.pid is not None
        os.kill(engine.pid, signal.SIGKILL)
        with pytest.raises((aoffload.WorkerDiedError, aoffload.CheckpointError)):
            response.staging_completion.result(timeout=60)
        with pytest.raises((aoffload.WorkerDiedError, aoffload.CheckpointError)):
            response.upload_completion.result(timeout=60)
        assert engine.latest() == "step-1"
    assert not staging_mappings()  # every segment unmapped
    assert not Snapshot.take().leaked_since(before)  # nothing in /dev/shm, no process
    with aoffload.CheckpointEngine(tmp_path) as reopened:
        assert reopened.latest() == "step-1"
        assert reopened.tags() == ["step-1"]
        into = blank()
        reopened.dcp.load(into).result()
        assert same(into, state(1))


@pytest.mark.timeout(240)
def test_saved_through_the_cap_on_two_ranks_loads_on_one_and_on_four(tmp_path: Path) -> None:
    files = [o.check() for o in run_ranks(2, "tests._dcp_scenarios:capped_save", tmp_path)]
    assert all(len(each) >= 4 for each in files), files  # each rank streamed in waves
    assert complete_tags(tmp_path) == ["step-1", "step-2"]  # manifests, every file hashed
    for world in (1, 4):
        assert all(
            o.check() for o in run_ranks(world, "tests._dcp_scenarios:capped_load", tmp_path)
        )


@pytest.mark.timeout(200)
def test_an_item_over_the_cap_on_one_rank_fails_every_rank_at_once(tmp_path: Path) -> None:
    for outcome in run_ranks(2, "tests._dcp_scenarios:capped_refused", tmp_path, timeout=180):
        seen = outcome.check()
        assert "larger staging_bytes" in seen["failed"], seen["failed"]
        assert "extra1" in seen["failed"], seen["failed"]
        assert seen["seconds"] < 15  # not the commit's timeout (20 s here)
        assert seen["latest"] == "step-1"
        assert seen["after"] == "step-3"
    assert complete_tags(tmp_path) == ["step-1", "step-3"]
