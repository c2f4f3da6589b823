"""What a user habitually does must not lose a checkpoint or change one silently, on both faces.

A dict key added or removed between ``stage()`` and the fence fails the staging, naming the
key. Real writer process, real files.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import aoffload
from aoffload.checkpoint.core.plan import Structure, restructured, versions

MIB = 1 << 20
_CHANGED = r"state\['opt'\]\['extra'\] was added|changed size during iteration"
"""The fence names the key; a change racing the stage thread's pickling fails it there."""


def _state() -> dict[str, dict[str, object]]:
    return {
        "model": {"w": torch.ones(1024), "b": torch.zeros(8)},
        "opt": {"step": torch.tensor(3), "groups": [{"lr": 0.1}]},
    }


def _published(directory: Path) -> list[str]:
    return sorted(
        e for e in os.listdir(directory) if (directory / e / ".aoffload-manifest.json").is_file()
    )


# -- the fence notices a changed structure -------------------------------------------------


def test_a_key_added_before_the_fence_fails_the_staging_naming_it(tmp_path: Path) -> None:
    with aoffload.CheckpointEngine(tmp_path) as engine:
        engine.save(_state(), "m.pt", tag="good").result()
        engine.commit("good").result()
        state = _state()
        staged = engine.stage(state, "m.pt", tag="changed")
        state["opt"]["extra"] = torch.ones(4)  # the training step adds a key: the rule forbids it
        with pytest.raises(aoffload.CheckpointError, match=_CHANGED):
            staged.result()
        with pytest.raises(aoffload.CheckpointError, match=r"nothing was saved|discarded"):
            engine.commit("changed").result()
        assert engine.latest() == "good"
        engine.save(state, "m.pt", tag="next").result()  # the engine goes on
        engine.commit("next").result()
        assert sorted(engine.load("m.pt").result()["opt"]) == ["extra", "groups", "step"]
    assert _published(tmp_path) == ["good", "next"]


async def test_a_key_removed_before_the_fence_fails_the_staging_naming_it(tmp_path: Path) -> None:
    async with aoffload.CheckpointEngine(tmp_path) as engine:
        state = _state()
        staged = engine.stage(state, "m.pt", tag="changed")
        del state["model"]["b"]
        with pytest.raises(
            aoffload.CheckpointError,
            match=r"state\['model'\]\['b'\] was removed|changed size during iteration",
        ):
            await staged
        with pytest.raises(aoffload.CheckpointError, match=r"nothing was saved|discarded"):
            await engine.commit("changed")
        assert engine.latest() is None


async def test_a_list_grown_before_the_fence_fails_the_staging(tmp_path: Path) -> None:
    async with aoffload.CheckpointEngine(tmp_path) as engine:
        state = _state()
        staged = engine.stage(state, "m.pt", tag="changed")
        state["opt"]["groups"].append({"lr": 0.2})  # type: ignore[union-attr]
        with pytest.raises(
            aoffload.CheckpointError,
            match=r"state\['opt'\]\['groups'\] changed length from 1 to 2|changed size",
        ):
            await staged


async def test_a_structure_changed_after_the_fence_is_allowed(tmp_path: Path) -> None:
    async with aoffload.CheckpointEngine(tmp_path) as engine:
        state = _state()
        staged = engine.stage(state, "m.pt", tag="same")
        await staged
        state["opt"]["extra"] = 1  # after the fence: allowed
        await engine.commit("same")
        loaded = await engine.load("m.pt")
        assert sorted(loaded["opt"]) == ["groups", "step"]


def test_the_same_keys_in_another_order_are_the_same_structure() -> None:
    state = _state()
    structure: Structure = []
    versions(state, structure)
    state["model"]["b"] = state["model"].pop("b")
    assert restructured(structure, state) is None
    state["model"]["c"] = 1
    assert restructured(structure, state) == "state['model']['c'] was added"
