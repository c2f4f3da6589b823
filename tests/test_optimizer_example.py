"""Smoke test: the CPUAdam overlap example runs end to end in a fresh interpreter."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("flags", "hook_thread"),
    [([], "the event loop thread"), (["--backward-in-thread"], "another thread")],
    ids=["backward-on-loop", "backward-in-thread"],
)
def test_async_offload_step_example_runs(flags: list[str], hook_thread: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "async_offload_step.py"), "--backend", "torch",
         "--steps", "6", *flags],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "step 3 overflowed: rolled back 6 sub-groups, masters restored exactly: True" in out
    for step in (0, 1, 2, 4, 5):
        assert f"step {step} loss nan" not in out, out
        assert re.search(rf"step {step} loss [\d.]+ \(6 sub-groups updated\)", out), out
    assert f"hooks ran on: {hook_thread}" in out, out
    losses = re.search(r"first loss ([\d.]+) final loss ([\d.]+)", out)
    assert losses is not None, out
    first, final = (float(v) for v in losses.groups())
    assert final < first, f"the model did not learn: {out}"
