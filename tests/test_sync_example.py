"""examples/train_sync.py: a synchronous trainer (no asyncio in it), SIGKILLed mid-run and
resumed, ends exactly where an unbroken run ends: the same losses, the same parameters."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
from pathlib import Path

from .test_resume_example import losses

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_sync.py"
STEPS = 12


def start(directory: Path, *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), "--dir", str(directory), "--steps", str(STEPS), *extra],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def run(process: subprocess.Popen[str], returncode: int) -> str:
    out, err = process.communicate(timeout=240)
    assert process.returncode == returncode, err
    return out


def line_of(output: str, prefix: str) -> str:
    return next(line for line in output.splitlines() if line.startswith(prefix))


def test_the_example_has_no_asyncio_in_it() -> None:
    tree = ast.parse(SCRIPT.read_text(encoding="utf-8"))
    imported = {
        alias.name.split(".")[0]
        for n in ast.walk(tree)
        if isinstance(n, ast.Import)
        for alias in n.names
    }
    imported |= {
        (n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
    }
    assert "asyncio" not in imported
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.AsyncFunctionDef | ast.Await)]


def test_killed_and_resumed_it_ends_where_an_unbroken_run_ends(tmp_path: Path) -> None:
    unbroken = start(tmp_path / "unbroken")
    killed = start(tmp_path / "run", "--kill-at", "8")  # checkpoints staged after 2, 5, 8
    expected = run(unbroken, 0)
    assert sorted(losses(expected)) == list(range(STEPS))
    before = losses(run(killed, -signal.SIGKILL))
    assert sorted(before) == list(range(9))

    out = run(start(tmp_path / "run"), 0)
    resumed_from = int(line_of(out, "resumed from step-").rsplit("-", 1)[1])
    assert resumed_from in (3, 6)  # step-9 was staged at the kill, never committed
    after = losses(out)
    assert sorted(after) == list(range(resumed_from, STEPS))
    assert before == {s: losses(expected)[s] for s in before}
    assert after == {s: losses(expected)[s] for s in after}
    assert line_of(out, "parameters") == line_of(expected, "parameters")
