"""Rank functions for the DCP tests (run by ``tests._ranks.run_ranks`` on gloo ranks).

The state is a DTensor sharded by rows over the ranks (as FSDP2 shards a parameter), a
tensor every rank holds whole, and a plain value: saved on one world size and loaded on
another, every value must be what was saved. Each function returns what its rank saw.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def settled(function: F) -> F:
    """Every rank meets at a gloo barrier after ``function`` returns, before the harness
    destroys the group: fresh clones lost a rank here to "terminate called without an
    active exception" (exit -6), a peer's last message of DCP's collectives (its save, or a
    load that fails on purpose) still in flight when the group was torn down. None of these
    scenarios kills a rank, so the barrier cannot wait on a dead peer."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        import torch.distributed as dist

        value = function(*args, **kwargs)
        dist.barrier()
        return value

    return wrapper  # type: ignore[return-value]


ROWS, COLUMNS = 12, 5


def whole(step: int) -> torch.Tensor:
    """The sharded tensor's global value at ``step``: every element distinct."""
    return torch.arange(ROWS * COLUMNS, dtype=torch.float32).reshape(ROWS, COLUMNS) + 1000 * step


BIG = 1 << 20
"""Elements of ``big``: a 4 MiB vector sharded over the ranks (the kill test's writes)."""


def _state(world: int, value: torch.Tensor, step: int, big: bool = False) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {
        "w": distribute_tensor(value, mesh, [Shard(0)]),
        "bias": torch.full((3,), float(step)),
        "meta": {"step": step, "name": "run-7"},
    }
    if big:
        state["big"] = distribute_tensor(torch.full((BIG,), float(step)), mesh, [Shard(0)])
    return state


def plain(step: int = -1, big: bool = False) -> dict[str, Any]:
    """The state as one process holds it (every tensor whole), zeroed: what a load of a
    sharded save on one rank, without a process group, fills in."""
    state: dict[str, Any] = {
        "w": torch.zeros(ROWS, COLUMNS),
        "bias": torch.zeros(3),
        "meta": {"step": step, "name": ""},
    }
    if big:
        state["big"] = torch.zeros(BIG)
    return state


def check_plain(state: dict[str, Any], big: bool = False) -> int:
    """The step ``state`` (see :func:`plain`) holds; AssertionError unless every value is
    what that step saved."""
    step = state["meta"]["step"]
    assert state["meta"] == {"step": step, "name": "run-7"}, state["meta"]
    assert torch.equal(state["w"], whole(step)), step
    assert torch.equal(state["bias"], torch.full((3,), float(step))), step
    if big:
        assert torch.equal(state["big"], torch.full((BIG,), float(step))), step
    return int(step)


@settled
def save(rank: int, world: int, directory: Path, steps: list[int]) -> None:
    """Save the state of each step with plain DCP into ``directory / f"step-{step}"``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    for step in steps:
        writer = FileSystemWriter(directory / f"step-{step}")
        dcp.save(_state(world, whole(step), step), storage_writer=writer)


@settled
def load(rank: int, world: int, directory: Path) -> dict[str, Any]:
    """Load the latest into a zeroed state sharded over this world (what each rank got,
    against the slice of :func:`whole` its shard should hold); then :func:`different_tags`."""
    import torch.distributed.checkpoint as dcp

    from aoffload.dcp import StorageReader

    state = _state(world, torch.zeros(ROWS, COLUMNS), -1)
    dcp.load(state, storage_reader=StorageReader(directory))
    local = state["w"].to_local()
    step = state["meta"]["step"]
    rows = ROWS // world
    expected = whole(step)[rank * rows : (rank + 1) * rows]
    return {
        "step": step,
        "meta": state["meta"],
        "shard_equal": bool(torch.equal(local, expected)),
        "shard_rows": local.shape[0],
        "bias": state["bias"].tolist(),
        "different_tags": different_tags(world, directory),
    }


def different_tags(world: int, directory: Path) -> dict[str, Any]:
    """Every rank names another tag (as if 'latest' moved between their reads): the load
    must fail on every rank, with nothing read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from aoffload.dcp import StorageReader

    state = _state(world, torch.zeros(ROWS, COLUMNS), -1)
    try:
        tag = f"step-{1 + torch.distributed.get_rank() % 2}"
        dcp.load(state, storage_reader=StorageReader(directory, tag))
    except CheckpointException as exc:
        errors = [f"{type(e).__name__}: {e}" for e, _ in exc.failures.values()]
        return {"failed": True, "errors": errors, "untouched": state["meta"]["step"] == -1}
    return {"failed": False}


