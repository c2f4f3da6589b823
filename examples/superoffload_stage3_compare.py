"""DeepSpeed SuperOffload stage 3: its own CPU optimizer against aoffload's drop-in (needs CUDA).

Trains the same small model twice for ``--steps`` steps with ZeRO stage 3 and SuperOffload
(``offload_optimizer: {device: cpu, super_offload: true}``): once with DeepSpeed's
``SuperOffloadCPUOptimizer``, once after ``aoffload.deepspeed.install_superoffload(engine)``.
Prints every loss of both runs, whether they are identical, and each run's median step time.
Stage 3 calls ``async_step`` from its gradient hooks, on whatever thread autograd runs them
(its own per-device thread for CUDA): aoffload's drop-in sends each step from that thread,
straight through the optimizer's thread-safe core, with no event loop behind it.
SuperOffload refuses any accelerator but CUDA, so without one this prints why and exits 0::

    python examples/superoffload_stage3_compare.py --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any


def config() -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 1_000_000,
            "offload_optimizer": {"device": "cpu", "pin_memory": True, "super_offload": True},
        },
    }


def train(use_aoffload: bool, steps: int) -> tuple[list[float], list[float]]:
    import deepspeed
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU()) for _ in range(8)],
        torch.nn.Linear(1024, 1),
    )
    engine, *_ = deepspeed.initialize(
        model=model, config=config(), model_parameters=model.parameters()
    )
    if use_aoffload:
        from aoffload.deepspeed import install_superoffload

        install_superoffload(engine)  # <- the only change
    losses, times = [], []
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(4, 1024, generator=gen).to(engine.device, torch.bfloat16)
        y = torch.randn(4, 1, generator=gen).to(engine.device, torch.bfloat16)
        torch.cuda.synchronize()
        started = time.perf_counter()
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        losses.append(float(loss.float().item()))
    engine.destroy()
    return losses, times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--which", choices=("both", "deepspeed", "aoffload"), default="both")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("skipped: SuperOffload needs a CUDA device and none is available")
        return 0
    if args.which != "both":  # one run per process: DeepSpeed's state is process-wide
        losses, times = train(args.which == "aoffload", args.steps)
        print(json.dumps({"losses": losses, "times": times}))
        return 0
    import subprocess

    runs = {}
    for which in ("deepspeed", "aoffload"):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533",
               "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}  # fmt: skip
        done = subprocess.run(
            [sys.executable, __file__, "--steps", str(args.steps), "--which", which],
            env=env, capture_output=True, text=True, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            print(f"{which} run failed:\n{done.stderr[-4000:]}")
            return 1
        runs[which] = json.loads(done.stdout.strip().splitlines()[-1])
    for step, (a, b) in enumerate(
        zip(runs["deepspeed"]["losses"], runs["aoffload"]["losses"], strict=True)
    ):
        print(f"step {step:3d}  deepspeed {a:.9g}  aoffload {b:.9g}  {'=' if a == b else 'DIFFER'}")
    same = runs["deepspeed"]["losses"] == runs["aoffload"]["losses"]
    for which, run in runs.items():
        steady = run["times"][2:] or run["times"]  # the first steps build and warm up
        print(f"{which}: median step {statistics.median(steady) * 1e3:.1f} ms (n={len(steady)})")
    print("losses identical" if same else "losses DIFFER")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
