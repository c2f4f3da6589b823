"""DeepSpeed's save_checkpoint/load_checkpoint through aoffload on 2 gloo ranks, ZeRO 0-3."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip(
    "deepspeed", reason="DeepSpeed is not installed (pip install aoffload[deepspeed])"
)

from ._ranks import complete_tags, run_ranks

pytestmark = pytest.mark.deepspeed


def test_zero_0_to_3_round_trip_is_bit_identical_to_deepspeeds_engine(tmp_path: Path) -> None:
    stages = [0, 1, 2, 3]
    outcomes = run_ranks(
        2, "tests._deepspeed_ranks:round_trip", tmp_path, stages=stages, timeout=400
    )
    for rank, outcome in enumerate(outcomes):
        results = outcome.check()
        for stage in stages:
            result = results[str(stage)]
            assert result["tensors"] > 0
            assert result["same"], (rank, stage)  # loaded state == DeepSpeed's engine's
            assert result["same_as_saved"], (rank, stage)
            assert result["latest"] == "step2"  # save_latest=False left it alone
            scripts = {"zero_to_fp32.py", "zero_to_torch.py"}  # DeepSpeed's recovery scripts
            assert set(result["tags"]) - scripts == {"latest", "quiet", "step2"}
            if rank == 0 and stage > 0:
                assert result["fp32_same"], stage  # DeepSpeed's zero_to_fp32 reads it
    for stage in stages:
        assert complete_tags(tmp_path / f"aoffload-{stage}") == ["quiet", "step2"]
