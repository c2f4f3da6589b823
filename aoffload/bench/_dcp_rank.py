"""One rank of the ``dcp`` section: every system's block of saves, timed, in a spawned process.

The rank writes what it measured to ``root/rank<N>.json``: each save's system, step and
times, the ``time.monotonic()`` window of each save (the bench process finds the peak PSS
inside it) and of an idle moment before any system ran (the rank alone), and the systems
that could not run here. Every rank decides together whether a system runs (an
``all_reduce`` after its warm-up save), so a system that fails on one rank is skipped on
all of them instead of leaving the others waiting in a collective.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ._pss import paused

__all__ = ["main"]

logger = logging.getLogger(__name__)

IDLE_SECONDS = 0.2
TENSOR_BYTES = 64 << 20  # each rank's state: tensors of this size at most


def _peers(state: Any, root: Path, rank: int) -> list[tuple[str, Callable[[], Any] | None]]:
    """Every system, in the order they run: (a name for errors, a factory; None for
    torch_checkpointing, whose writes are chosen by :func:`_torch_checkpointing`)."""
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    cap = max(1 << 20, nbytes // 4 >> 20 << 20)  # a quarter of the state, in whole MiB
    from ._dcp_peers import (
        AOFFLOAD_DCP_CAPPED,
        AOFFLOAD_DCP_FACE,
        AOFFLOAD_ENGINE,
        TORCH_CHECKPOINTING,
        AoffloadDcp,
        AoffloadDcpFace,
        AoffloadEngine,
        DcpAsync,
        DcpBlocking,
        aoffload_dcp_name,
    )

    thread = [
        (f"DCP async_save THREAD ({shared})", lambda s=shared: DcpAsync(state, False, s))
        for shared in (None, False, True)
    ]
    process = [
        (f"DCP async_save PROCESS ({shared})", lambda s=shared: DcpAsync(state, True, s))
        for shared in (None, False, True)
    ]
    return [
        ("DCP save", lambda: DcpBlocking(state)),
        *thread,
        (AOFFLOAD_ENGINE, lambda: AoffloadEngine(state, root / "aoffload", rank)),
        (aoffload_dcp_name(False), lambda: AoffloadDcp(state, root / "aoffload-dcp", False)),
        (AOFFLOAD_DCP_FACE, lambda: AoffloadDcpFace(state, root / "aoffload-dcp-face")),
        (AOFFLOAD_DCP_CAPPED, lambda: AoffloadDcpFace(state, root / "aoffload-dcp-cap", cap)),
        (TORCH_CHECKPOINTING, None),
        *process,
        # after DCP's PROCESS blocks: DCP's daemon, once started, outlives its block
        (aoffload_dcp_name(True), lambda: AoffloadDcp(state, root / "aoffload-dcp-p", True)),
    ]


def _agree(failed: bool) -> bool:
    """Whether any rank failed (a MAX all_reduce of the flag)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if failed else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _timed(peer: Any, path: Path, step: float) -> dict[str, Any]:
    start = time.monotonic()
    save = peer.save(path)
    called = time.monotonic()
    time.sleep(step)  # the step: blocks the trainer's thread, as waiting for a device does
    stepped = time.monotonic()
    save.fence()
    fenced = time.monotonic()
    save.durable()
    end = time.monotonic()
    call = called - start
    return {
        "step": step,
        "call": call,
        "stall": call + fenced - stepped,
        "durable": end - start,
        "start": start,
        "end": end,
    }


def _open(factory: Callable[[], Any], path: Path) -> tuple[Any, str | None]:
    """Build a peer and make its warm-up save (to durable); the error, if any rank's failed."""
    import torch.distributed as dist

    peer, error = None, None
    try:
        peer = factory()
        save = peer.save(path)
        save.fence()
        save.durable()
    except Exception as exc:  # reported as the peer's skip (or failure, for aoffload)
        logger.warning("%s", exc, exc_info=True)
        error = f"{type(exc).__name__}: {exc}"[:500]
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    error = next((e for e in errors if e is not None), None)
    if error is not None and peer is not None:
        with contextlib.suppress(Exception):
            peer.close()
        peer = None
    return peer, error


