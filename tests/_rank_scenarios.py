"""What each rank runs in tests/test_distributed.py (imported in spawned rank processes)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import resource
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import aoffload


def shard(rank: int, step: int, rows: int = 256) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((rows, 1024), float(step * 10 + rank)) for i in range(2)}


async def _expect(awaitable: Any) -> tuple[str, str, float]:
    """(exception type, message, seconds) of what ``awaitable`` raises; ('', '', s) if none."""
    started = time.perf_counter()
    try:
        await awaitable
    except aoffload.AoffloadError as exc:
        return type(exc).__name__, str(exc), time.perf_counter() - started
    return "", "", time.perf_counter() - started


def basics(rank: int, world: int, directory: Path, writers: int | None = None) -> dict[str, Any]:
    """Two tags, a clash, a replica per pair when ``writers`` says so."""

    async def main() -> dict[str, Any]:
        writer = writers is None or rank < writers
        async with aoffload.CheckpointEngine(directory, distributed=True, writer=writer) as engine:
            for step in (1, 2):
                await engine.save(shard(rank, step), f"shard-{rank}.pt", tag=f"step-{step}")
                if step == 2:  # as DeepSpeed's NVMe offload copies its files into the tag
                    offloaded = directory / "step-2" / "offloaded_tensors" / f"rank{rank}"
                    offloaded.mkdir(parents=True)
                    (offloaded / "state.bin").write_bytes(bytes([rank]) * 4096)
                result = await engine.commit(f"step-{step}")
            tags, latest = engine.tags(), engine.latest()
            mine = await engine.load(f"shard-{min(rank, (writers or world) - 1)}.pt")
            await engine.save(shard(rank, 3), "same.pt", tag="clash")
            clash = await _expect(engine.commit("clash"))
            await engine.save(shard(rank, 4), f"shard-{rank}.pt", tag="step-4")
            after = await engine.commit("step-4")
        return {
            "files": sorted(result.files),
            "bytes": result.bytes,
            "tags": tags,
            "latest": latest,
            "loaded": float(mine["w0"][0, 0]),
            "clash": clash[:2],
            "after": after.tag,
            "final_tags": engine.tags(),
        }

    return aoffload.run(main())


def metadata(rank: int, world: int, directory: Path) -> dict[str, Any]:
    """Every rank commits metadata: agreeing, then rank 1's differs (rank 0's is kept)."""
    import logging

    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logger = logging.getLogger("aoffload.checkpoint")  # ranks/ and meet/ both speak
    handler = Collect()
    logger.addHandler(handler)

    async def main() -> dict[str, Any]:
        async with aoffload.CheckpointEngine(directory, distributed=True) as engine:
            await engine.save(shard(rank, 1, rows=8), f"shard-{rank}.pt", tag="same")
            same = await engine.commit("same", metadata={"step": 1, "loss": 0.5})
            await engine.save(shard(rank, 2, rows=8), f"shard-{rank}.pt", tag="differ")
            differ = await engine.commit("differ", metadata={"step": 2, "loss": 0.5 + rank})
            return {
                "same": same.metadata,
                "differ": differ.metadata,
                "read": engine.metadata("differ"),
            }

    try:
        result = aoffload.run(main())
    finally:
        logger.removeHandler(handler)
    return {**result, "warnings": warnings}


def writer_killed(rank: int, world: int, directory: Path, victim: int) -> dict[str, Any]:
    """The victim's writer is SIGKILLed mid-write; every rank recreates its engine."""

    async def main() -> dict[str, Any]:
        async with aoffload.CheckpointEngine(directory, distributed=True) as engine:
            await engine.save(shard(rank, 1), f"shard-{rank}.pt", tag="step-1")
            await engine.commit("step-1")
            big = {"w": torch.ones(4096, 1024)}  # 16 MiB: the kill lands while it is written
            await engine.save(big, f"shard-{rank}.pt", tag="step-2")
            if rank == victim:
                assert engine.pid is not None
                os.kill(engine.pid, signal.SIGKILL)
            failed = await _expect(engine.commit("step-2"))
        dist.barrier()  # every rank has closed: the victim's files of step-2 are gone
        listing = sorted(os.listdir(directory))
        async with aoffload.CheckpointEngine(directory, distributed=True) as engine:
            await engine.save(shard(rank, 3), f"shard-{rank}.pt", tag="step-3")
            result = await engine.commit("step-3")
        return {"failed": failed, "listing": listing, "tags": engine.tags(), "files": result.files}

    return aoffload.run(main())


