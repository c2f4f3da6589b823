"""Two gloo ranks without a shared filesystem: each on a directory of its own, one S3 tier."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aoffload._moto import S3Endpoint
from aoffload.checkpoint.format import layout

from ._rank_scenarios import shard
from ._ranks import MANIFEST, assert_saved, check_files, run_ranks


def test_ranks_on_separate_directories_commit_locally_upload_and_resume(
    tmp_path: Path, aoffload_s3: str, aoffload_s3_endpoint: S3Endpoint
) -> None:
    outcomes = run_ranks(
        2, "tests._remote_scenarios:spread", tmp_path, timeout=240, url=aoffload_s3, victim=1
    )
    results = [outcome.check() for outcome in outcomes]
    for rank, result in enumerate(results):
        for step in (1, 2, 3):  # each node keeps its own files only
            assert result[f"local-{step}"] == [layout.MANIFEST, f"shard-{rank}.pt"]
        assert result["files"] == ["shard-0.pt", "shard-1.pt"]
        assert result["uploaded"]
        assert result["tags"] == ["step-2", "step-3"]
        assert result["latest"] == "step-3"
        assert "step-1" not in result["node"]  # retention on the local tier too
        assert result["committed-4"] == "step-4"  # durable locally whatever the upload does
        assert result["fresh_tags"] == ["step-2", "step-3"]
        assert result["fresh_latest"] == "step-3"
        assert result["fresh_metadata"] == {"step": 3, "rank": 0}  # rank 0's, from the manifest
        assert result["other"] == float(3 * 10 + (rank + 1) % 2)  # the other rank's shard
    healthy, victim = results[0]["failed"], results[1]["failed"]
    assert healthy[0] == "CheckpointError"
    assert "the upload failed on rank 1" in healthy[1]
    assert victim[0] in {"WorkerDiedError", "CheckpointError"}
    found = aoffload_s3_endpoint.objects(aoffload_s3)
    objects = sorted(found)
    assert objects == [
        "latest",
        f"step-2/{layout.MANIFEST}",
        "step-2/shard-0.pt",
        "step-2/shard-1.pt",
        f"step-3/{layout.MANIFEST}",
        "step-3/shard-0.pt",
        "step-3/shard-1.pt",
    ] or pytest.fail(f"nothing of step-4 may be published: {objects}")
    manifest = json.loads(found[f"step-3/{layout.MANIFEST}"])
    assert sorted(manifest["files"]) == ["shard-0.pt", "shard-1.pt"]  # one manifest, all ranks
    assert found["latest"] == b"step-3\n"
    for step in (2, 3):  # whole (xxhash, not aoffload's verifier), and what each rank saved
        tag = f"step-{step}"
        uploaded = check_files(tag, found[f"{tag}/{MANIFEST}"], lambda n, t=tag: found[f"{t}/{n}"])
        for rank in range(2):
            assert_saved(uploaded[f"shard-{rank}.pt"], shard(rank, step))
