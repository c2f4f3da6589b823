"""examples/dcp_fsdp2.py: FSDP2 saved through aoffload's DCP route on 2 ranks, killed, and
resumed on 1 and on 4 ranks.

The killed run's directory must hold step-6 as ``latest``, complete (its manifest checked
here with xxhash) and a plain DCP checkpoint too. The resumed runs must load bit-identical
state (the digest of every value, each DTensor gathered whole, printed when step-6 was
committed and when it was loaded) and then print the losses the killed run printed for the
same steps (up to the rounding of a mean over another number of ranks).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests._ranks import complete_tags

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "dcp_fsdp2.py"


def start(directory: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), "--dir", str(directory), *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def finish(process: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=240)
    return process.returncode, out, err


def losses(output: str) -> dict[int, float]:
    return {int(m[1]): float(m[2]) for m in re.finditer(r"^step (\d+) loss (\S+)$", output, re.M)}


@pytest.mark.timeout(300)
def test_saved_on_two_ranks_killed_and_resumed_on_one_and_four(tmp_path: Path) -> None:
    code, out, err = finish(start(tmp_path / "run", "--ranks", "2", "--kill-at", "9"))
    assert code != 0, out
    assert "killed by signal 9" in err
    first = losses(out)
    assert sorted(first) == list(range(1, 9))
    saved = re.search(r"^saved step-6 on 2 ranks, digest (\w+)$", out, re.M)
    assert saved is not None, out
    assert (tmp_path / "run" / "latest").read_text().strip() == "step-6"
    assert complete_tags(tmp_path / "run") == ["step-3", "step-6"]
    assert (tmp_path / "run" / "step-6" / ".metadata").is_file()  # what FileSystemReader reads

    resumed = {}
    for ranks in (1, 4):  # each resumes a copy, side by side
        shutil.copytree(tmp_path / "run", tmp_path / f"run-{ranks}")
        resumed[ranks] = start(tmp_path / f"run-{ranks}", "--ranks", str(ranks), "--steps", "8")
    for ranks, process in resumed.items():
        code, out, err = finish(process)
        assert code == 0, err
        assert f"resumed from step-6 on {ranks} ranks, digest {saved[1]}\n" in out, out
        again = losses(out)
        assert sorted(again) == [7, 8], out
        for step, loss in again.items():
            assert math.isclose(loss, first[step], rel_tol=1e-6), (ranks, step, loss, first)
