"""What each rank runs in tests/test_remote_order.py (imported in spawned rank processes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aoffload

from ._rank_scenarios import shard


def publish(
    rank: int, world: int, directory: Path, url: str, journal: str, steps: int
) -> dict[str, Any]:
    """``steps`` tags of two files per rank, each committed while the previous tags' uploads
    may still run, on a directory of this rank's own and one remote tier."""

    async def main() -> dict[str, Any]:
        async with aoffload.CheckpointEngine(
            directory / f"node-{rank}",
            distributed=world > 1,
            remote=url,
            storage_options={"journal": journal},
            keep_last=2,
        ) as engine:
            for step in range(1, steps + 1):
                for part in ("a", "b"):
                    state = shard(rank, step, rows=64)
                    await engine.save(state, f"{part}-{rank}.pt", tag=f"step-{step}")
                await engine.commit(f"step-{step}")  # durable locally; its upload runs on
            await engine.uploaded()
            return {"latest": engine.latest()}

    return aoffload.run(main())
