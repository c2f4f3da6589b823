"""Smoke test of `python -m aoffload.bench --quick`: it runs, and its JSON has the promised shape.

Speed is not asserted here; the benchmark itself reports it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_quick_benchmark_writes_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "aoffload.bench",
            "all",
            "--quick",
            "--json",
            str(out),
            "--dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert "## bridge" in completed.stdout
    data = json.loads(out.read_text())
    assert set(data) >= {"command", "date", "machine", "options", "figures", "ratios", "skipped"}
    assert data["machine"]["cpus"] >= 1
    assert data["options"]["quick"] is True
    sections = {f["section"] for f in data["figures"]}
    assert sections == {"bridge", "checkpoint", "optimizer", "distributed"}
    for figure in data["figures"]:
        assert {"system", "metric", "unit", "median", "min", "max", "samples"} <= set(figure)
        assert figure["min"] <= figure["median"] <= figure["max"]
    systems = {f["system"] for f in data["figures"]} | {s["system"] for s in data["skipped"]}
    for expected in (
        "aoffload",
        "torch.save+fsync",
        "aoffload CPUAdam (torch)",
        "aoffload bridge (asyncio)",
        "plain blocking pipe",
        "aoffload distributed",
        "dcp.async_save (gloo)",
    ):
        assert expected in systems, f"{expected} neither measured nor reported as skipped"
    for skipped in data["skipped"]:
        assert skipped["reason"]
