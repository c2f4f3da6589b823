"""Train a small model and checkpoint it asynchronously with aoffload.

Every ``--every`` steps the model and optimizer state are staged with
``CheckpointEngine.stage()`` right after the optimizer step: the call returns at once and
the snapshot copy overlaps the next forward and backward. Before the next optimizer step
the loop awaits the staging (the fence: the optimizer must not modify tensors still being
copied); ``commit_soon()`` then makes the checkpoint durable in the background. The stall
the loop sees is the ``stage()`` calls plus the fence. For comparison, the same state is
also written the blocking way (``torch.save`` + fsync) once per checkpoint, and both stalls
are printed side by side.

    python examples/train_with_checkpoints.py             # a fresh run in a temp dir
    python examples/train_with_checkpoints.py --directory ckpt --resume   # resume from latest
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

import aoffload


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512)
    )


def blocking_save(state: object, path: Path) -> float:
    """What a synchronous checkpoint costs: torch.save, then fsync."""
    started = time.perf_counter()
    with open(path, "wb") as file:
        torch.save(state, file)
        file.flush()
        os.fsync(file.fileno())
    return time.perf_counter() - started


def report(
    tag: str,
    stall: float,
    directory: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
) -> None:
    """Print the stall of the staged checkpoint next to a blocking torch.save of the same state."""
    blocking = blocking_save(
        {"model": model.state_dict(), "optim": optimizer.state_dict()},
        directory / "blocking-baseline.pt",
    )
    print(
        f"{tag}: stall {stall * 1000:6.2f} ms (stage() calls + fence)  "
        f"(blocking torch.save+fsync of the same state {blocking * 1000:6.1f} ms)"
    )


async def train(directory: Path, steps: int, every: int, resume: bool) -> None:
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randn(64, 512)
    start = 0
    async with aoffload.CheckpointEngine(directory, keep_last=2) as engine:  # spawns the writer
        if resume and engine.latest() is not None:
            # Verified against the manifest, loaded with weights_only=True, off the event loop.
            model.load_state_dict(await engine.load("model.pt"))
            optimizer.load_state_dict(await engine.load("optim.pt"))
            start = engine.metadata()["step"]  # <- what the commit stored in the manifest
            print(f"resumed from {engine.latest()} (step {start})")
        staged: list[aoffload.Staged] = []
        stall, tag, meta = 0.0, "", {}
        for step in range(start + 1, start + steps + 1):
            loss = (model(data) - data).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            if staged:
                stalled = time.perf_counter()
                for handle in staged:  # the fence: every tensor is copied, mutate freely
                    await handle
                stall += time.perf_counter() - stalled
                staged = []
                engine.commit_soon(tag, metadata=meta)  # durable in the background
                report(tag, stall, directory, model, optimizer)
            optimizer.step()
            if step % every:
                continue
            tag, meta = f"step-{step}", {"step": step, "loss": loss.item()}
            stalled = time.perf_counter()
            # Returns at once: the copy overlaps the next forward and backward.
            staged = [
                engine.stage(model.state_dict(), "model.pt", tag=tag),
                engine.stage(optimizer.state_dict(), "optim.pt", tag=tag),
            ]
            stall = time.perf_counter() - stalled
            print(f"{tag}: loss {loss.item():.4f}")
        for handle in staged:  # the last checkpoint has no next step to fence it
            await handle
        if staged:
            engine.commit_soon(tag, metadata=meta)
            report(tag, stall, directory, model, optimizer)
        if tag:
            result = await engine.commit(tag)  # the newest one's result; raises a failure
            print(
                f"{tag}: {result.bytes / 1e6:.1f} MB durable, written at "
                f"{result.write_gb_per_second:.2f} GB/s"
            )
        (directory / "blocking-baseline.pt").unlink(missing_ok=True)
        print(f"committed: {engine.tags()}, latest: {engine.latest()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--directory", type=Path, default=None, help="default: a temp dir")
    parser.add_argument("--resume", action="store_true", help="resume from `latest`")
    args = parser.parse_args()
    if args.directory is None:
        with tempfile.TemporaryDirectory(prefix="aoffload-demo-") as directory:
            aoffload.run(train(Path(directory), args.steps, args.every, args.resume))
    else:
        aoffload.run(train(args.directory, args.steps, args.every, args.resume))


if __name__ == "__main__":  # the writer is spawned: the guard is required
    main()
