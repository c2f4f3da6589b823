"""Smoke test: the CPUAdam example runs end to end in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_async_offload_step_example_runs() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "async_offload_step.py"), "--backend", "torch",
         "--steps", "5"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "step 3 overflowed: rolled back 4 sub-groups" in done.stderr
    assert "step 4 loss" in done.stderr
    assert "final loss" in done.stdout
