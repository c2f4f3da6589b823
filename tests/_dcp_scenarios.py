"""Rank functions for the DCP tests (run by ``tests._ranks.run_ranks`` on gloo ranks).

The state is a DTensor sharded by rows over the ranks (as FSDP2 shards a parameter), a
tensor every rank holds whole, and a plain value: saved on one world size and loaded on
another, every value must be what was saved. Each function returns what its rank saw.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ROWS, COLUMNS = 12, 5


def whole(step: int) -> torch.Tensor:
    """The sharded tensor's global value at ``step``: every element distinct."""
    return torch.arange(ROWS * COLUMNS, dtype=torch.float32).reshape(ROWS, COLUMNS) + 1000 * step


def _state(world: int, value: torch.Tensor, step: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return {
        "w": distribute_tensor(value, mesh, [Shard(0)]),
        "bias": torch.full((3,), float(step)),
        "meta": {"step": step, "name": "run-7"},
    }


def save(rank: int, world: int, directory: Path, steps: list[int]) -> None:
    """Save the state of each step with plain DCP into ``directory / f"step-{step}"``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    for step in steps:
        writer = FileSystemWriter(directory / f"step-{step}")
        dcp.save(_state(world, whole(step), step), storage_writer=writer)


def load(rank: int, world: int, directory: Path) -> dict[str, Any]:
    """Load the latest into a zeroed state sharded over this world (what each rank got,
    against the slice of :func:`whole` its shard should hold); then :func:`different_tags`."""
    import torch.distributed.checkpoint as dcp

    from aoffload.dcp import StorageReader

    state = _state(world, torch.zeros(ROWS, COLUMNS), -1)
    dcp.load(state, storage_reader=StorageReader(directory))
    local = state["w"].to_local()
    step = state["meta"]["step"]
    rows = ROWS // world
    expected = whole(step)[rank * rows : (rank + 1) * rows]
    return {
        "step": step,
        "meta": state["meta"],
        "shard_equal": bool(torch.equal(local, expected)),
        "shard_rows": local.shape[0],
        "bias": state["bias"].tolist(),
        "different_tags": different_tags(world, directory),
    }


def different_tags(world: int, directory: Path) -> dict[str, Any]:
    """Every rank names another tag (as if 'latest' moved between their reads): the load
    must fail on every rank, with nothing read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from aoffload.dcp import StorageReader

    state = _state(world, torch.zeros(ROWS, COLUMNS), -1)
    try:
        tag = f"step-{1 + torch.distributed.get_rank() % 2}"
        dcp.load(state, storage_reader=StorageReader(directory, tag))
    except CheckpointException as exc:
        errors = [f"{type(e).__name__}: {e}" for e, _ in exc.failures.values()]
        return {"failed": True, "errors": errors, "untouched": state["meta"]["step"] == -1}
    return {"failed": False}
