"""The CUDA staging path: device tensors are copied into pinned staging memory on a side
stream, off the event loop. Runs only where a CUDA device is present; never faked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import aoffload

from ._offload import off_loop
from .test_checkpoint import assert_same

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def cuda_context() -> None:
    """Create the CUDA context before the test's event loop runs: creating it takes seconds,
    and the loop guard would rightly flag that as a blocked loop. The kernels that make the
    tests' states are loaded here too, and the tests check what they loaded off the loop:
    on an H200 host a first use of a kernel (CUDA loads each lazily) took 50-70 ms on the
    loop, and the guard flagged the test's own work, not aoffload's."""
    torch.ones(1, device="cuda").sum().item()
    to_cpu(cuda_state(0))
    torch.cuda.synchronize()


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
        return value.detach().cpu().clone()  # a copy even for CPU tensors: the test zeroes them
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

    def check() -> None:
        assert_same(on_cpu, expected)
        assert isinstance(on_gpu, dict)
        assert on_gpu["w"].is_cuda
        assert_same(to_cpu(on_gpu), expected)
        plain = torch.load(tmp_path / "gpu" / "model.pt", weights_only=True)
        assert_same(plain, expected)

    await off_loop(check)


async def test_kernels_queued_before_save_are_captured(tmp_path: Path) -> None:
    big = torch.zeros(4096, 4096, device="cuda")
    for _ in range(20):  # queue work on the default stream; save must wait for it
        big.add_(1.0)
    async with aoffload.CheckpointEngine(tmp_path) as engine:
        await engine.save({"big": big}, "big.pt", tag="t")
        big.zero_()
        await engine.commit("t")
        loaded = await engine.load("big.pt", map_location="cuda")
    assert await off_loop(lambda: bool(torch.all(loaded["big"] == 20.0)))


async def test_stage_orders_the_copy_after_queued_kernels_and_fences_on_its_event(
    tmp_path: Path,
) -> None:
    big = torch.zeros(4096, 4096, device="cuda")
    async with aoffload.CheckpointEngine(tmp_path) as engine:
        for _ in range(20):  # queued on the current stream before stage(): captured
            big.add_(1.0)
        staged = engine.stage({"big": big}, "big.pt", tag="t")  # returns at once
        await staged  # resolves on the side-stream copy's completion event
        big.zero_()  # allowed after the fence
        await engine.commit("t")
        loaded = await engine.load("big.pt")
    assert await off_loop(lambda: bool(torch.all(loaded["big"] == 20.0)))


async def test_a_cuda_tensor_mutated_before_the_fence_fails_naming_its_key(tmp_path: Path) -> None:
    big = torch.zeros(8192, 8192, device="cuda")
    async with aoffload.CheckpointEngine(tmp_path) as engine:
        staged = engine.stage({"model": {"big": big}}, "big.pt", tag="t")
        for _ in range(50):  # queued after stage() recorded the version: always seen
            big.add_(1.0)
        with pytest.raises(aoffload.CheckpointError, match=r"state\['model'\]\['big'\]"):
            await staged
        with pytest.raises(aoffload.CheckpointError, match=r"nothing was saved|discarded"):
            await engine.commit("t")
        assert engine.latest() is None