def disk_full(rank: int, world: int, directory: Path, victim: int) -> dict[str, Any]:
    """The victim's writer may not write files over 1 MiB (RLIMIT_FSIZE): a real EFBIG."""

    async def main() -> dict[str, Any]:
        engine = aoffload.CheckpointEngine(directory, distributed=True)
        limits = resource.getrlimit(resource.RLIMIT_FSIZE)
        if rank == victim:  # the writer inherits the limit; this process gets it back after
            resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, limits[1]))
        try:
            await engine.astart()
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        try:
            await engine.save(shard(rank, 1, rows=8), f"shard-{rank}.pt", tag="step-1")
            await engine.commit("step-1")
            await engine.save(shard(rank, 2), f"shard-{rank}.pt", tag="step-2")  # 2 MiB
            failed = await _expect(engine.commit("step-2"))
            await engine.save(shard(rank, 3, rows=8), f"shard-{rank}.pt", tag="step-3")
            result = await engine.commit("step-3")
            return {"failed": failed, "tags": engine.tags(), "files": list(result.files)}
        finally:
            await engine.aclose()

    return aoffload.run(main())


def blocked_loop(rank: int, world: int, directory: Path) -> dict[str, Any]:
    """Rank 1's loop is blocked in a step longer than commit_timeout; rank 0 commits."""

    async def main() -> dict[str, Any]:
        async with aoffload.CheckpointEngine(
            directory, distributed=True, commit_timeout=BLOCKED_TIMEOUT
        ) as engine:
            await engine.save(shard(rank, 1), f"shard-{rank}.pt", tag="step-1")
            engine.commit_soon("step-1")
            latest_seen = ""
            if rank == 1:
                # A synchronous step that never awaits: the loop does not turn for longer
                # than commit_timeout, yet this rank's commit reports and completes.
                deadline = time.monotonic() + 2 * BLOCKED_TIMEOUT
                while time.monotonic() < deadline and latest_seen != "step-1\n":
                    time.sleep(0.01)  # noqa: ASYNC251 - the blocked step itself
                    with contextlib.suppress(FileNotFoundError):
                        latest_seen = (directory / "latest").read_text()
                time.sleep(BLOCKED_TIMEOUT)  # noqa: ASYNC251 - longer than commit_timeout
            result = await engine.commit("step-1")
        return {"files": sorted(result.files), "latest_seen": latest_seen.strip()}

    return aoffload.run(main())


BLOCKED_TIMEOUT = 4.0


def late_start(rank: int, world: int, directory: Path) -> dict[str, Any]:
    """A dead run's leftovers go once; a second engine that would write where a live one
    writes refuses to start on every rank, and wipes nothing."""

    async def main() -> dict[str, Any]:
        if rank == 0:
            (directory / ".tmp-old-deadbeef").mkdir(parents=True)
            (directory / ".tmp-old-deadbeef" / "x.pt").write_bytes(b"x")
        dist.barrier()
        async with aoffload.CheckpointEngine(directory, distributed=True) as first:
            dead_run_gone = not (directory / ".tmp-old-deadbeef").exists()
            await first.save(shard(rank, 1), f"shard-{rank}.pt", tag="step-1")  # in flight
            if rank == 1:
                await asyncio.sleep(1.0)  # the other rank waits in the collective start
            refused = await _expect(aoffload.CheckpointEngine(directory, distributed=True).astart())
            result = await first.commit("step-1")
        async with aoffload.CheckpointEngine(directory, distributed=True) as second:
            await second.save(shard(rank, 2), f"b-{rank}.pt", tag="step-2")
            other = await second.commit("step-2")
        return {
            "dead_run_gone": dead_run_gone,
            "refused": refused[:2],
            "files": result.files,
            "other": other.files,
        }

    return aoffload.run(main())


