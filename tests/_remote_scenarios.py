"""What each rank runs in tests/test_remote_ranks.py (imported in spawned rank processes)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import aoffload

from ._rank_scenarios import _expect, shard


def spread(rank: int, world: int, directory: Path, url: str, victim: int) -> dict[str, Any]:
    """Each rank on a directory of its own (no shared filesystem), one remote tier."""

    async def main() -> dict[str, Any]:
        node = directory / f"node-{rank}"
        out: dict[str, Any] = {}
        async with aoffload.CheckpointEngine(
            node, distributed=True, remote=url, keep_last=2
        ) as engine:
            for step in (1, 2, 3):
                await engine.save(shard(rank, step), f"shard-{rank}.pt", tag=f"step-{step}")
                metadata = {"step": step, "rank": rank}  # rank 0's is kept (and logged)
                result = await engine.commit(f"step-{step}", metadata=metadata)
                out[f"local-{step}"] = sorted(os.listdir(node / f"step-{step}"))
                uploaded = await engine.uploaded(f"step-{step}")
            out["files"] = sorted(result.files)
            out["uploaded"] = uploaded == result
            out["tags"], out["latest"] = engine.tags(), engine.latest()
            out["node"] = sorted(os.listdir(node))
            await engine.save(shard(rank, 4), f"shard-{rank}.pt", tag="step-4")
            if rank == victim:  # its uploader dies: its upload of step-4 fails
                uploader = engine._core.tier.uploader.core
                assert uploader.pid is not None
                os.kill(uploader.pid, signal.SIGKILL)
            out["committed-4"] = (await engine.commit("step-4")).tag
            out["failed"] = (await _expect(engine.uploaded("step-4")))[:2]
        fresh = directory / f"fresh-{rank}"
        async with aoffload.CheckpointEngine(fresh, distributed=True, remote=url) as engine:
            out["fresh_tags"], out["fresh_latest"] = engine.tags(), engine.latest()
            out["fresh_metadata"] = engine.metadata()
            other = await engine.load(f"shard-{(rank + 1) % world}.pt")
            out["other"] = float(other["w0"][0, 0])
        return out

    return aoffload.run(main())
