"""The other process of the paced backward's "at once" figure: AdamW, stepped on demand.

It imports torch only once it runs, after it has set ``GOMP_SPINCOUNT`` as aoffload's
workers do (unless a wait policy is set), so that its threads wait for the next step as
an OffloadAdam worker's would.
"""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Connection

__all__ = ["serve"]


def serve(conn: Connection, numel: int, count: int, lr: float) -> None:
    """Step ``torch.optim.AdamW(fused=True)`` over ``count`` parameters of ``numel`` once per
    message; reply with the time it ended (``time.perf_counter``). ``None`` ends it."""
    if not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & os.environ.keys():
        os.environ["GOMP_SPINCOUNT"] = "50000"
    import torch

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