@settled
def save_through_aoffload(
    rank: int, world: int, directory: Path, steps: list[int], mode: str = "THREAD"
) -> dict[str, Any]:
    """Save each step through aoffload's route (Stager + StorageWriter, DCP's ``mode``)
    into an engine on ``directory``; what the engine then holds."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    import aoffload
    from aoffload.dcp import Stager, StorageWriter

    with aoffload.CheckpointEngine(directory, distributed=True, keep_last=2) as engine:
        stager = Stager()
        try:
            for step in steps:
                writer = StorageWriter(directory, tag=f"step-{step}", metadata={"step": step})
                response = dcp.async_save(
                    _state(world, whole(step), step),
                    storage_writer=writer,
                    async_stager=stager,
                    async_checkpointer_type=getattr(AsyncCheckpointerType, mode),
                )
                response.staging_completion.result()
                response.upload_completion.result()
                engine.commit(f"step-{step}").result()  # this rank's part has ended too
            mutated = _mutated(stager, world) if mode == "THREAD" else ""
        finally:
            stager.close()
        seen = {"latest": engine.latest(), "tags": engine.tags(), "metadata": engine.metadata()}
        return {**seen, "mutated": mutated} if mode == "THREAD" else seen


def _mutated(stager: Any, world: int) -> str:
    """Stage a sharded state behind a large one (the stager copies in order) and modify its
    DTensor in place at once, as an optimizer step would: what the staging raised."""
    ahead = stager.stage({"x": torch.zeros(16 << 20)})
    state = _state(world, whole(7), 7)
    staged = stager.stage(state)
    with torch.no_grad():
        state["w"].mul_(2)  # the DTensor's own version counter moves, not its shard's
    ahead.result()
    try:
        staged.result()
    except Exception as exc:  # noqa: BLE001 - what the test checks
        return f"{type(exc).__name__}: {exc}"
    return "nothing was raised"


@settled
def load_latest(rank: int, world: int, directory: Path, directories: list[str]) -> list[int]:
    """Load the latest of each of ``directories`` (saved with ``big``) into a state sharded
    over this world; the step each held (AssertionError for any value not saved)."""
    import torch.distributed.checkpoint as dcp

    from aoffload.dcp import StorageReader

    steps = []
    for each in directories:
        state = _state(world, torch.zeros(ROWS, COLUMNS), -1, big=True)
        dcp.load(state, storage_reader=StorageReader(each))
        step = state["meta"]["step"]
        rows = ROWS // world
        assert torch.equal(state["w"].to_local(), whole(step)[rank * rows : (rank + 1) * rows])
        assert torch.equal(state["bias"], torch.full((3,), float(step)))
        assert bool((state["big"].to_local() == step).all()), (each, step)
        steps.append(step)
    return steps


@settled
def face_on_ranks(rank: int, world: int, directory: Path) -> dict[str, Any]:
    """engine.dcp on a distributed engine: a save, then one whose staging fails on the last
    rank only (a tensor modified in place while a large one is copied): every rank's save
    must fail, naming it, and ``latest`` stay; then a load of ``latest``, resharded."""
    import aoffload

    with aoffload.CheckpointEngine(directory, distributed=True) as engine:
        first = engine.dcp.save(_state(world, whole(1), 1), checkpoint_id="step-1").result()
        state = _state(world, whole(2), 2)
        state["ahead"] = torch.zeros(8 << 20)  # its copy outlasts the modification below
        response = engine.dcp.async_save(state, checkpoint_id="step-2")
        if rank == world - 1:
            with torch.no_grad():
                state["w"].mul_(2)  # before the copy ended: this rank's staging fails
        try:
            response.upload_completion.result()
            failed = "nothing was raised"
        except Exception as exc:  # noqa: BLE001 - what the test checks
            failed = f"{type(exc).__name__}: {exc}"
        loaded = _state(world, torch.zeros(ROWS, COLUMNS), -1)
        engine.dcp.load(loaded).result()
        rows = ROWS // world
        shard = whole(1)[rank * rows : (rank + 1) * rows]
        return {
            "first": first.tag,
            "failed": failed,
            "latest": engine.latest(),
            "loaded": bool(torch.equal(loaded["w"].to_local(), shard)),
            "meta": loaded["meta"],
        }


CAPPED_LAYERS, CAPPED_ELEMENTS = 16, 256 * 1024
"""The capped scenarios' extra state: 16 vectors of 1 MiB sharded over the ranks (4 MiB
per rank on 2 ranks, through an engine's staging cap of 1 MiB)."""


