"""The other process of the offload_adam section's "at once" figure: AdamW on one core,
stepped on demand (see ``_offload_adam_paced.at_once``)."""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Connection

__all__ = ["serve"]


def serve(conn: Connection, numel: int, count: int, lr: float, core: int) -> None:
    """Step ``torch.optim.AdamW(fused=True)`` over ``count`` parameters of ``numel`` on one
    thread pinned to ``core``, once per message; reply with the time it ended
    (``time.perf_counter``). ``None`` ends it."""
    os.sched_setaffinity(0, {core})
    import torch

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(9)
    params = [torch.nn.Parameter(torch.randn(numel, generator=gen)) for _ in range(count)]
    for param in params:
        param.grad = torch.randn(numel, generator=gen)
    opt = torch.optim.AdamW(params, lr=lr, fused=True)
    opt.step()  # the moments exist: every later step is a steady one
    conn.send("ready")
    while conn.recv() is not None:
        opt.step()
        conn.send(time.perf_counter())
