"""What a checkpoint costs a DeepSpeed trainer: the whole window, until the checkpoint is
durable.

aoffload's AsyncCheckpointEngine against DeepSpeed's own decoupled engine (python writer), in
one process on the same model. Each round times, back to back, :data:`STEPS` plain training
steps (the baseline), then a window: ``save_checkpoint`` and the :data:`STEPS` training steps
after it, and whatever wait it still takes until the checkpoint is durable, all inside the
timed window (aoffload: ``wait()``; DeepSpeed: its commit, made in the first step after the
save). The time a checkpoint costs is the window minus the baseline: a background write that
slows the steps it overlaps is counted, and no engine gets an untimed wait. Run as a script
for the figures::

    AOFFLOAD_STALL_WIDTH=4096 python -m tests.test_deepspeed_stall [ROUNDS]

``AOFFLOAD_STALL_ZERO=2`` runs the model under ZeRO stage 2 (default: stage 0).

The test runs that script in a subprocess (DeepSpeed's decoupled engine sets the global
multiprocessing start method, which must not leak into the test process), prints its table,
and checks that both engines end with ``latest`` naming a loadable checkpoint and that each
window was timed to the end; speed is measured, never asserted.
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
    config["zero_optimization"] = {"stage": int(os.environ.get("AOFFLOAD_STALL_ZERO", "0"))}
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


STEPS = 4
"""Training steps in each window: the save's write runs on during them."""
COLUMNS = (
    ("save_checkpoint", "save_checkpoint"),
    ("commit step", "the step after it"),
    ("window", f"save + {STEPS} steps, durable"),
    ("baseline", f"{STEPS} plain steps"),
    ("lost", "lost per checkpoint"),
)


def _steps(engine: Any, count: int) -> float:
    started = time.perf_counter()
    for _ in range(count):
        _forward_backward(engine)
        engine.step()
    return time.perf_counter() - started


def measure(
    engine: Any, directory: Path, rounds: int, durable: Any, steps: int = STEPS
) -> dict[str, float]:
    """Median seconds of each column of :data:`COLUMNS` over ``rounds`` rounds.

    ``durable()`` is called at the end of each window, inside it: it returns once the
    checkpoint is durable (for DeepSpeed's decoupled engine, whose commit the first step
    made, it has nothing left to wait for).
    """
    columns: dict[str, list[float]] = {name: [] for name, _ in COLUMNS}
    _steps(engine, 1)  # warm-up: the first step, then a first checkpoint (its writer starts)
    engine.save_checkpoint(str(directory), tag="warm-up")
    _steps(engine, steps)
    durable()
    for index in range(rounds):
        baseline = _steps(engine, steps)
        started = time.perf_counter()
        engine.save_checkpoint(str(directory), tag=f"step{index}")
        saved = time.perf_counter()
        first = _steps(engine, 1)  # the decoupled commit happens here
        _steps(engine, steps - 1)
        durable()
        window = time.perf_counter() - started
        if read_latest(directory) != f"step{index}":  # the window must end durable
            raise RuntimeError(f"step{index} was not published when its window ended")
        columns["save_checkpoint"].append(saved - started)
        columns["commit step"].append(first)
        columns["window"].append(window)
        columns["baseline"].append(baseline)
        columns["lost"].append(window - baseline)
    return {name: statistics.median(values) for name, values in columns.items()}


def compare(root: Path, rounds: int = 3, width: int = WIDTH) -> dict[str, dict[str, float] | str]:
    """Each engine's columns (or why it could not run: DeepSpeed's decoupled writer cannot
    pickle ZeRO-2's state in 0.19.8)."""
    from aoffload.deepspeed import install

    figures: dict[str, dict[str, float] | str] = {}
    for name, sub, decoupled in (
        ("deepspeed default (torch.save, no fsync)", "default", False),
        ("deepspeed decoupled (python writer, no fsync)", "deepspeed", True),
    ):
        theirs = _engine(decoupled=decoupled, width=width)
        try:
            figures[name] = measure(theirs, root / sub, rounds, lambda: None)
        except Exception as exc:  # noqa: BLE001 - a third-party engine that cannot run here
            figures[name] = f"could not run: {type(exc).__name__}: {str(exc)[:200]}"
        finally:
            theirs.destroy()
    ours = _engine(decoupled=False, width=width)
    ckpt = install(ours, directory=root / "aoffload")
    try:
        figures["aoffload AsyncCheckpointEngine (fsync)"] = measure(
            ours, root / "aoffload", rounds, ckpt.wait
        )
    finally:
        ckpt.cleanup()
        ours.destroy()
    return figures


def report(figures: dict[str, dict[str, float] | str]) -> str:
    header = "".join(f" {title:>22}" for _, title in COLUMNS)
    lines = [f"{'engine':46}{header}"]
    for name, row in figures.items():
        if isinstance(row, str):
            lines.append(f"{name:46} {row}")
            continue
        cells = "".join(f" {row[key] * 1e3:19.1f} ms" for key, _ in COLUMNS)
        lines.append(f"{name:46}{cells}")
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
    assert "aoffload AsyncCheckpointEngine (fsync)" in table
    assert f"save + {STEPS} steps, durable" in table
    assert "could not run" not in table  # ZeRO stage 0: every engine runs
    for sub in ("default", "deepspeed", "aoffload"):
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
