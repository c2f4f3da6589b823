"""The writer's last word for a distributed trainer that died (:class:`~.calls.WatchRank`).

Runs in the writer process once its trainer is gone (its request pipe closed without a
shutdown): nobody reads the writer's log any more, so nothing here logs or raises. What
to say, and where, the trainer chose when it armed the watch: the writer knows nothing
of the ranks' protocol.

The writer runs without torch (its write path needs none, and torch would cost each rank
some 200 MiB): torch.distributed is imported here, only once the trainer has died, which
delays the peers' verdict by that import (0.7 s on an idle core of a 2-core machine).
"""

from __future__ import annotations

import contextlib
import datetime

from .calls import WatchRank

__all__ = ["announce_death"]

_STORE_SECONDS = 5.0


def announce_death(watch: WatchRank) -> None:
    """Set each of ``watch.keys`` to ``watch.value`` (the first verdict wins: a commit
    already decided is left alone); silent if the store is gone."""
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        store = dist.TCPStore(  # type: ignore[attr-defined]
            watch.host,
            watch.port,
            None,
            False,
            timeout=datetime.timedelta(seconds=_STORE_SECONDS),
        )
        for key in watch.keys:
            store.compare_set(key, "", watch.value)
