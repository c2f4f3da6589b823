"""A synchronous trainer that checkpoints without stalling, survives SIGKILL, and resumes exactly.

No asyncio anywhere: the engine is a context manager (``with``), and every call that waits
returns a handle whose ``.result()`` blocks this thread only as long as it must. Every few
steps the model and the optimizer are *staged*: ``stage()`` returns at once, the copy into
staging memory overlaps the next step's forward and backward, and ``staged.result()`` is
the fence, right before ``optimizer.step()`` changes what was staged. The commit then runs
in the background (``commit_soon()``): the writer process writes and fsyncs the file while
training goes on. Started again on the same directory, the run resumes from ``latest`` and
prints the same losses, bit for bit, as a run that was never interrupted::

    python examples/train_sync.py --dir /tmp/run --steps 12 --kill-at 8   # dies after step 8
    python examples/train_sync.py --dir /tmp/run --steps 12               # resumes, ends
    python examples/train_sync.py --dir /tmp/other --steps 12             # unbroken

Each loss is printed with all 17 digits and the final parameters as a SHA-256 of their
bytes, so equal lines mean equal bits.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
from pathlib import Path

import torch

import aoffload


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)  # the data of step N never depends on the past
    x = torch.randn(64, 16, generator=gen)
    return x, x.sin().sum(dim=1, keepdim=True)


def fingerprint(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().numpy().tobytes())
    return digest.hexdigest()


def train(directory: Path, steps: int, save_every: int, kill_at: int | None) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    with aoffload.CheckpointEngine(directory, keep_last=2) as engine:  # <- no event loop
        start = 0
        if engine.latest() is not None:  # <- resume: the newest durable checkpoint
            saved = engine.load("state.pt").result()
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            start = engine.metadata()["step"]  # <- stored with the commit, in the manifest
            print(f"resumed from {engine.latest()}", flush=True)

        pending: tuple[str, int, aoffload.Staged] | None = None
        for step in range(start, steps):
            x, y = make_batch(step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()  # <- the staging copy of the last checkpoint overlaps this step
            if pending is not None:
                tag, resume_at, staged = pending
                staged.result()  # <- the fence: before optimizer.step() changes the state
                engine.commit_soon(tag, metadata={"step": resume_at})  # <- in the background
                pending = None
            optimizer.step()
            print(f"step {step} loss {loss.item():.17g}", flush=True)
            if kill_at is not None and step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # <- no clean-up of any kind
            if (step + 1) % save_every == 0:
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                tag = f"step-{step + 1}"
                pending = (tag, step + 1, engine.stage(state, "state.pt", tag=tag))  # <- at once

        if pending is not None:  # the last checkpoint: wait until it is durable
            tag, resume_at, staged = pending
            staged.result()
            engine.commit(tag, metadata={"step": resume_at}).result()
    print(f"parameters {fingerprint(model)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True, help="checkpoint directory")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--kill-at", type=int, default=None, help="SIGKILL itself after this step")
    args = parser.parse_args()
    train(args.dir, args.steps, args.save_every, args.kill_at)


if __name__ == "__main__":
    main()
