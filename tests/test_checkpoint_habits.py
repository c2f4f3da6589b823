"""What a user habitually does must not lose a checkpoint or change one silently, on both faces.

A dict key added or removed between ``stage()`` and the fence fails the staging, naming the
key. Nothing is discarded without a WARNING naming the tag; ``close()`` waits for the commits
``commit_soon()`` requested; ``load()`` reads the commits requested before it. Real writer
process, real files.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
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


# -- nothing is discarded quietly ----------------------------------------------------------


def _discarded(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "never committed" in r.getMessage()
    ]


def test_close_waits_for_a_commit_soon_and_names_a_tag_staged_behind_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="aoffload")
    # close_timeout bounds the writer's exit, not the commits: close waits for them
    with aoffload.CheckpointEngine(tmp_path, close_timeout=0.01) as engine:
        engine.save({"w": torch.ones(8 * MIB)}, "m.pt", tag="a").result()  # 32 MiB
        engine.commit_soon("a")
        engine.stage({"w": torch.ones(4)}, "m.pt", tag="b")  # waits for a's slot
    assert _published(tmp_path) == ["a"]
    assert (tmp_path / "latest").read_text().strip() == "a"
    assert any("'b'" in line for line in _discarded(caplog)), caplog.text


async def test_aclose_names_every_tag_it_discards(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="aoffload")
    big = await asyncio.to_thread(torch.ones, 8 * MIB)  # 32 MiB, made off the loop
    async with aoffload.CheckpointEngine(tmp_path, max_pending=3, close_timeout=0.01) as engine:
        await engine.save({"w": big}, "m.pt", tag="a")
        engine.commit_soon("a")
        await engine.save({"w": torch.ones(4)}, "m.pt", tag="b")  # staged, not committed
        engine.stage({"w": torch.ones(4)}, "m.pt", tag="c")  # still copying at close
    assert _published(tmp_path) == ["a"]
    discarded = _discarded(caplog)
    assert any("'b'" in line for line in discarded), caplog.text
    assert any("'c'" in line for line in discarded), caplog.text


def test_close_gives_up_on_a_commit_after_commit_timeout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="aoffload")
    engine = aoffload.CheckpointEngine(tmp_path, commit_timeout=1.0, close_timeout=1.0)
    with engine:
        engine.save({"w": torch.ones(4)}, "m.pt", tag="a").result()
        engine.commit("a").result()
        engine.save({"w": torch.ones(4)}, "m.pt", tag="b").result()
        pid = engine.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # a writer that never answers: the commit hangs
        try:
            engine.commit_soon("b")
            with pytest.raises(aoffload.CheckpointError, match=r"\['b'\] were not committed"):
                engine.close()
        finally:
            with contextlib.suppress(ProcessLookupError):  # killed by the close
                os.kill(pid, signal.SIGCONT)
    late = [r.getMessage() for r in caplog.records if "commit_timeout=1.0" in r.getMessage()]
    assert late, caplog.text
    assert "'b'" in late[0]
    assert (tmp_path / "latest").read_text().strip() == "a"


def test_load_right_after_commit_soon_reads_your_own_writes(tmp_path: Path) -> None:
    with aoffload.CheckpointEngine(tmp_path, max_pending=2) as engine:
        engine.save({"v": torch.zeros(1)}, "m.pt", tag="t1").result()
        engine.commit("t1").result()
        for step in (2, 3):
            engine.save({"v": torch.full((MIB,), float(step))}, "m.pt", tag=f"t{step}").result()
            engine.commit_soon(f"t{step}")
            assert float(engine.load("m.pt").result()["v"][0]) == step
            assert engine.latest() == f"t{step}"
        engine.save({"v": torch.full((MIB,), 4.0)}, "m.pt", tag="t4").result()
        engine.commit_soon("t4")
        assert float(engine.load("m.pt", tag="t4").result()["v"][0]) == 4.0


async def test_an_awaited_load_right_after_commit_soon_reads_your_own_writes(
    tmp_path: Path,
) -> None:
    async with aoffload.CheckpointEngine(tmp_path, max_pending=2) as engine:
        await engine.save({"v": torch.zeros(1)}, "m.pt", tag="t1")
        await engine.commit("t1")
        await engine.save({"v": torch.full((MIB,), 2.0)}, "m.pt", tag="t2")
        engine.commit_soon("t2")
        assert float((await engine.load("m.pt"))["v"][0]) == 2.0
        await engine.save({"v": torch.full((MIB,), 3.0)}, "m.pt", tag="t3")
        engine.commit_soon("t3")
        assert float((await engine.load("m.pt", tag="t3"))["v"][0]) == 3.0
