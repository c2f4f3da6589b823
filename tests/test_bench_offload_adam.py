"""The offload_adam benchmark section runs and measures OffloadAdam against its anchors."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from aoffload.bench import _offload_adam as section


def test_quick_offload_adam_section_measures_every_system(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    completed = subprocess.run(
        [sys.executable, "-m", "aoffload.bench", "offload_adam", "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=600, env=env, check=False,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["failed"] == []
    measured: dict[str, set[str]] = {}
    for figure in data["figures"]:
        assert figure["section"] == section.SECTION
        assert figure["n"] >= 3, figure
        assert all(math.isfinite(v) and v > 0 for v in figure["samples"]), figure
        measured.setdefault(figure["system"], set()).add(figure["metric"])
    for system in (
        section.FOREACH,
        section.FUSED,
        section.OFFLOAD,
        section.FUSED_CLIP,
        section.OFFLOAD_CLIP,
        section.ZERO_OFFLOAD,
        section.SEQUENTIAL,
        section.PACED,
        section.PACED_SPLIT,
        section.THREAD,
        section.ALONE,
        section.IDEAL,
        section.COPIES,
        section.ADAM_ONE,
        section.AT_ONCE,
    ):
        assert system in measured, f"{system} was not measured: {sorted(measured)}"
    steps = {m for m in measured[section.PACED] if m.startswith("step, t_b")}
    assert len(steps) == len(section.BACKWARDS) + 1  # the overlap section's t_b, and t_adam
    assert steps == {m for m in measured[section.IDEAL] if m.startswith("step, t_b")}
    names = {r["name"] for r in data["ratios"]}
    assert any(n.startswith(f"{section.PACED} / ideal") for n in names), names
    assert any(n.startswith(f"{section.THREAD} / ideal") for n in names), names
    assert any(n.startswith(f"{section.OFFLOAD} / {section.FUSED}") for n in names), names
    assert any(n.startswith(f"{section.OFFLOAD} / {section.ZERO_OFFLOAD}") for n in names), names
