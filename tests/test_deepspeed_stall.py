"""How long the trainer waits in ``save_checkpoint`` and at the next ``step()``.

aoffload's AsyncCheckpointEngine against DeepSpeed's own decoupled engine (python writer), in
one process on the same model. Run as a script for the figures::

    AOFFLOAD_STALL_WIDTH=4096 python -m tests.test_deepspeed_stall [ROUNDS]

The test runs that script in a subprocess (DeepSpeed's decoupled engine sets the global
multiprocessing start method, which must not leak into the test process), prints its table,
and checks only that both engines end with ``latest`` naming a loadable checkpoint; speed is
measured, never asserted.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip(
    "deepspeed", reason="DeepSpeed is not installed (pip install aoffload[deepspeed])"
)

from tests.test_deepspeed import CONFIG, read_latest, single_process_env

pytestmark = pytest.mark.deepspeed

WIDTH = 1024  # ~2.1 M parameters: ~25 MB of checkpoint with Adam's moments


def _model_config(decoupled: bool) -> dict[str, Any]:
    config = dict(CONFIG)
    if decoupled:
        config["checkpoint"] = {
            "writer": {"type": "python", "decoupled": True, "data_parallel": "replica"}
        }
    return config


def _engine(decoupled: bool, width: int) -> Any:
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
        torch.nn.ReLU(), torch.nn.Linear(width, 1),
    )  # fmt: skip
    single_process_env()
    engine, _, _, _ = deepspeed.initialize(
        model=model, config=_model_config(decoupled), model_parameters=model.parameters()
    )
    return engine


def _forward_backward(engine: Any) -> None:
    loss = engine(torch.randn(4, 8)).pow(2).mean()
    engine.backward(loss)


def measure(engine: Any, directory: Path, rounds: int, wait: Any) -> dict[str, float]:
    """Median seconds in save_checkpoint, in the committing step(), and in a plain step()."""
    saves, commit_steps, plain_steps = [], [], []
    for index in range(rounds):
        _forward_backward(engine)
        start = time.perf_counter()
        engine.step()
        plain_steps.append(time.perf_counter() - start)
        start = time.perf_counter()
        engine.save_checkpoint(str(directory), tag=f"step{index}")
        saves.append(time.perf_counter() - start)
        _forward_backward(engine)
        start = time.perf_counter()
        engine.step()  # the decoupled commit happens here
        commit_steps.append(time.perf_counter() - start)
        wait()
    return {
        "save_checkpoint": statistics.median(saves),
        "commit step": statistics.median(commit_steps),
        "plain step": statistics.median(plain_steps),
    }


def compare(root: Path, rounds: int = 3, width: int = WIDTH) -> dict[str, dict[str, float]]:
    from aoffload.deepspeed import install

    figures = {}
    theirs = _engine(decoupled=True, width=width)
    try:
        figures["deepspeed decoupled (python writer)"] = measure(
            theirs, root / "deepspeed", rounds, lambda: None
        )
    finally:
        theirs.destroy()
    ours = _engine(decoupled=False, width=width)
    ckpt = install(ours, directory=root / "aoffload")
    try:
        figures["aoffload AsyncCheckpointEngine"] = measure(
            ours, root / "aoffload", rounds, ckpt.wait
        )
    finally:
        ckpt.cleanup()
        ours.destroy()
    return figures


def report(figures: dict[str, dict[str, float]]) -> str:
    lines = [f"{'engine':38} {'save_checkpoint':>16} {'commit step':>12} {'plain step':>11}"]
    for name, row in figures.items():
        lines.append(
            f"{name:38} {row['save_checkpoint'] * 1e3:13.1f} ms {row['commit step'] * 1e3:9.1f} ms"
            f" {row['plain step'] * 1e3:8.1f} ms"
        )
    return "\n".join(lines)


def test_stall_against_deepspeeds_decoupled_engine(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.test_deepspeed_stall", "2", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    table = done.stdout[done.stdout.index("engine ") :]
    print("\n" + table)
    assert "aoffload AsyncCheckpointEngine" in table
    for sub in ("deepspeed", "aoffload"):
        latest = read_latest(tmp_path / sub)
        assert latest == "step1"
        state = torch.load(
            tmp_path / sub / latest / "mp_rank_00_model_states.pt", weights_only=False
        )
        assert state["module"]["2.weight"].shape == (WIDTH, WIDTH)


def main() -> None:
    import tempfile

    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    width = int(os.environ.get("AOFFLOAD_STALL_WIDTH", WIDTH))
    if len(sys.argv) > 2:
        print(report(compare(Path(sys.argv[2]), rounds=rounds, width=width)))
        return
    with tempfile.TemporaryDirectory() as root:
        print(f"model width {width}: {(width * width + 10 * width) * 12 / 1e6:.0f} MB checkpoint")
        print(report(compare(Path(root), rounds=rounds, width=width)))


if __name__ == "__main__":
    main()
