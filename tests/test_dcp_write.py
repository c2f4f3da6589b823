"""aoffload.dcp's saving route: Stager + StorageWriter through an engine, and engine.dcp.

Checked with independent readers: DCP's own ``FileSystemReader`` on each tag, the tag's
manifest read as JSON and every file hashed with xxhash here (``tests._ranks``), and the
values each rank saved (a function of the step).
"""

from __future__ import annotations

import os
import pickle
import random
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader

import aoffload
from aoffload.checkpoint.format import shm
from aoffload.dcp import Stager, StorageReader, StorageWriter
from tests import _dcp_kill
from tests import _dcp_scenarios as scenarios
from tests._leaks import Snapshot
from tests._ranks import complete_tags, forkserver_context, free_port, run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def state(step: int) -> dict[str, Any]:
    return {
        "model": {"w": torch.arange(4096, dtype=torch.float32) + step, "b": torch.ones(3, 5).t()},
        "optim": {"lr": 0.1, "betas": (0.9, 0.99), "step": torch.tensor(step)},
        "step": step,
    }


def blank() -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(4096), "b": torch.zeros(5, 3)},
        "optim": {"lr": 0.0, "betas": (0.0, 0.0), "step": torch.tensor(0)},
        "step": 0,
    }


def same(got: Any, expected: Any) -> bool:
    if isinstance(expected, torch.Tensor):
        return isinstance(got, torch.Tensor) and torch.equal(got, expected)
    if isinstance(expected, dict):
        return got.keys() == expected.keys() and all(same(got[k], v) for k, v in expected.items())
    if isinstance(expected, list):
        return len(got) == len(expected) and all(map(same, got, expected))
    return bool(got == expected)


def load_plain(path: Path, into: dict[str, Any]) -> dict[str, Any]:
    dcp.load(into, storage_reader=FileSystemReader(path), no_dist=True)
    return into


# -- one process ------------------------------------------------------------------------------


def test_saves_in_one_process_are_dcp_checkpoints_and_aoffload_tags(tmp_path: Path) -> None:
    before = Snapshot.take()
    with aoffload.CheckpointEngine(tmp_path, keep_last=2) as engine:
        stager = Stager()
        try:
            for step in (1, 2, 3):
                writer = StorageWriter(tmp_path, tag=f"step-{step}", metadata={"step": step})
                response = dcp.async_save(
                    state(step), storage_writer=writer, async_stager=stager, no_dist=True
                )
                response.staging_completion.result()
                response.upload_completion.result()
            # blocking dcp.save, no stager: the tensors are copied into staging memory first
            dcp.save(state(4), storage_writer=StorageWriter(tmp_path), checkpoint_id="step-4",
                     no_dist=True)  # fmt: skip
        finally:
            stager.close()
        assert engine.tags() == ["step-3", "step-4"]  # keep_last=2 retired the others
        assert engine.latest() == "step-4"
        assert engine.metadata("step-3") == {"step": 3}
    assert complete_tags(tmp_path) == ["step-3", "step-4"]
    for step in (3, 4):
        assert same(load_plain(tmp_path / f"step-{step}", blank()), state(step))
    verified = blank()
    dcp.load(verified, storage_reader=StorageReader(tmp_path), no_dist=True)
    assert same(verified, state(4))
    assert not Snapshot.take().leaked_since(before)


def test_a_tensor_modified_during_staging_fails_naming_its_key(tmp_path: Path) -> None:
    with aoffload.CheckpointEngine(tmp_path) as engine:
        stager = Stager()
        try:
            ahead = {"x": torch.zeros(32 << 20)}  # the stager's thread copies this first
            first = dcp.async_save(ahead, storage_writer=StorageWriter(tmp_path, tag="a"),
                                   async_stager=stager, no_dist=True)  # fmt: skip
            mutated = state(1)
            second = dcp.async_save(mutated, storage_writer=StorageWriter(tmp_path, tag="b"),
                                    async_stager=stager, no_dist=True)  # fmt: skip
            mutated["model"]["w"].add_(1)  # before its copy can have ended
            first.upload_completion.result()
            with pytest.raises(aoffload.CheckpointError, match=r"state\['model'\]\['w'\]"):
                second.staging_completion.result()
            with pytest.raises(aoffload.CheckpointError, match="modified in place"):
                second.upload_completion.result()
        finally:
            stager.close()
        assert engine.tags() == ["a"]
        assert engine.latest() == "a"
    assert not (tmp_path / "b").exists()


