"""An async SuperOffload-style training step with aoffload.CPUAdam.

Each parameter is one sub-group with an fp32 master copy on the CPU. During backward, as
soon as a parameter's gradient is ready, its sub-group is submitted to the CPU optimizer
(a *speculative* step: the global overflow check has not run yet). While the worker steps
the master copies, the trainer prepares the next batch and a task consumes
``opt.results()``, copying each updated master into the model. If the step turns out to
have overflowed, every speculative step is rolled back instead.

Run: ``python examples/async_offload_step.py [--backend auto|deepspeed|torch] [--steps N]``
"""

from __future__ import annotations

import argparse
import asyncio
import logging

import torch

import aoffload

OVERFLOW_AT = 3  # this step gets an inf gradient, to show the rollback


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(64, 32, generator=gen)
    return x, x.sum(dim=1, keepdim=True)


async def apply_updates(opt: aoffload.CPUAdam, params: list[torch.nn.Parameter]) -> int:
    applied = 0
    async for result in opt.results():  # <- completion order, while other work proceeds
        with torch.no_grad():
            params[result.subgroup_id].copy_(result.param)  # master -> model
        applied += 1
    return applied


async def train(backend: str, steps: int) -> float:
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    params = list(model.parameters())
    masters = [p.detach().clone() for p in params]  # fp32 master copies (sub-groups)
    grads = [torch.zeros_like(p) for p in params]  # the registered grad buffers
    loop = asyncio.get_running_loop()
    lr = 0.01

    async with aoffload.CPUAdam(
        [{"lr": lr, "weight_decay": 0.01}],
        backend=backend,
        exact_rollback=True,  # <- a step on an inf gradient is undone bit-exactly
    ) as opt:
        for i, master in enumerate(masters):
            await opt.register(0, i, master, grads[i])  # <- shared memory, once, off the loop

        def on_grad_ready(index: int, param: torch.nn.Parameter) -> None:
            if param.grad is None:
                return
            grads[index].copy_(param.grad)
            opt.submit(0, index, masters[index], grads[index], lr=lr)  # <- speculative step
            param.grad = None

        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(lambda p, i=i: on_grad_ready(i, p))

        batch = make_batch(0)
        loss = torch.tensor(0.0)
        for step in range(steps):
            x, y = batch
            out = torch.nn.functional.mse_loss(model(x), y)
            loss = out.detach()
            scale = float("inf") if step == OVERFLOW_AT else 1.0
            (out * scale).backward()  # hooks submit each sub-group as its grad is ready

            overflow = not all(torch.isfinite(g).all() for g in grads)
            if overflow:
                await opt.drain()  # the speculative steps finish, then are undone
                for i, master in enumerate(masters):
                    opt.submit(0, i, master, grads[i], rollback=True)  # <- rollback
                await opt.drain()
                logging.info("step %d overflowed: rolled back %d sub-groups", step, len(masters))
                continue

            consumer = asyncio.create_task(apply_updates(opt, params))
            batch = await loop.run_in_executor(None, make_batch, step + 1)  # next work
            applied = await consumer
            lr *= 0.95  # lr changes ride along with the next submits
            logging.info("step %d loss %.4f (%d sub-groups updated)", step, loss.item(), applied)
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="auto", choices=["auto", "deepspeed", "torch"])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    final = aoffload.run(train(args.backend, args.steps))
    print(f"final loss {final:.4f}")


if __name__ == "__main__":  # <- required: the worker is started with the spawn method
    main()
