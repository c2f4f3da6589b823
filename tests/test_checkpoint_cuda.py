"""The CUDA staging path: device tensors are copied into pinned staging memory on a side
stream, off the event loop. Runs only where a CUDA device is present; never faked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import aoffload

from .test_checkpoint import assert_same

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def cuda_state(seed: int) -> dict[str, object]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return {
        "w": torch.randn(1024, 1024, generator=gen, device="cuda"),
        "b": torch.randn(4096, generator=gen, device="cuda").to(torch.bfloat16),
        "ids": torch.arange(100, device="cuda"),
        "transposed": torch.randn(64, 32, generator=gen, device="cuda").t(),
        "cpu": torch.randn(10, generator=torch.Generator().manual_seed(seed)),
        "step": seed,
    }


def to_cpu(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    return value


async def test_cuda_tensors_are_snapshotted_and_load_anywhere(tmp_path: Path) -> None:
    state = cuda_state(1)
    expected = to_cpu(state)
    async with aoffload.CheckpointEngine(tmp_path) as engine:
        await engine.save(state, "model.pt", tag="gpu")
        for value in state.values():  # the snapshot must not see these
            if isinstance(value, torch.Tensor):
                value.zero_()
        await engine.commit("gpu")
        on_cpu = await engine.load("model.pt")
        on_gpu = await engine.load("model.pt", map_location="cuda")
    assert_same(on_cpu, expected)
    assert isinstance(on_gpu, dict)
    assert on_gpu["w"].is_cuda
    assert_same(to_cpu(on_gpu), expected)
    plain = torch.load(tmp_path / "gpu" / "model.pt", weights_only=True)
    assert_same(plain, expected)


async def test_kernels_queued_before_save_are_captured(tmp_path: Path) -> None:
    big = torch.zeros(8192, 8192, device="cuda")
    for _ in range(20):  # queue work on the default stream; save must wait for it
        big.add_(1.0)
    async with aoffload.CheckpointEngine(tmp_path) as engine:
        await engine.save({"big": big}, "big.pt", tag="t")
        big.zero_()
        await engine.commit("t")
        loaded = await engine.load("big.pt")
    assert torch.all(loaded["big"] == 20.0)