def test_the_engine_face_in_a_synchronous_trainer(tmp_path: Path) -> None:
    with aoffload.CheckpointEngine(tmp_path) as engine:
        saved = engine.dcp.save(state(1), checkpoint_id="step-1", metadata={"step": 1})
        assert saved.result().tag == "step-1"
        response = engine.dcp.async_save(state(2), checkpoint_id="step-2")
        response.staging_completion.result()
        assert response.upload_completion.result().tag == "step-2"
        into = blank()
        engine.dcp.load(into).result()  # latest
        assert same(into, state(2))
        engine.dcp.load(into, checkpoint_id="step-1").result()
        assert same(into, state(1))
        assert engine.metadata("step-1") == {"step": 1}
    assert same(load_plain(tmp_path / "step-2", blank()), state(2))


async def test_the_engine_face_in_an_asyncio_trainer(tmp_path: Path) -> None:
    async with aoffload.CheckpointEngine(tmp_path) as engine:
        response = engine.dcp.async_save(state(5), checkpoint_id="step-5")
        await response.staging_completion
        result = await response.upload_completion
        assert result.tag == "step-5"
        into = blank()
        await engine.dcp.load(into)
        assert same(into, state(5))
        with pytest.raises(aoffload.CheckpointError, match="already committed"):
            await engine.dcp.save(state(6), checkpoint_id="step-5")
        assert engine.latest() == "step-5"


def test_a_stager_pickles_as_a_fresh_one_and_stages_after() -> None:
    stager = Stager()
    try:
        staged = stager.stage(state(1)).result()
        assert same(staged, state(1))
        assert staged["model"]["w"].untyped_storage().is_shared()  # DCP's daemon maps it
        copy = pickle.loads(pickle.dumps(stager))
        assert isinstance(copy, Stager)
        assert same(copy.stage(state(2)).result(), state(2))
        copy.close()
    finally:
        stager.close()
    with pytest.raises(aoffload.ClosedError):
        stager.stage(state(3))


def test_no_engine_running_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(CheckpointException) as caught:
        dcp.save(state(1), storage_writer=StorageWriter(tmp_path, tag="t"), no_dist=True)
    [(error, _)] = caught.value.failures.values()
    assert isinstance(error, aoffload.CheckpointError)
    assert "no aoffload CheckpointEngine is running" in str(error)
    assert "distributed=True" in str(error)


# -- ranks ------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["THREAD", "PROCESS"])
def test_saved_on_two_ranks_loads_on_one_and_four(tmp_path: Path, mode: str) -> None:
    run = tmp_path / "run"
    for outcome in run_ranks(2, "tests._dcp_scenarios:save_through_aoffload", run,
                             steps=[1, 2], mode=mode, timeout=240):  # fmt: skip
        seen = outcome.check()
        mutated = seen.pop("mutated", "CheckpointError: state['w'] modified in place")
        assert seen == {"latest": "step-2", "tags": ["step-1", "step-2"], "metadata": {"step": 2}}
        assert mutated.startswith("CheckpointError: "), mutated
        assert "state['w']" in mutated, mutated
        assert "modified in place" in mutated, mutated
    assert complete_tags(run) == ["step-1", "step-2"]
    for step in (1, 2):  # DCP's own reader, one process, every tensor whole
        assert scenarios.check_plain(load_plain(run / f"step-{step}", scenarios.plain())) == step
    verified = scenarios.plain()
    dcp.load(verified, storage_reader=StorageReader(run), no_dist=True)
    assert scenarios.check_plain(verified) == 2
    if mode == "PROCESS":
        return  # the ranks' loads are the same for both modes
    for outcome in run_ranks(4, "tests._dcp_scenarios:load", run, timeout=240):
        seen = outcome.check()
        assert (seen["step"], seen["shard_rows"], seen["shard_equal"]) == (2, 3, True)
        assert seen["bias"] == [2.0, 2.0, 2.0]
        assert seen["different_tags"]["failed"]


