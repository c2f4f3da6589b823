"""The plugin's module-scoped engine: one worker for every test of a module, on its loop."""

from __future__ import annotations

import asyncio

import pytest
import torch

import aoffload

module_loop = pytest.mark.asyncio(loop_scope="module")

_seen: dict[str, tuple[int | None, int]] = {}  # loop type -> (writer pid, id of the loop)


def _loop() -> str:
    return (
        "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"
    )


@module_loop
async def test_the_first_test_saves_with_the_shared_engine(
    aoffload_shared_engine: aoffload.CheckpointEngine,
) -> None:
    await aoffload_shared_engine.save({"w": torch.arange(4.0)}, "m.pt", tag=f"first-{_loop()}")
    await aoffload_shared_engine.commit()
    assert aoffload_shared_engine.pid is not None
    _seen[_loop()] = (aoffload_shared_engine.pid, id(asyncio.get_running_loop()))


@module_loop
async def test_a_later_test_gets_the_same_engine_and_sees_what_it_saved(
    aoffload_shared_engine: aoffload.CheckpointEngine,
) -> None:
    assert _seen[_loop()] == (aoffload_shared_engine.pid, id(asyncio.get_running_loop()))
    assert f"first-{_loop()}" in aoffload_shared_engine.tags()
    loaded = await aoffload_shared_engine.load("m.pt", tag=f"first-{_loop()}")
    assert torch.equal(loaded["w"], torch.arange(4.0))


def test_each_loop_had_an_engine_of_its_own() -> None:
    assert set(_seen) == {"asyncio", "uvloop"}  # the conftest runs each test on both loops
    assert len({pid for pid, _ in _seen.values()}) == 2
