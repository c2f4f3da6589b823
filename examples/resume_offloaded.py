"""Resume an offloaded-optimizer run after a SIGKILL, with exactly the losses of an unbroken run.

A small model trains with :class:`aoffload.CPUAdam` (the Adam step runs in a worker process)
and checkpoints every few steps with :class:`aoffload.CheckpointEngine`: the model, and the
optimizer's moments and step counts from ``await opt.state_dict()``. Started again on the
same directory, it resumes from the ``latest`` checkpoint and prints the same losses, bit for
bit, as a run that was never interrupted::

    python examples/resume_offloaded.py --dir /tmp/run --steps 12 --kill-at 8   # dies at 8
    python examples/resume_offloaded.py --dir /tmp/run --steps 12               # resumes at 6
    python examples/resume_offloaded.py --dir /tmp/other --steps 12             # unbroken

Each loss is printed with all 17 digits, so equal lines mean equal bits. The training step
is synchronous, as in any training loop: forward, backward and the submits run on the event
loop's thread, the worker steps the sub-groups meanwhile, and ``await opt.drain()`` is the
step's one wait.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch

import aoffload


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)  # the data of step N never depends on the past
    x = torch.randn(64, 16, generator=gen)
    return x, x.sin().sum(dim=1, keepdim=True)


async def train(directory: Path, steps: int, save_every: int, kill_at: int | None, backend: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    params = [p.data for p in model.parameters()]  # the worker updates these in place
    grads = [torch.zeros_like(p) for p in params]  # registered gradient buffers

    async with (
        aoffload.CheckpointEngine(directory, keep_last=2) as engine,
        aoffload.CPUAdam([{"lr": 1e-2, "weight_decay": 0.01}], backend=backend) as opt,
    ):
        start = 0
        if engine.latest() is not None:  # <- resume: model, then the optimizer state
            saved = await engine.load("model.pt")
            model.load_state_dict(saved["model"])
            await opt.load_state_dict(await engine.load("optim.pt"))
            start = engine.metadata()["step"]  # <- stored with the commit, in the manifest
            print(f"resumed from {engine.latest()}", flush=True)

        for step in range(start, steps):
            x, y = make_batch(step)
            model.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            for index, param in enumerate(model.parameters()):
                if param.grad is not None:
                    grads[index].copy_(param.grad)
                opt.submit(0, index, params[index], grads[index])
            # Every sub-group stepped: the model is updated. The worker writes the params in
            # shared memory, which no version counter sees, so a checkpoint of them (below)
            # must never overlap a step in flight: drain first, then save.
            await opt.drain()
            print(f"step {step} loss {loss.item():.17g}", flush=True)
            if kill_at is not None and step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # <- no clean-up of any kind
            if (step + 1) % save_every == 0:
                tag = f"step-{step + 1}"
                await engine.save({"model": model.state_dict()}, "model.pt", tag=tag)
                await engine.save(await opt.state_dict(), "optim.pt", tag=tag)  # <- moments
                await engine.commit(tag, metadata={"step": step + 1, "loss": loss.item()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True, help="checkpoint directory")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--kill-at", type=int, default=None, help="SIGKILL itself after this step")
    parser.add_argument("--backend", default="torch", choices=("torch", "deepspeed", "auto"))
    args = parser.parse_args()
    aoffload.run(train(args.dir, args.steps, args.save_every, args.kill_at, args.backend))


if __name__ == "__main__":
    main()
