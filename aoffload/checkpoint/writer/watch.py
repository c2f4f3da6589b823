"""The writer's last word for a distributed trainer that died (:class:`~._calls.WatchRank`).

Runs in the writer process once its trainer is gone (its request pipe closed without a
shutdown): nobody reads the writer's log any more, so nothing here logs or raises.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os

from .calls import WatchRank

__all__ = ["announce_death"]

_STORE_SECONDS = 5.0


def announce_death(watch: WatchRank) -> None:
    """Set the outcome of commits ``n`` and ``n + 1`` to this rank's death (first verdict
    wins: a commit already decided is left alone); silent if the store is gone."""
    import torch.distributed as dist

    from ..ranks.rendezvous import Keys

    message = json.dumps(
        {
            "rank": watch.rank,
            "error": f"its trainer process died (its checkpoint writer, pid {os.getpid()}, "
            "saw it go)",
        }
    )
    with contextlib.suppress(Exception):
        store = dist.TCPStore(  # type: ignore[attr-defined]
            watch.host,
            watch.port,
            None,
            False,
            timeout=datetime.timedelta(seconds=_STORE_SECONDS),
        )
        for n in (watch.n, watch.n + 1):
            store.compare_set(Keys(watch.run, n).outcome, "", message)
