"""The suite's own oracles can fail: the completeness check of tests/_ranks.py reads tags with
xxhash and torch.load, never aoffload's verifier, and catches each kind of partial tag."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import aoffload

from ._ranks import MANIFEST, assert_saved, complete_tags


@pytest.fixture
def tag(tmp_path: Path) -> Path:
    with aoffload.CheckpointEngine(tmp_path, durable=False) as engine:
        engine.save({"w": torch.arange(1024.0)}, "model.pt", tag="step-1").result(60)
        engine.commit("step-1").result(60)
    assert complete_tags(tmp_path) == ["step-1"]
    return tmp_path / "step-1"


def test_a_flipped_byte_is_caught(tag: Path) -> None:
    path = tag / "model.pt"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(AssertionError, match=r"partial tag 'step-1': model.pt does not hash"):
        complete_tags(tag.parent)


def test_a_short_file_is_caught(tag: Path) -> None:
    os.truncate(tag / "model.pt", 10)
    with pytest.raises(AssertionError, match=r"partial tag 'step-1': model.pt has 10 bytes"):
        complete_tags(tag.parent)


def test_a_missing_manifest_or_an_extra_file_is_caught(tag: Path) -> None:
    (tag / "stray.bin").write_bytes(b"x")
    with pytest.raises(AssertionError, match=r"tag 'step-1': files \{'stray.bin'\} not as listed"):
        complete_tags(tag.parent)
    (tag / "stray.bin").unlink()
    (tag / MANIFEST).unlink()
    with pytest.raises(AssertionError, match="partial tag 'step-1': no manifest"):
        complete_tags(tag.parent)


def test_other_values_than_those_saved_are_caught(tag: Path) -> None:
    assert_saved(tag / "model.pt", {"w": torch.arange(1024.0)})
    with pytest.raises(AssertionError, match="w differs from what was saved"):
        assert_saved(tag / "model.pt", {"w": torch.arange(1024.0) + 1})
    with pytest.raises(AssertionError):
        assert_saved(tag / "model.pt", {"v": torch.arange(1024.0)})
