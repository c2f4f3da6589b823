"""Where the ranks of a distributed engine meet: its gloo group, the commit store, two threads.

:class:`Rendezvous` is this rank's link to the others; :mod:`._distributed` runs the commit
protocol over it. Coordination uses torch.distributed alone, and never runs on the event
loop: every blocking call goes to one of two threads of this module, each with its own
connection to the store (a ``TCPStore`` client serialises its calls, so a blocked wait
would hold up everything else on its connection). The *control* thread makes the quick
calls (:meth:`Rendezvous.control`); the *waiter* thread blocks on a key until a peer sets
it (:meth:`Rendezvous.wait_for`).

:meth:`Rendezvous.join` is the collective start. Every rank creates the engine's own gloo
group (``new_group(backend="gloo")``, whatever backend the trainer uses). Rank 0 takes the
directory lock (:mod:`._lock`) and scans the directory, removing leftovers of dead runs
only when no other live engine holds the lock, then starts a ``TCPStore`` on a free port.
One ``broadcast_object_list`` on the gloo group hands every rank the store's address, a
run id and the scan, so every rank starts with the same catalog. The other ranks connect,
then hold the lock shared: they never clean.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import os
import socket
import uuid
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

from .._errors import CheckpointError
from .._runtime.threads import DaemonThreadExecutor
from . import _lock, _store
from ._keys import Keys

__all__ = ["Rendezvous"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_TCPStore: Any = dist.TCPStore  # type: ignore[attr-defined]  # public, not re-exported


class Rendezvous:
    """This rank's link to the other ranks: the gloo group, the commit store and its threads.

    The methods that talk to the store block: run them on the control thread
    (``await rendezvous.control(rendezvous.claim, key, value)``).
    """

    def __init__(self, directory: Path, *, writer: bool, timeout: float) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise CheckpointError(
                "CheckpointEngine(distributed=True) needs torch.distributed: call "
                "torch.distributed.init_process_group(...) on every rank before creating it"
            )
        if not timeout > 0:
            raise ValueError(f"commit_timeout must be > 0 seconds, not {timeout!r}")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.timeout = timeout
        self.run = ""
        """The run id rank 0 chose: every store key of this engine's commits starts with it."""
        self._directory = directory
        self._writer = writer
        self._control: DaemonThreadExecutor | None = None
        self._waiter: DaemonThreadExecutor | None = None
        self._store: Any = None  # this rank's connection for quick calls (rank 0: the server)
        self._waiting: Any = None  # the connection its waiter thread blocks on
        self._group: Any = None
        self._lock: _lock.DirectoryLock | None = None

    # -- threads ------------------------------------------------------------------------

    @staticmethod
    async def _on(executor: Executor | None, fn: Callable[..., _T], *args: Any) -> _T:
        if executor is None:
            raise CheckpointError("the distributed engine was never started")
        return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)

    async def control(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run ``fn(*args)`` (quick calls on the store) on the control thread."""
        return await self._on(self._control, fn, *args)

    async def wait_for(self, key: str) -> str:
        """Wait (on the waiter thread) until ``key`` is set; its value.

        Raises ``torch.distributed.DistStoreError`` after ``commit_timeout`` seconds,
        ``DistError`` when the store is gone.
        """
        return await self._on(self._waiter, self._get, key, self.timeout)

    def _get(self, key: str, timeout: float) -> str:
        self._waiting.set_timeout(datetime.timedelta(seconds=max(timeout, 0.001)))
        return bytes(self._waiting.get(key)).decode()

    # -- join ---------------------------------------------------------------------------

    async def join(self) -> _store.Scan:
        """Join the other ranks (a collective); return rank 0's scan of the directory."""
        self._control = DaemonThreadExecutor("aoffload-ranks-control")
        self._waiter = DaemonThreadExecutor("aoffload-ranks-waiter")
        return await self.control(self._join)

    def _connect(self, host: str, port: int) -> Any:
        timeout = datetime.timedelta(seconds=self.timeout)
        return _TCPStore(host, port, None, False, timeout=timeout)

    def _join(self) -> _store.Scan:
        self._group = dist.new_group(backend="gloo")
        link: list[Any] = [None, None]
        if self.rank == 0:
            # Rank 0 publishes, even as a replica. It cleans only when it is alone.
            self._directory.mkdir(parents=True, exist_ok=True)
            self._lock, scan = _lock.hold_shared(
                self._directory, lambda sole: _store.scan(self._directory, clean=sole)
            )
            host = os.environ.get("MASTER_ADDR") or socket.gethostname()
            timeout = datetime.timedelta(seconds=self.timeout)
            self._store = _TCPStore(host, 0, None, True, timeout=timeout, wait_for_workers=False)
            link = [(host, int(self._store.port), uuid.uuid4().hex[:12]), scan]
        dist.broadcast_object_list(link, src=0, group=self._group)
        (host, port, self.run), scan = link
        if self.rank != 0:
            self._store = self._connect(host, port)
            if self._writer:
                self._lock, _ = _lock.hold_shared(self._directory, lambda sole: None)
        self._waiting = self._connect(host, port)
        logger.debug(
            "rank %d joined checkpoint run %s (store %s:%d)", self.rank, self.run, host, port
        )
        if not isinstance(scan, _store.Scan):
            raise CheckpointError(f"rank 0 sent {type(scan).__name__} instead of its scan")
        return scan

    # -- the store (blocking: on the control thread) ------------------------------------

    def claim(self, key: str, value: str) -> str:
        """Set ``key`` to ``value`` unless someone else set it first; what it holds now."""
        return bytes(self._store.compare_set(key, "", value)).decode()

    def set(self, key: str, value: str) -> None:
        """Set ``key`` to ``value``."""
        self._store.set(key, value)

    def report(self, keys: Keys, report: str) -> bool:
        """Post this rank's ``report`` and count it; whether it was the last to arrive."""
        self._store.set(keys.report(self.rank), report)
        return int(self._store.add(keys.count, 1)) == self.world

    def missing(self, keys: Keys) -> list[int]:
        """The ranks whose report of commit ``keys`` has not arrived."""
        return [r for r in range(self.world) if not self._store.check([keys.report(r)])]

    def reports(self, keys: Keys) -> list[dict[str, Any]]:
        """Every rank's report of commit ``keys``, by rank."""
        values = self._store.multi_get([keys.report(r) for r in range(self.world)])
        return [json.loads(bytes(value).decode()) for value in values]

    def announce(self, keys: Keys, answer: str) -> None:
        """Rank 0: set the result of commit ``keys``; drop the keys of the commit before."""
        self._store.set(keys.result, answer)
        if keys.n == 0:
            return
        previous = Keys(keys.run, keys.n - 1)  # every rank is past it: drop its keys
        for key in (previous.outcome, previous.count, previous.result):
            self._store.delete_key(key)
        for rank in range(self.world):
            self._store.delete_key(previous.report(rank))
            self._store.delete_key(previous.ack(rank))

    def wait_acks(self, keys: Keys, seconds: float) -> None:
        """Rank 0: wait until every other rank acknowledged commit ``keys``.

        Raises ``torch.distributed.DistError`` after ``seconds``.
        """
        acks = [keys.ack(rank) for rank in range(1, self.world)]
        self._store.wait(acks, datetime.timedelta(seconds=seconds))

    # -- leave --------------------------------------------------------------------------

    async def leave(self, farewell: Callable[[], None]) -> None:
        """Run ``farewell`` on the control thread (if joined), then release everything."""
        control, waiter = self._control, self._waiter
        try:
            if control is not None and self._store is not None:
                await self._on(control, self._leave, farewell)
        finally:
            self._store = self._waiting = None
            if control is not None:
                control.shutdown(wait=False)
            if waiter is not None:
                waiter.shutdown(wait=False)  # it may still block on a key nobody will set
            if self._lock is not None:
                self._lock.release()

    def _leave(self, farewell: Callable[[], None]) -> None:
        farewell()
        group, self._group = self._group, None
        if group is not None and dist.is_initialized():
            dist.destroy_process_group(group)
