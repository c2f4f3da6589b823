"""Train on preemptible capacity: on SIGTERM every rank saves the same step, commits, exits 0.

A scheduler warns before it takes a job away: Kubernetes sends SIGTERM and waits 30 s, SLURM
sends ``--signal=USR1@N``, torchrun forwards SIGTERM to every rank. This trainer asks
``await notice.reached(step)`` after each step; once a signal reached any rank, it is True
on every rank at the same step, and each rank saves its state, the ranks commit one
checkpoint together and exit 0, well inside the grace window. Started again, it resumes from
that checkpoint with bit-identical state (each rank prints a digest of its state when it
saves and when it resumes)::

    torchrun --nproc-per-node 2 examples/preemptible_training.py --dir /tmp/run
    python examples/preemptible_training.py --dir /tmp/run --ranks 2     # spawns 2 gloo ranks
    python examples/preemptible_training.py --dir /tmp/run               # one process
    kill -TERM -<pgid of a rank>        # or Ctrl-C with --signal INT, SLURM: --signal USR1

Run it again with the same ``--dir``: it resumes at the saved step. Steps block the event
loop, as a real training step does; the signal is noticed all the same.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import aoffload


def build(rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(rank)  # each rank holds its own shard of the state
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step * 1000 + rank)  # step N's data never varies
    x = torch.randn(32, 64, generator=generator)
    return x, x[:, :8].sin()


def train_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, rank: int
) -> Any:
    """One step of training on step ``step``'s data; its loss."""
    x, y = batch(step, rank)
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    return {"model": model.state_dict(), "optim": optimizer.state_dict()}


def digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """A hash of every tensor of the state: equal digests mean equal bits."""
    hashed = hashlib.sha256()
    for tensor in [*model.state_dict().values(), *_tensors(optimizer.state_dict()["state"])]:
        hashed.update(tensor.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return hashed.hexdigest()[:16]


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for key in sorted(value) for t in _tensors(value[key])]
    return []


async def train(args: argparse.Namespace, rank: int, distributed: bool) -> None:
    torch.set_num_threads(1)
    model, optimizer = build(rank)
    name = f"rank-{rank}.pt"
    async with aoffload.CheckpointEngine(args.dir, distributed=distributed, keep_last=2) as engine:
        notice = engine.preemption(signals=(signal.Signals[f"SIG{args.signal}"],))  # <- listen
        start = 0
        if engine.latest() is not None:  # <- resume: every rank loads its own file
            saved = await engine.load(name)
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optim"])
            start = engine.metadata()["step"]  # committed with the checkpoint
            print(
                f"rank {rank}: resumed at step {start} digest {digest(model, optimizer)}",
                flush=True,
            )
        print(f"rank {rank}: ready", flush=True)
        for step in range(start + 1, args.steps + 1):
            loss = train_step(model, optimizer, step, rank)
            if distributed:
                dist.all_reduce(loss.detach())  # the ranks step together, as in data parallel
            time.sleep(args.step_seconds)  # noqa: ASYNC251 - a step waiting for its accelerator
            if await notice.reached(step):  # <- the same step on every rank
                started = time.perf_counter()
                await engine.save(snapshot(model, optimizer), name, tag=f"step-{step}")
                # durable on every rank when it returns
                await engine.commit(f"step-{step}", metadata={"step": step})
                print(
                    f"rank {rank}: preempted ({notice.signal.name if notice.signal else 'peer'})"
                    f" at step {step}, committed in {time.perf_counter() - started:.2f} s, "
                    f"digest {digest(model, optimizer)}",
                    flush=True,
                )
                return  # the engine closes, the handlers are restored: exit 0
            if step % args.save_every == 0:  # periodic checkpoints, as usual
                await engine.save(snapshot(model, optimizer), name, tag=f"step-{step}")
                engine.commit_soon(f"step-{step}", metadata={"step": step})
                print(
                    f"rank {rank}: saved step {step} digest {digest(model, optimizer)}", flush=True
                )
        print(
            f"rank {rank}: finished at step {args.steps} digest {digest(model, optimizer)}",
            flush=True,
        )


def run_rank(args: argparse.Namespace) -> None:
    rank = int(os.environ.get("RANK", "0"))
    distributed = "RANK" in os.environ  # under torchrun, or spawned by --ranks
    if distributed:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        aoffload.run(train(args, rank, distributed))
    finally:
        if distributed:
            dist.destroy_process_group()


def spawn_ranks(args: argparse.Namespace) -> int:
    """Start ``--ranks`` gloo ranks of this script, as torchrun would; their worst exit code."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # This launcher outlives the ranks: it takes the job's signals without dying (a Python
    # handler, unlike SIG_IGN, is not inherited by the ranks it starts).
    for signum in (signal.SIGINT, signal.SIGTERM, signal.Signals[f"SIG{args.signal}"]):
        signal.signal(signum, lambda signum, frame: None)
    ranks = []
    for rank in range(args.ranks):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(args.ranks),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        command = [sys.executable, __file__, *_without_ranks(sys.argv[1:])]
        ranks.append(subprocess.Popen(command, env=env))
    codes = [process.wait() for process in ranks]
    return max(codes, key=abs)


def _without_ranks(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--ranks":
            skip = True
        elif not arg.startswith("--ranks="):
            out.append(arg)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True, help="checkpoint directory")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--step-seconds", type=float, default=0.02, help="extra compute per step")
    parser.add_argument("--save-every", type=int, default=100, help="periodic checkpoints")
    parser.add_argument("--signal", default="TERM", help="the preemption signal: TERM, USR1, INT")
    parser.add_argument("--ranks", type=int, default=0, help="spawn this many gloo ranks")
    args = parser.parse_args()
    if args.ranks and "RANK" not in os.environ:
        raise SystemExit(spawn_ranks(args))
    run_rank(args)


if __name__ == "__main__":
    main()
