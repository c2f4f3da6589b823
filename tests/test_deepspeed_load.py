"""AsyncCheckpointEngine.load is safe by default (#20, finding 2): verified against the tag's
manifest, ``weights_only=True``, DeepSpeed's own classes allowed by name and nothing else.
It used ``torch.load(weights_only=False)`` without a check: a file whose object had a
``__reduce__`` ran its code."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

pytest.importorskip(
    "deepspeed", reason="DeepSpeed is not installed (pip install aoffload[deepspeed])"
)

import aoffload
from tests.test_deepspeed import CONFIG, initialize_engine, train_step, weights

pytestmark = pytest.mark.deepspeed

MODEL = "mp_rank_00_model_states.pt"


class Payload:
    """Unpickling it makes a directory: code run by the load."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.mkdir, (str(self.marker),))


def forge(path: Path, value: object) -> None:
    """Replace ``path`` by a torch.save of ``value`` and make its manifest agree, as a forger
    with write access to the directory would."""
    torch.save(value, path)
    data = path.read_bytes()
    manifest_path = path.parent / ".aoffload-manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][path.name] = {"bytes": len(data), "xxh3_64": xxhash.xxh3_64(data).hexdigest()}
    manifest_path.write_text(json.dumps(manifest))


def optimizer_state(engine: Any) -> dict[str, list[torch.Tensor]]:
    """The ZeRO optimizer's inner (torch) optimizer state: its flat partitions' moments."""
    state = engine.optimizer.optimizer.state_dict()["state"]
    return {key: [s[key].clone() for s in state.values()] for key in ("exp_avg", "exp_avg_sq")}


@pytest.fixture(scope="module")
def stage1() -> Iterator[Any]:
    with warnings.catch_warnings():  # torch's first inductor import, in deepspeed.initialize
        warnings.simplefilter("ignore", DeprecationWarning)
        engine = initialize_engine({**CONFIG, "zero_optimization": {"stage": 1}})
    yield engine
    engine.destroy()


@pytest.fixture
def committed(stage1: Any, tmp_path: Path) -> Iterator[tuple[Any, Any, Path]]:
    """A ZeRO-1 engine with the adapter installed and one committed tag, t1."""
    from aoffload.deepspeed import install

    directory = tmp_path / "ckpt"
    ckpt = install(stage1, directory=directory)
    train_step(stage1)
    stage1.save_checkpoint(str(directory), tag="t1")
    train_step(stage1)  # DeepSpeed commits at the step boundary
    ckpt.wait()
    yield stage1, ckpt, directory
    ckpt.cleanup()


def test_zero1_round_trip_needs_only_the_documented_deepspeed_classes(
    stage1: Any, tmp_path: Path
) -> None:
    from aoffload.deepspeed import install

    directory = tmp_path / "ckpt"
    ckpt = install(stage1, directory=directory)
    try:
        train_step(stage1)
        saved_weights, saved_optim = weights(stage1), optimizer_state(stage1)
        stage1.save_checkpoint(str(directory), tag="t1")
        train_step(stage1)
        train_step(stage1)
        ckpt.wait()
        optim = directory / "t1" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
        with pytest.raises(Exception, match="Weights only load failed"):
            torch.load(optim, weights_only=True)  # DeepSpeed's objects are in it
        load_path, _ = stage1.load_checkpoint(str(directory))
        assert load_path is not None
        for key, value in weights(stage1).items():
            assert torch.equal(value, saved_weights[key]), key
        for key, values in optimizer_state(stage1).items():
            for got, want in zip(values, saved_optim[key], strict=True):
                assert torch.equal(got, want), key
    finally:
        ckpt.cleanup()


def test_a_pickle_that_runs_code_is_refused_even_with_a_forged_manifest(
    committed: tuple[Any, Any, Path], tmp_path: Path
) -> None:
    engine, ckpt, directory = committed
    marker = tmp_path / "ran"
    forge(directory / "t1" / MODEL, {"module": Payload(marker)})
    with pytest.raises(aoffload.CheckpointError, match="weights_only=True"):
        ckpt.load(str(directory / "t1" / MODEL))
    with pytest.raises(aoffload.CheckpointError, match="weights_only=True"):
        engine.load_checkpoint(str(directory), tag="t1")
    assert not marker.exists()


def test_a_file_that_does_not_match_its_manifest_is_refused(
    committed: tuple[Any, Any, Path],
) -> None:
    engine, _, directory = committed
    path = directory / "t1" / MODEL
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(data)
    with pytest.raises(aoffload.CorruptCheckpointError, match="checksum mismatch"):
        engine.load_checkpoint(str(directory), tag="t1")


def test_a_file_outside_any_committed_tag_is_refused(
    committed: tuple[Any, Any, Path], tmp_path: Path
) -> None:
    _, ckpt, _ = committed
    loose = tmp_path / "loose" / "t" / MODEL
    loose.parent.mkdir(parents=True)
    torch.save({"module": {}}, loose)
    with pytest.raises(aoffload.CheckpointError, match="not a file of a committed aoffload"):
        ckpt.load(str(loose))
