"""Overlap the CPU optimizer with the backward pass, SuperOffload-style, with aoffload.CPUAdam.

Each parameter of a small MLP is one sub-group with an fp32 master copy on the CPU. During
backward, as soon as a parameter's gradient is accumulated, a gradient hook copies it into
the sub-group's registered (shared) grad buffer and submits the sub-group to the CPU
optimizer: a *speculative* step, since the global overflow check has not run yet. The
worker steps the masters of the last layers while autograd still computes the gradients of
the first ones. After backward the trainer checks for overflow: if the step overflowed,
every speculative step is rolled back; otherwise the updated masters are copied into the
model.

Which thread runs the hook? Autograd runs a CPU graph's backward, hooks included, on the
thread that calls ``backward()``; for CUDA tensors it runs them on its own per-device
thread. ``CPUAdam.submit()`` may be called from any thread, so the hook submits directly,
wherever it runs: the step is sent at once and its result recorded when it arrives, while
the event loop is blocked by the backward or busy elsewhere. By default this example calls
``backward()`` on the event loop's thread, as a synchronous training step does (the loop
does not turn until the step awaits ``drain()``); ``--backward-in-thread`` calls it in a
worker thread (``asyncio.to_thread``) instead, so that the loop stays free. The example
prints which thread the hooks ran on.

Run: ``python examples/async_offload_step.py [--backend auto|deepspeed|torch] [--steps N]
[--backward-in-thread]``
"""

from __future__ import annotations

import argparse
import asyncio
import threading

import torch

import aoffload

OVERFLOW_AT = 3  # this step gets an inf gradient, to show the rollback


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(64, 32, generator=gen)
    return x, x.sum(dim=1, keepdim=True)


class Submitter:
    """Submits a sub-group from a gradient hook, on whichever thread autograd runs it."""

    def __init__(self, opt: aoffload.CPUAdam, masters: list[torch.Tensor]) -> None:
        self.opt = opt
        self.masters = masters
        self.grads = [torch.zeros_like(m) for m in masters]  # registered grad buffers
        self.loop_thread = threading.get_ident()
        self.lr = 0.01
        self.threads: set[str] = set()  # where the hooks ran: printed, not needed
        self.error: BaseException | None = None

    def hook(self, index: int, param: torch.Tensor) -> None:
        """``register_post_accumulate_grad_hook``: the gradient of ``param`` is ready."""
        if param.grad is None:
            return
        if threading.get_ident() == self.loop_thread:
            self.threads.add("the event loop thread")
        else:
            self.threads.add(f"another thread ({threading.current_thread().name})")
        self.grads[index].copy_(param.grad)  # <- no step of this sub-group is in flight
        param.grad = None
        try:  # <- the speculative step, sent from this very thread
            self.opt.submit(0, index, self.masters[index], self.grads[index], lr=self.lr)
        except Exception as exc:  # noqa: BLE001 - re-raised by check(), never lost
            self.error = self.error or exc

    def check(self) -> None:
        """Raise the first error a submission from a hook met."""
        if self.error is not None:
            raise self.error


async def train(backend: str, steps: int, backward_in_thread: bool) -> tuple[float, float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 1),
    )  # fmt: skip
    params = list(model.parameters())
    masters = [p.detach().clone() for p in params]  # fp32 master copies, one per sub-group
    first = last = float("nan")

    async with aoffload.CPUAdam(
        [{"lr": 0.01, "weight_decay": 0.01}],
        backend=backend,
        exact_rollback=True,  # <- a step on an inf gradient is undone bit-exactly
    ) as opt:
        submitter = Submitter(opt, masters)
        for i, master in enumerate(masters):
            await opt.register(0, i, master, submitter.grads[i])  # <- shared memory, once
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(lambda p, i=i: submitter.hook(i, p))

        for step in range(steps):
            x, y = make_batch(step)
            out = torch.nn.functional.mse_loss(model(x), y)
            scale = float("inf") if step == OVERFLOW_AT else 1.0
            before = [m.clone() for m in masters] if step == OVERFLOW_AT else None
            if backward_in_thread:  # the loop stays free while autograd runs
                await asyncio.to_thread((out * scale).backward)
            else:  # a synchronous step: the loop does not turn until drain() below
                (out * scale).backward()  # hooks submit each sub-group as its grad is ready
            submitter.check()  # every hook has submitted (or failed) by now

            overflow = not all(bool(torch.isfinite(g).all()) for g in submitter.grads)
            results = await opt.drain()  # <- the speculative steps, all finished
            if overflow:
                for i, master in enumerate(masters):
                    opt.submit(0, i, master, submitter.grads[i], rollback=True)  # <- rollback
                undone = await opt.drain()
                exact = before is not None and all(
                    torch.equal(a, b) for a, b in zip(before, masters, strict=True)
                )
                print(
                    f"step {step} overflowed: rolled back {len(undone)} sub-groups, "
                    f"masters restored exactly: {exact}"
                )
                continue
            with torch.no_grad():
                for result in results:
                    params[result.subgroup_id].copy_(result.param)  # master -> model
            first = out.item() if step == 0 else first
            last = out.item()
            submitter.lr *= 0.95  # lr changes ride along with the next submits
            print(f"step {step} loss {last:.4f} ({len(results)} sub-groups updated)")
        print(f"hooks ran on: {', '.join(sorted(submitter.threads))}")
    return first, last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="auto", choices=["auto", "deepspeed", "torch"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--backward-in-thread",
        action="store_true",
        help="call backward() in a worker thread (the hooks then submit from that thread)",
    )
    args = parser.parse_args()
    first, final = aoffload.run(train(args.backend, args.steps, args.backward_in_thread))
    print(f"first loss {first:.4f} final loss {final:.4f}")


if __name__ == "__main__":  # <- required: the worker is started with the spawn method
    main()
