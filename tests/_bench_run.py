"""The suite's one run of the whole benchmark (``--smoke``), shared by the tests that read it."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["BenchRun", "run_bench_smoke"]


@dataclasses.dataclass(frozen=True)
class BenchRun:
    """One run of ``python -m aoffload.bench``: its exit status, output, JSON report, the
    per-section reports of ``--json-dir`` (by section) and the charts of ``--plot``."""

    returncode: int
    stdout: str
    stderr: str
    data: dict[str, Any] | None
    sections: dict[str, dict[str, Any]]
    charts: Path


def run_bench_smoke(directory: Path) -> BenchRun:
    """``python -m aoffload.bench all --smoke`` with its files and reports in ``directory``."""
    out, per_section, charts = directory / "bench.json", directory / "sections", directory / "plots"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    completed = subprocess.run(  # --smoke: every section and system once, on tiny states
        [sys.executable, "-m", "aoffload.bench", "all", "--smoke", "--json", str(out),
         "--json-dir", str(per_section), "--plot", str(charts), "--dir", str(directory)],
        capture_output=True, text=True, timeout=600, env=env, check=False,
    )  # fmt: skip
    data = json.loads(out.read_text()) if out.exists() else None
    sections = {
        path.stem.removeprefix("bench-"): json.loads(path.read_text())
        for path in sorted(per_section.glob("bench-*.json"))
    }
    return BenchRun(
        completed.returncode, completed.stdout, completed.stderr, data, sections, charts
    )