def store_gone(rank: int, world: int, directory: Path) -> dict[str, Any]:
    """Rank 1 closes with a tag saved but not committed after rank 0 closed its store."""

    async def main() -> dict[str, Any]:
        engine = aoffload.CheckpointEngine(directory, distributed=True)
        await engine.astart()
        if rank == 1:
            await engine.save(shard(rank, 1, rows=8), f"shard-{rank}.pt", tag="step-1")
        else:
            await engine.aclose()
        dist.barrier()  # rank 0's store is gone
        await engine.aclose()
        return {"tags": engine.tags()}

    return aoffload.run(main())


class _Leaving(Exception):
    """What the victim of :func:`departure` raises out of its engine."""


def departure(
    rank: int, world: int, directory: Path, victim: int, how: str, commit_timeout: float
) -> dict[str, Any]:
    """After one good commit, the victim leaves before the second: SIGKILLed ("killed"),
    an exception out of the engine ("raises"), aclose() with a tag saved but not
    committed ("saved"), or stuck past ``commit_timeout`` in a synchronous step ("hangs")."""

    async def main() -> dict[str, Any]:
        failed: tuple[str, str, float] = ("", "", 0.0)
        with contextlib.suppress(_Leaving):
            async with aoffload.CheckpointEngine(
                directory, distributed=True, commit_timeout=commit_timeout
            ) as engine:
                await engine.save(shard(rank, 1, rows=8), f"shard-{rank}.pt", tag="step-1")
                dist.barrier()  # a slow start-up must not count against commit_timeout
                await engine.commit("step-1")
                if not (rank == victim and how == "raises"):
                    await engine.save(shard(rank, 2, rows=8), f"shard-{rank}.pt", tag="step-2")
                dist.barrier()
                if rank == victim:
                    if how == "killed":
                        os.kill(os.getpid(), signal.SIGKILL)
                    if how == "raises":
                        raise _Leaving("the victim's training step failed")
                    if how == "hangs":
                        time.sleep(commit_timeout + 3.0)  # noqa: ASYNC251 - a stuck step
                        failed = await _expect(engine.commit("step-2"))
                    return {"failed": failed, "close_seconds": 0.0}
                failed = await _expect(engine.commit("step-2"))
                closing = time.perf_counter()
            return {"failed": failed, "close_seconds": time.perf_counter() - closing}
        return {"failed": failed, "close_seconds": 0.0}

    return aoffload.run(main())


def random_kills(rank: int, world: int, directory: Path, rounds: int) -> dict[str, Any]:
    """``rounds`` times: commit in a loop while every rank SIGKILLs its writer at random."""

    async def one(seed: int) -> str:
        delay = random.Random(seed * 100 + rank).uniform(0.0, 0.3)
        async with aoffload.CheckpointEngine(directory, distributed=True, keep_last=2) as engine:
            pid = engine.pid

            async def train() -> None:
                for step in range(seed * 100, seed * 100 + 40):
                    await engine.save(shard(rank, step, rows=64), f"s-{rank}.pt", tag=f"t-{step}")
                    await engine.commit(f"t-{step}")

            training = asyncio.create_task(train())
            await asyncio.sleep(delay)
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            kind, _, _ = await _expect(training)
            return kind

    async def main() -> list[str]:
        return [await one(seed) for seed in range(1, rounds + 1)]

    return {"kinds": aoffload.run(main())}


def session(rank: int, world: int, directory: Path, scenarios: list[Any]) -> dict[str, Any]:
    """Several scenarios, one after the other, in one start-up of the ranks.

    ``scenarios`` holds ``[name, kwargs]`` pairs; each runs in ``directory/name``. A
    scenario that raises is reported as its traceback, and the next one still runs.
    """
    import traceback

    results: dict[str, Any] = {}
    for name, kwargs in scenarios:
        started = time.perf_counter()
        try:
            results[name] = globals()[name](rank, world, directory / name, **kwargs)
        except BaseException:  # noqa: BLE001 - reported to the test, which fails on it
            results[name] = {"error": traceback.format_exc()}
        results[name]["seconds"] = time.perf_counter() - started
        dist.barrier()
    return results
