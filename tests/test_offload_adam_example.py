"""examples/offload_adam.py: killed by SIGKILL and resumed, it prints the unbroken losses
(OffloadAdam with StepLR and clipping, checkpointed through CheckpointEngine)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "offload_adam.py"


def start(directory: Path, *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), "--dir", str(directory), "--steps", "10", *extra],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def losses(output: str) -> dict[int, str]:
    found = {}
    for line in output.splitlines():
        if line.startswith("step "):
            step, _, loss = line.split()[1:4]
            found[int(step)] = loss
    return found


def test_killed_and_resumed_run_prints_the_unbroken_losses(tmp_path: Path) -> None:
    unbroken = start(tmp_path / "unbroken")
    killed = start(tmp_path / "killed", "--kill-at", "7")  # the last checkpoint is step-6
    out, err = unbroken.communicate(timeout=240)
    assert unbroken.returncode == 0, err
    expected = losses(out)
    assert sorted(expected) == list(range(10))
    out, err = killed.communicate(timeout=240)
    assert killed.returncode == -signal.SIGKILL, err
    before = losses(out)
    assert sorted(before) == list(range(8))

    resumed = start(tmp_path / "killed")
    out, err = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, err
    assert "resumed from step-6" in out
    assert "(clipped)" in out  # the clipping that is resumed exactly does trigger
    after = losses(out)
    assert sorted(after) == [6, 7, 8, 9]  # step 7 is done again, from the checkpoint
    assert before == {s: expected[s] for s in before}
    assert after == {s: expected[s] for s in after}
