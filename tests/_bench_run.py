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
    """One run of ``python -m aoffload.bench``: its exit status, output and JSON report."""

    returncode: int
    stdout: str
    stderr: str
    data: dict[str, Any] | None


def run_bench_smoke(directory: Path) -> BenchRun:
    """``python -m aoffload.bench all --smoke`` with its files and report in ``directory``."""
    out = directory / "bench.json"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    completed = subprocess.run(  # --smoke: --quick's code, every section, smaller sizes
        [sys.executable, "-m", "aoffload.bench", "all", "--smoke", "--json", str(out),
         "--dir", str(directory)],
        capture_output=True, text=True, timeout=600, env=env, check=False,
    )  # fmt: skip
    data = json.loads(out.read_text()) if out.exists() else None
    return BenchRun(completed.returncode, completed.stdout, completed.stderr, data)