@pytest.mark.timeout(240)
def test_the_engine_face_on_two_ranks_fails_every_rank_with_one_ranks_staging(
    tmp_path: Path,
) -> None:
    for outcome in run_ranks(2, "tests._dcp_scenarios:face_on_ranks", tmp_path, timeout=200):
        seen = outcome.check()
        assert seen["first"] == "step-1"
        assert seen["failed"].startswith("CheckpointError: "), seen["failed"]
        assert "state['w']" in seen["failed"], seen["failed"]
        assert seen["latest"] == "step-1"
        assert seen["loaded"]
        assert seen["meta"] == {"step": 1, "name": "run-7"}
    assert complete_tags(tmp_path) == ["step-1"]


@dataclass
class _Rank:
    process: BaseProcess
    committed: Connection


def _start_rank(directory: Path, rank: int, port: int) -> _Rank:
    environ = {
        **os.environ,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    context = forkserver_context()
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_dcp_kill.main, args=(str(directory), environ, send))
    process.start()
    send.close()
    return _Rank(process, receive)


def _wait_for_a_commit(rank: _Rank, seconds: float) -> None:
    """Block until ``rank`` has published its first step."""
    try:
        if rank.committed.poll(seconds):
            rank.committed.recv()
            return
    except EOFError:
        pass
    raise AssertionError("the ranks committed nothing")


def _kill_at_random(seed: int, ranks: list[_Rank]) -> None:
    """Once ``ranks`` committed a save, SIGKILL a random one after a random delay (a
    point of a later save: staging, writing, committing, publishing); the other (stuck in
    DCP's collectives, or in its engine's commit) half a second later."""
    chance = random.Random(seed)
    try:
        _wait_for_a_commit(ranks[0], 120)
        victim = chance.randrange(2)
        time.sleep(chance.uniform(0.0, 0.6))
        ranks[victim].process.kill()
        ranks[victim].process.join()
        time.sleep(0.5)
    finally:
        for rank in ranks:
            rank.process.kill()
            rank.process.join()
            rank.committed.close()


@pytest.mark.timeout(420)
def test_a_rank_killed_at_a_random_point_leaves_latest_loadable(tmp_path: Path) -> None:
    """10 seeds, two at a time: 2 ranks save in a loop until one is SIGKILLed at a random
    point. Every visible tag must be complete, and ``latest`` must load on 2 ranks and on 1."""
    directories = [tmp_path / f"seed-{seed}" for seed in range(10)]
    for first in range(0, len(directories), 2):
        batch = [
            (seed, [_start_rank(directories[seed], rank, port) for rank in (0, 1)])
            for seed in (first, first + 1)
            for port in (free_port(),)
        ]
        for seed, ranks in batch:
            _kill_at_random(seed, ranks)
    shm.remove_dead()  # the staging memory the killed ranks left
    latest_steps = []
    for directory in directories:
        tags = complete_tags(directory)  # every visible tag whole (manifest, xxhash)
        latest = (directory / "latest").read_text().strip()
        assert latest in tags, (directory, latest, tags)
        into = scenarios.plain(big=True)  # another world size: 1, without a process group
        dcp.load(into, storage_reader=StorageReader(directory), no_dist=True)
        step = scenarios.check_plain(into, big=True)
        assert f"step-{step}" == latest
        assert scenarios.check_plain(load_plain(directory / latest, scenarios.plain(big=True)),
                                     big=True) == step  # fmt: skip
        latest_steps.append(step)
    same_world = run_ranks(2, "tests._dcp_scenarios:load_latest", tmp_path / "load",
                           directories=[str(d) for d in directories], timeout=240)  # fmt: skip
    for outcome in same_world:
        assert outcome.check() == latest_steps


@pytest.mark.timeout(200)
def test_a_rank_whose_write_data_cannot_stage_fails_the_save_and_not_the_next(
    tmp_path: Path,
) -> None:
    for outcome in run_ranks(2, "tests._dcp_scenarios:refused_in_write_data", tmp_path):
        seen = outcome.check()
        assert "conjugate" in seen["failed"], seen["failed"]
        assert seen["seconds"] < 15  # not the commit's timeout (20 s here)
        assert seen["latest"] == "step-3"  # the next save committed on every rank
    assert complete_tags(tmp_path) == ["step-1", "step-3"]
