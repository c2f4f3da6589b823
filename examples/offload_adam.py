"""Train a small transformer with OffloadAdam, a scheduler and clipping; resume it exactly.

:class:`aoffload.OffloadAdam` is a ``torch.optim`` AdamW whose step runs in a worker
process: each bucket of parameters is sent to the worker from the backward, as soon as
its gradients are in, and ``await opt.astep()`` finishes the step. ``max_grad_norm`` clips
by the global norm as ``clip_grad_norm_`` before the step would (the early steps are
speculative, and redone exactly when the norm turns out too large), and a ``StepLR``
schedule changes its ``lr`` as it would any optimizer's.

Every few steps, the model, the optimizer and the scheduler are checkpointed with
:class:`aoffload.CheckpointEngine`, and the step is stored in the commit's metadata.
Started again on the same directory, the run resumes from ``latest`` and prints the same
losses, bit for bit, as a run that was never interrupted::

    python examples/offload_adam.py --dir /tmp/run --steps 12 --kill-at 8   # dies at 8
    python examples/offload_adam.py --dir /tmp/run --steps 12               # resumes at 6
    python examples/offload_adam.py --dir /tmp/other --steps 12             # unbroken

The rule of checkpoints: stage between steps, and await a staging of the model
(:meth:`~aoffload.CheckpointEngine.stage`) before the next ``astep()``. The worker steps the
model's fp32 parameters in place, in shared memory, from the backward's first send of a
bucket until ``astep()`` returns; the next forward and backward may run while the engine
copies the parameters, because the backward's first send of a bucket waits for the copy of
it to end. A staging still unfenced when ``astep()`` returns fails loudly, never torn.
``astate_dict()`` is a snapshot of its own, which later steps never change.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch

import aoffload

VOCAB, WIDTH, LENGTH = 64, 64, 32


class TinyTransformer(torch.nn.Module):
    """Embedding, two encoder layers (no dropout: the run is deterministic), a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.position = torch.nn.Parameter(torch.zeros(LENGTH, WIDTH))
        layer = torch.nn.TransformerEncoderLayer(
            WIDTH, nhead=4, dim_feedforward=4 * WIDTH, dropout=0.0, batch_first=True
        )
        self.encoder = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        causal = torch.nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        hidden = self.encoder(self.embed(tokens) + self.position, mask=causal, is_causal=True)
        return self.head(hidden)


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)  # the data of step N never depends on the past
    start = torch.randint(0, VOCAB, (16, 1), generator=gen)
    tokens = (start + torch.arange(LENGTH + 1) * 3) % VOCAB  # learn: the next is +3
    return tokens[:, :-1], tokens[:, 1:]


async def train(directory: Path, steps: int, save_every: int, kill_at: int | None, backend: str):
    torch.manual_seed(0)
    model = TinyTransformer()
    decay = [p for n, p in model.named_parameters() if p.dim() > 1 and n != "position"]
    other = [p for n, p in model.named_parameters() if not (p.dim() > 1 and n != "position")]
    opt = aoffload.OffloadAdam(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=3e-3,
        backend=backend,
        bucket_mb=0.1,  # several buckets for a small model: they step during the backward
        max_grad_norm=1.0,
    )
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)

    async with aoffload.CheckpointEngine(directory, keep_last=2) as engine, opt:
        start = 0
        if engine.latest() is not None:  # <- resume: model, optimizer, schedule, step
            model.load_state_dict(await engine.load("model.pt"))
            saved = await engine.load("optim.pt")
            await opt.aload_state_dict(saved["optimizer"])
            schedule.load_state_dict(saved["schedule"])
            start = engine.metadata()["step"]  # <- stored with the commit, in the manifest
            print(f"resumed from {engine.latest()}", flush=True)

        staged: list[aoffload.Staged] = []
        committing = None
        for step in range(start, steps):
            tokens, targets = make_batch(step)
            logits = model(tokens)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.flatten())
            loss.backward()  # <- the hooks send each complete bucket (after its copy, if staged)
            for one in staged:  # the fence: the last checkpoint's copies are done...
                await one
            staged = []
            report = await opt.astep()  # <- ...before the step returns its new values
            if committing is not None:
                await committing  # durable on disk, in the background meanwhile
                committing = None
            opt.zero_grad()
            schedule.step()
            clipped = " (clipped)" if report.clipped else ""
            print(f"step {step} loss {loss.item():.17g}{clipped}", flush=True)
            if kill_at is not None and step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # <- no clean-up of any kind
            if (step + 1) % save_every == 0:
                tag = f"step-{step + 1}"
                state = {"optimizer": await opt.astate_dict(), "schedule": schedule.state_dict()}
                staged = [
                    engine.stage(model.state_dict(), "model.pt", tag=tag),
                    engine.stage(state, "optim.pt", tag=tag),
                ]
                # The commit starts now (on the engine's thread) and waits for the staging.
                committing = engine.commit(tag, metadata={"step": step + 1, "loss": loss.item()})
        for one in staged:
            await one
        if committing is not None:
            await committing


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