def _capped_state(world: int, step: int, zero: bool = False) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = _state(world, torch.zeros(ROWS, COLUMNS) if zero else whole(step), -1 if zero else step)
    for i in range(CAPPED_LAYERS):
        value = torch.zeros(CAPPED_ELEMENTS) if zero else torch.arange(CAPPED_ELEMENTS) + 7.0 * i
        state[f"layer{i}"] = distribute_tensor(value.float() + (0 if zero else step), mesh,
                                               [Shard(0)])  # fmt: skip
    return state


@settled
def capped_save(rank: int, world: int, directory: Path) -> list[int]:
    """engine.dcp through a 1 MiB staging cap: two saves of a state 4x the cap per rank;
    the number of data files each rank wrote to ``step-2``."""
    import aoffload

    with aoffload.CheckpointEngine(directory, distributed=True, staging_bytes=1 << 20) as engine:
        for step in (1, 2):
            response = engine.dcp.async_save(
                _capped_state(world, step), checkpoint_id=f"step-{step}"
            )
            response.staging_completion.result()
            response.upload_completion.result()
    return sorted(
        int(p.name.split("_")[3].split(".")[0])
        for p in (directory / "step-2").glob(f"__{rank}_*.distcp")
    )


@settled
def capped_load(rank: int, world: int, directory: Path) -> bool:
    """Load ``latest`` of :func:`capped_save`'s directory on this world, verified: whether
    every shard is what was saved."""
    import torch.distributed.checkpoint as dcp

    from aoffload.dcp import StorageReader

    state = _capped_state(world, 0, zero=True)
    dcp.load(state, storage_reader=StorageReader(directory))
    expected = _capped_state(world, 2)
    assert state["meta"] == {"step": 2, "name": "run-7"}, state["meta"]
    for key, value in expected.items():
        if key != "meta":
            got = state[key]
            local = got.to_local() if hasattr(got, "to_local") else got
            want = value.to_local() if hasattr(value, "to_local") else value
            assert torch.equal(local, want), key
    return True


@settled
def capped_refused(rank: int, world: int, directory: Path) -> dict[str, Any]:
    """engine.dcp through a 1 MiB cap where the last rank holds an item larger than the
    cap: every rank's save must fail at once, naming it, and ``latest`` stay; the next
    save must commit on every rank (each rank took part in the failed one's commit, so
    the ranks still number their commits alike)."""
    import time

    import aoffload

    engine = aoffload.CheckpointEngine(
        directory, distributed=True, staging_bytes=1 << 20, commit_timeout=20
    )
    with engine:
        engine.dcp.save(_capped_state(world, 1), checkpoint_id="step-1").result()
        state = _capped_state(world, 2)
        state[f"extra{rank}"] = torch.zeros((4 if rank == world - 1 else 1) << 18)
        started = time.monotonic()
        try:
            engine.dcp.save(state, checkpoint_id="step-2").result()
            failed = "nothing was raised"
        except Exception as exc:  # noqa: BLE001 - what the test checks
            failed = f"{type(exc).__name__}: {exc}"
        seconds = time.monotonic() - started
        latest = engine.latest()
        after = engine.dcp.save(_capped_state(world, 3), checkpoint_id="step-3").result().tag
    return {"failed": failed, "seconds": seconds, "latest": latest, "after": after}


@settled
def refused_in_write_data(rank: int, world: int, directory: Path) -> dict[str, Any]:
    """Plain ``dcp.save`` through ``StorageWriter`` (no stager: ``write_data`` copies), where
    the last rank holds a tensor that cannot be staged: every rank's save fails, and the
    next one commits on every rank (the refusing rank took part in the failed commit)."""
    import time

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import aoffload
    from aoffload.dcp import StorageWriter

    with aoffload.CheckpointEngine(directory, distributed=True, commit_timeout=20) as engine:
        dcp.save(_state(world, whole(1), 1), storage_writer=StorageWriter(directory, tag="step-1"))
        state = _state(world, whole(2), 2)
        if rank == world - 1:
            state["odd"] = torch.ones(4, dtype=torch.complex64).conj()  # a conjugate bit
        started = time.monotonic()
        try:
            dcp.save(state, storage_writer=StorageWriter(directory, tag="step-2"))
            failed = "nothing was raised"
        except CheckpointException as exc:
            failed = str(exc)
        seconds = time.monotonic() - started
        dcp.save(_state(world, whole(3), 3), storage_writer=StorageWriter(directory, tag="step-3"))
        return {"failed": failed, "seconds": seconds, "latest": engine.latest()}
