"""What each rank runs in tests/test_distributed_deepspeed.py (spawned rank processes)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

CONFIG: dict[str, Any] = {
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
}


def _engine(stage: int) -> Any:
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    config = {**CONFIG, "zero_optimization": {"stage": stage}}
    engine, _, _, _ = deepspeed.initialize(
        model=model, config=config, model_parameters=model.parameters()
    )
    return engine


def _step(engine: Any, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed * 100 + engine.global_rank)
    loss = engine(torch.randn(4, 8, generator=generator)).pow(2).mean()
    engine.backward(loss)
    engine.step()


def _state(engine: Any) -> list[torch.Tensor]:
    """This rank's model parameters (its partitions under ZeRO 3) and fp32 optimizer state."""
    optimizer = engine.optimizer
    tensors = [getattr(p, "ds_tensor", p).detach().clone() for p in engine.module.parameters()]
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        tensors += [t.detach().clone() for t in getattr(optimizer, name, [])]
    inner = getattr(optimizer, "optimizer", optimizer)
    for state in inner.state.values():
        tensors += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def _latest(directory: Path) -> str | None:
    path = directory / "latest"
    return path.read_text().strip() if path.exists() else None


def round_trip(rank: int, world: int, directory: Path, stages: list[int]) -> dict[str, Any]:
    """Per stage: save with DeepSpeed's engine and through aoffload, load both, compare."""
    import aoffload.deepspeed

    results: dict[str, Any] = {}
    for stage in stages:
        reference, ours = directory / f"ref-{stage}", directory / f"aoffload-{stage}"
        engine = _engine(stage)
        _step(engine, 1)
        _step(engine, 2)
        engine.save_checkpoint(str(reference), tag="step2")  # DeepSpeed's own engine
        saved = _state(engine)
        ckpt = aoffload.deepspeed.install(engine, directory=ours)
        engine.save_checkpoint(str(ours), tag="step2")
        _step(engine, 3)  # commits step2 in the background
        engine.save_checkpoint(str(ours), tag="quiet", save_latest=False)
        _step(engine, 4)
        ckpt.wait()
        latest = _latest(ours)
        engine.destroy()

        loaded = {}
        for name, where in (("reference", reference), ("aoffload", ours)):
            fresh = _engine(stage)
            if name == "aoffload":
                aoffload.deepspeed.install(fresh)
            fresh.load_checkpoint(str(where), tag="step2" if name == "reference" else None)
            loaded[name] = _state(fresh)
            fresh.destroy()
        same = [
            bool(torch.equal(a, b))
            for a, b in zip(loaded["reference"], loaded["aoffload"], strict=True)
        ]
        same_as_saved = [
            bool(torch.equal(a, b)) for a, b in zip(saved, loaded["aoffload"], strict=True)
        ]
        fp32_same = None
        if stage > 0 and rank == 0:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            theirs = get_fp32_state_dict_from_zero_checkpoint(str(reference), tag="step2")
            mine = get_fp32_state_dict_from_zero_checkpoint(str(ours), tag="step2")
            fp32_same = sorted(theirs) == sorted(mine) and all(
                torch.equal(theirs[k], mine[k]) for k in theirs
            )
        results[str(stage)] = {
            "tensors": len(same),
            "same": all(same),
            "same_as_saved": all(same_as_saved),
            "latest": latest,
            "tags": sorted(e for e in os.listdir(ours) if not e.startswith(".")),
            "fp32_same": fp32_same,
        }
    return results