def _torch_checkpointing(state: Any, path: Path) -> tuple[Any, str | None]:
    """torch_checkpointing with its default O_DIRECT writes, or buffered where they fail."""
    from ._dcp_peers import TorchCheckpointing

    peer, error = _open(lambda: TorchCheckpointing(state, direct_io=True), path / "direct")
    if peer is None:
        logger.warning("torch_checkpointing with O_DIRECT failed here (%s): buffered", error)
        peer, error = _open(lambda: TorchCheckpointing(state, direct_io=False), path / "buffered")
    return peer, error


SAMPLED = 3
"""Saves per system whose peak memory is sampled (after its timed ones)."""


def _raw_writes(base: Path, rank: int, state: dict[str, Any], reps: int) -> list[float]:
    """The disk's floor: the rank's bytes written raw with O_DIRECT and fsynced, every rank
    at once (as their checkpoints are), ``reps`` times."""
    import torch.distributed as dist

    from ._checkpoint import disk_seconds

    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    folder = base / f"raw-{rank}"
    folder.mkdir(exist_ok=True)
    seconds = []
    for _ in range(reps):
        dist.barrier()
        seconds.append(disk_seconds(folder, nbytes))
    return seconds


def _clean(path: Path, rank: int) -> None:
    import torch.distributed as dist

    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


@contextlib.contextmanager
def _unsampled(rank: int, quiet: Any, resting: Any) -> Iterator[None]:
    """Every rank at once: the section's PSS sampling pauses for the block (rank 0 pauses
    it, :func:`._pss.paused`; the others wait for that at a barrier)."""
    import torch.distributed as dist

    dist.barrier()
    with paused(quiet, resting) if rank == 0 else contextlib.nullcontext():
        dist.barrier()
        yield
        dist.barrier()


def main(
    rank: int,
    world: int,
    port: int,
    root: str,
    nbytes: int,
    steps: tuple[float, ...],
    reps: int,
    quiet: Any,
    resting: Any,
) -> None:
    """The rank's whole run (the target of a spawned process). Times come from saves made
    while the section's PSS sampling is paused (``quiet``, ``resting``: a sample of a
    process with GiBs resident costs it most of a core), peak memory from saves made while
    it runs."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(name)s: %(message)s")
    import torch
    import torch.distributed as dist

    from ._dcp_peers import AOFFLOAD_ENGINE

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    size = min(TENSOR_BYTES, max(1, nbytes // 4))
    generator = torch.Generator().manual_seed(rank)
    state = {
        f"rank{rank}.layer{i}": torch.rand(size // 4, generator=generator)
        for i in range(max(1, nbytes // size))
    }
    base = Path(root)
    record: dict[str, Any] = {
        "pid": os.getpid(),
        "runs": [],
        "sampled": [],
        "skipped": {},
        "failed": {},
        "notes": {},
    }
    dist.barrier()
    idle = time.monotonic()
    time.sleep(IDLE_SECONDS)
    record["idle"] = [idle, time.monotonic()]
    for index, (label, factory) in enumerate(_peers(state, base, rank)):
        path = base / f"p{index}"
        if factory is None:
            peer, error = _torch_checkpointing(state, path / "warm-up")
        else:
            peer, error = _open(factory, path / "warm-up")
        _clean(path, rank)
        if peer is None:
            where = "failed" if label.startswith(("aoffload", AOFFLOAD_ENGINE)) else "skipped"
            record[where][label] = error
            continue
        record["notes"][peer.name] = peer.note
        try:
            with _unsampled(rank, quiet, resting):
                for rep in range(reps):
                    for number, step in enumerate(steps):
                        dist.barrier()
                        run = _timed(peer, path / f"r{rep}-s{number}", step)
                        record["runs"].append({"system": peer.name, **run})
                        _clean(path, rank)
            for rep in range(min(reps, SAMPLED) if quiet is not None else 0):
                dist.barrier()
                run = _timed(peer, path / f"m{rep}", steps[0])
                record["sampled"].append({"system": peer.name, **run})
                _clean(path, rank)
        finally:
            peer.close()
    with _unsampled(rank, quiet, resting):
        record["raw"] = _raw_writes(base, rank, state, reps)
    if quiet is None:  # --smoke: one set of saves, sampled and timed at once
        record["sampled"] = record["runs"]
    dist.barrier()
    (base / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()
