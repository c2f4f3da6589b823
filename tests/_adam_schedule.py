"""One schedule of sub-group steps, lr changes and rollbacks, replayed by every optimizer test."""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUPS = [
    {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False},
    {"lr": 5e-3, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.0, "amsgrad": False},
]
# (group id, sub-group id, numel): sub-group ids are unique across groups, as in DeepSpeed.
SUBGROUPS = [(0, 0, 64), (0, 1, 37), (1, 2, 50)]
ITERATIONS = 20


@dataclass(frozen=True)
class Op:
    group_id: int
    subgroup_id: int
    seed: int
    lr: float | None = None
    rollback: bool = False


def initial_params() -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    return {sg: torch.randn(n, generator=gen) for _, sg, n in SUBGROUPS}


def grad_for(op: Op, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(op.seed))


def iterations() -> list[list[Op]]:
    """Per iteration: each sub-group steps (some with a new lr); some steps are rolled back."""
    schedule = []
    for i in range(ITERATIONS):
        ops = []
        for gid, sg, _ in SUBGROUPS:
            lr = None
            if i == 5 and gid == 0:
                lr = 3e-3
            if i == 12 and gid == 1:
                lr = 2e-2
            ops.append(Op(gid, sg, seed=1000 * i + sg, lr=lr))
            if (i, sg) in {(3, 0), (7, 2), (11, 1), (15, 0), (15, 2)}:
                ops.append(Op(gid, sg, seed=1000 * i + sg, rollback=True))
        schedule.append(ops)
    return schedule


NUMEL = {sg: n for _, sg, n in SUBGROUPS}
