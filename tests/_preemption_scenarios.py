"""What each rank runs in tests/test_preemption_ranks.py (imported in spawned rank processes).

Steps block the loop (``time.sleep`` on its thread) and make no collective, so the ranks'
paces differ as much as a scenario wants.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import aoffload

_LIMIT = 20_000  # steps: a scenario that never agrees fails instead of hanging


def _state(rank: int, step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((1024,), float(step * 10 + rank))}


async def _save(engine: aoffload.CheckpointEngine, rank: int, step: int) -> str:
    await engine.save(_state(rank, step), f"shard-{rank}.pt", tag=f"step-{step}")
    return (await engine.commit(f"step-{step}")).tag


def uneven_pace(rank: int, world: int, directory: Path) -> dict[str, Any]:
    """Rank 0 races ahead; the last rank gives notice at its step 5: every rank must still
    reach the agreed step, so the slow ranks catch up to the fast one."""

    async def main() -> dict[str, Any]:
        async with aoffload.CheckpointEngine(directory, distributed=True) as engine:
            notice = engine.preemption(signals=())
            dist.barrier()
            last_false = None
            for step in range(_LIMIT):
                time.sleep(0.001 if rank == 0 else 0.02)  # noqa: ASYNC251 - a blocking step
                if await notice.reached(step):
                    break
                last_false = step
                if rank == world - 1 and step == 5:
                    notice.request()  # its next reached() waits for the agreement
            tag = await _save(engine, rank, step)
        return {"step": step, "agreed": notice.step, "last_false": last_false, "tag": tag}

    return aoffload.run(main())


def blocked_peer(rank: int, world: int, directory: Path) -> dict[str, Any]:
    """Rank 0 is signalled (SIGUSR1) while rank 1's loop is blocked in a step that only ends
    once rank 0 has its answer: the agreement must not need rank 1's loop."""
    flag = directory / "rank0-answered"

    async def main() -> dict[str, Any]:
        async with aoffload.CheckpointEngine(directory, distributed=True) as engine:
            notice = engine.preemption(signals=(signal.SIGUSR1,))
            dist.barrier()
            for step in range(3):
                assert await notice.reached(step) is False
            if rank == 0:
                time.sleep(0.3)  # noqa: ASYNC251 - rank 1 is in its blocked step by now
                os.kill(os.getpid(), signal.SIGUSR1)
                step = 3
                while not await notice.reached(step):
                    step += 1
                flag.write_text(str(step))
            else:
                deadline = time.monotonic() + 60
                while not flag.exists() and time.monotonic() < deadline:
                    time.sleep(0.01)  # noqa: ASYNC251 - the blocked step itself
                blocked_until = flag.read_text() if flag.exists() else "never"
                step = 3
                while not await notice.reached(step):
                    step += 1
            tag = await _save(engine, rank, step)
            result = {"step": step, "agreed": notice.step, "tag": tag}
            result["requested"] = notice.requested
            if rank != 0:
                result["blocked_until"] = blocked_until
            return result

    return aoffload.run(main())


def everyone_signalled(rank: int, world: int, directory: Path) -> dict[str, Any]:
    """Every rank gets the signal at once (SIGTERM to a whole job): one agreement."""

    async def main() -> dict[str, Any]:
        async with aoffload.CheckpointEngine(directory, distributed=True) as engine:
            notice = engine.preemption(signals=(signal.SIGUSR2,))
            dist.barrier()
            for step in range(_LIMIT):
                time.sleep(0.005)  # noqa: ASYNC251 - a blocking step
                if step == 10:
                    os.kill(os.getpid(), signal.SIGUSR2)
                if await notice.reached(step):
                    break
            tag = await _save(engine, rank, step)
        return {"step": step, "agreed": notice.step, "tag": tag, "requested": notice.requested}

    return aoffload.run(main())


def silent_rank(rank: int, world: int, directory: Path) -> dict[str, Any]:
    """The last rank never calls preemption(): the others' reached() names it, in time."""

    async def main() -> dict[str, Any]:
        engine = aoffload.CheckpointEngine(directory, distributed=True, commit_timeout=2.0)
        async with engine:
            result: dict[str, Any] = {}
            if rank != world - 1:
                notice = engine.preemption(signals=())
                notice.request()
                started = time.perf_counter()
                try:
                    await notice.reached(0)
                except aoffload.CheckpointError as exc:
                    result["error"] = str(exc)
                result["seconds"] = time.perf_counter() - started
            dist.barrier()
        return result

    return aoffload.run(main())


def closed_rank(rank: int, world: int, directory: Path) -> dict[str, Any]:
    """The last rank closed its engine before rank 0 gets notice: named at once."""

    async def main() -> dict[str, Any]:
        result: dict[str, Any] = {}
        async with aoffload.CheckpointEngine(directory, distributed=True) as engine:
            notice = engine.preemption(signals=())
            if rank == world - 1:
                await engine.aclose()
            dist.barrier()
            if rank == 0:
                notice.request()
                started = time.perf_counter()
                try:
                    await notice.reached(0)
                except aoffload.CheckpointError as exc:
                    result["error"] = str(exc)
                result["seconds"] = time.perf_counter() - started
            dist.barrier()
        return result

    return aoffload.run(main())


def session(rank: int, world: int, directory: Path, scenarios: list[str]) -> dict[str, Any]:
    """Each of ``scenarios`` in turn, each in ``directory/name``; a failure is its traceback."""
    results: dict[str, Any] = {}
    for name in scenarios:
        try:
            results[name] = globals()[name](rank, world, directory / name)
        except BaseException:  # noqa: BLE001 - reported to the test, which fails on it
            results[name] = {"traceback": traceback.format_exc()}
        dist.barrier()
    return results
