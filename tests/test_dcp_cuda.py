"""aoffload.dcp.Stager's CUDA path: device tensors are copied into the page-locked staging
segment on a side stream, ordered after the work queued before ``stage()``. Runs only where
a CUDA device is present; never faked (on a CPU host the path is never taken)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader

import aoffload
from aoffload.dcp import Stager

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]


def cuda_state(seed: int) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return {
        "w": torch.randn(1024, 1024, generator=gen, device="cuda"),
        "b": torch.randn(4096, generator=gen, device="cuda").to(torch.bfloat16),
        "t": torch.randn(64, 32, generator=gen, device="cuda").t(),
        "cpu": torch.randn(10, generator=torch.Generator().manual_seed(seed)),
        "step": seed,
    }


def test_cuda_tensors_are_staged_on_the_cpu_and_saved(tmp_path: Path) -> None:
    torch.ones(1, device="cuda").sum().item()  # the context, before anything is timed
    state = cuda_state(1)
    state["w"].mul_(3)  # queued on the current stream before stage(): the copy sees it
    expected = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    stager = Stager()
    try:
        staged = stager.stage(state).result()
        for key, value in expected.items():
            if isinstance(value, torch.Tensor):
                assert staged[key].device.type == "cpu"
                assert torch.equal(staged[key], value), key
        del staged
        with aoffload.CheckpointEngine(tmp_path) as engine:
            engine.dcp.save(state, checkpoint_id="t").result()
    finally:
        stager.close()
    into = {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in expected.items()
    }
    dcp.load(into, storage_reader=FileSystemReader(tmp_path / "t"), no_dist=True)
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(into[key], value), key


def test_a_cuda_tensor_modified_before_its_copy_ends_is_named() -> None:
    stager = Stager()
    try:
        ahead = stager.stage({"x": torch.zeros(64 << 20)})  # copied first, on the CPU
        state = cuda_state(2)
        staged = stager.stage(state)
        state["w"].add_(1)  # queued after stage(): its version counter moves at once
        ahead.result()
        with pytest.raises(aoffload.CheckpointError, match=r"state\['w'\]"):
            staged.result()
    finally:
        stager.close()
