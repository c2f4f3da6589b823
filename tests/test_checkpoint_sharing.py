"""Saved as ``torch.save`` saves (#20 finding 12): views of one storage come back sharing
it, and an ``nn.Parameter`` comes back a Parameter. On 0bebd2f each view was staged as a
storage of its own and a Parameter came back a plain Tensor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import aoffload


def state() -> dict[str, Any]:
    base = torch.arange(64, dtype=torch.float32)
    return {
        "base": base,
        "slice": base[8:24],
        "strided": base.view(8, 8).t(),  # non-contiguous
        "weight": torch.nn.Parameter(torch.ones(4, 4)),
        "frozen": torch.nn.Parameter(torch.zeros(3), requires_grad=False),
        "grad": torch.ones(2, requires_grad=True),
    }


def check(loaded: dict[str, Any]) -> None:
    want = state()
    for key, value in want.items():
        assert torch.equal(loaded[key].detach(), value.detach()), key
        assert loaded[key].stride() == value.stride(), key
    ptr = loaded["base"].untyped_storage().data_ptr()
    for key in ("slice", "strided"):
        assert loaded[key].untyped_storage().data_ptr() == ptr, f"{key} lost its storage"
    loaded["base"][10] = -1.0  # one storage: the slice sees the write
    assert loaded["slice"][2] == -1.0
    assert type(loaded["weight"]) is torch.nn.Parameter
    assert loaded["weight"].requires_grad
    assert type(loaded["frozen"]) is torch.nn.Parameter
    assert not loaded["frozen"].requires_grad
    assert type(loaded["grad"]) is torch.Tensor
    assert loaded["grad"].requires_grad


async def test_views_share_their_storage_and_parameters_stay_parameters(tmp_path: Path) -> None:
    async with aoffload.CheckpointEngine(tmp_path, durable=False) as engine:
        await engine.save(state(), "model.pt", tag="t")
        await engine.commit("t")
        check(await engine.load("model.pt"))
    # the file is a torch.save file with the same structure, for a plain torch.load too
    check(torch.load(tmp_path / "t" / "model.pt", weights_only=True))


@pytest.mark.parametrize("size", [0, 3])
async def test_empty_and_tiny_storages(tmp_path: Path, size: int) -> None:
    values = {"a": torch.empty(size), "b": torch.empty(0, 5), "c": torch.ones(size)[1:]}
    async with aoffload.CheckpointEngine(tmp_path, durable=False) as engine:
        await engine.save(values, "m.pt", tag="t")
        await engine.commit("t")
        loaded = await engine.load("m.pt")
    for key, value in values.items():
        assert loaded[key].shape == value.shape, key
