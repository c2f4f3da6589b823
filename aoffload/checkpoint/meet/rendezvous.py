"""Where the ranks of a distributed engine meet: its gloo group, the commit store, its keys.

:class:`Rendezvous` is this rank's link to the others; :mod:`.commit` runs the commit
protocol over it, ``remote/ranks.py`` the ranks' uploads and ``preemption/`` the agreement on
a step, each under its own :class:`~.keys.Keys`. Coordination uses torch.distributed alone,
and never runs on the event loop: the commit thread calls the store directly, on this
rank's *control* connection, and a *waiter* thread blocks on a key until a peer sets it
(:meth:`Rendezvous.wait_for`), on a connection of its own (a ``TCPStore`` client
serialises its calls, so a blocked wait would hold up everything else on its connection).

:meth:`Rendezvous.join` is the collective start. Every rank creates the engine's own gloo
group (``new_group(backend="gloo")``, whatever backend the trainer uses). Rank 0 takes the
directory lock (``format/lock.py``) and scans the directory, removing leftovers of dead runs
only when no other live engine holds the lock, then starts a ``TCPStore`` on a free port.
One ``broadcast_object_list`` on the gloo group hands every rank the store's address, a
run id and the scan, so every rank starts with the same catalog. The other ranks connect,
then hold the lock shared: they never clean.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import logging
import os
import socket
import uuid
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..._errors import CheckpointError
from ..._runtime.threads import DaemonThreadExecutor
from ..format import layout, read
from ..format import lock as _lock
from .keys import Keys
from .reports import Answer, Report, encode

__all__ = ["Rendezvous"]

logger = logging.getLogger(__name__)

_PROBE_SECONDS = 2.0
_TCPStore: Any = dist.TCPStore  # type: ignore[attr-defined]  # public, not re-exported


class Rendezvous:
    """This rank's link to the other ranks: the gloo group, the commit store, the waiter.

    The methods that talk to the store block: the commit thread (or the closing thread)
    calls them.
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
        self.address: tuple[str, int] = ("", 0)
        """The commit store's host and port (once joined)."""
        self._directory = directory
        self._writer = writer
        self._waiter: DaemonThreadExecutor | None = None
        self._store: Any = None  # this rank's connection for quick calls (rank 0: the server)
        self._waiting: Any = None  # the connection its waiter thread blocks on
        self._group: Any = None
        self._lock: _lock.DirectoryLock | None = None

    # -- waiting -----------------------------------------------------------------------

    def wait_for(self, key: str) -> concurrent.futures.Future[str]:
        """The value of ``key`` once a peer sets it, waited for on the waiter thread.

        The future fails with ``torch.distributed.DistStoreError`` after
        ``commit_timeout`` seconds, ``DistError`` when the store is gone.
        """
        if self._waiter is None:
            raise CheckpointError("the distributed engine was never started")
        return self._waiter.submit(self._get, key, self.timeout)

    def _get(self, key: str, timeout: float) -> str:
        return get(self._waiting, key, timeout)

    # -- join ---------------------------------------------------------------------------

    def join(self) -> layout.Scan:
        """Join the other ranks (a collective, blocking); return rank 0's scan."""
        self._waiter = DaemonThreadExecutor("aoffload-ranks-waiter")
        return self._join()

    def _connect(self, host: str, port: int) -> Any:
        timeout = datetime.timedelta(seconds=self.timeout)
        return _TCPStore(host, port, None, False, timeout=timeout)

    def _join(self) -> layout.Scan:
        self._group = dist.new_group(backend="gloo")
        link: list[Any] = [None, None]
        failure: Exception | None = None
        if self.rank == 0:
            # Rank 0 publishes, even as a replica: it is the directory's one writer. It
            # cleans only when it is alone. Whatever fails, every rank hears of it.
            try:
                self._directory.mkdir(parents=True, exist_ok=True)
                self._lock, scan = _lock.hold_shared(
                    self._directory,
                    lambda sole: read.scan(self._directory, clean=sole),
                    writer=True,
                )
                host = os.environ.get("MASTER_ADDR") or socket.gethostname()
                timeout = datetime.timedelta(seconds=self.timeout)
                self._store = _TCPStore(
                    host, 0, None, True, timeout=timeout, wait_for_workers=False
                )
                link = [(host, int(self._store.port), uuid.uuid4().hex[:12]), scan]
            except Exception as exc:  # noqa: BLE001 - raised on every rank, below
                link = [None, f"rank 0 could not start: {exc}"]
                failure = exc
        dist.broadcast_object_list(link, src=0, group=self._group)
        if link[0] is None:
            if self.rank == 0 and failure is not None:
                if isinstance(failure, OSError):
                    raise CheckpointError(
                        f"cannot use {self._directory} as a checkpoint directory: {failure}"
                    ) from failure
                raise failure
            raise CheckpointError(f"the distributed checkpoint engine did not start: {link[1]}")
        (host, port, self.run), scan = link
        self.address = (host, port)
        if self.rank != 0:
            self._store = self._connect(host, port)
            if self._writer:
                self._lock, _ = _lock.hold_shared(self._directory, lambda sole: None)
        self._waiting = self._connect(host, port)
        logger.debug(
            "rank %d joined checkpoint run %s (store %s:%d)", self.rank, self.run, host, port
        )
        if not isinstance(scan, layout.Scan):
            raise CheckpointError(f"rank 0 sent {type(scan).__name__} instead of its scan")
        return scan

    def connect(self) -> Any:
        """A connection of its own to the commit store, for a thread that blocks on it."""
        if not self.address[0]:
            raise CheckpointError("the distributed engine was never started")
        return self._connect(*self.address)

    # -- the store (blocking) ----------------------------------------------------------

    def claim(self, key: str, value: str) -> str:
        """Set ``key`` to ``value`` unless someone else set it first; what it holds now."""
        return bytes(self._store.compare_set(key, "", value)).decode()

    def set(self, key: str, value: str) -> None:
        """Set ``key`` to ``value``."""
        self._store.set(key, value)

    def report(self, keys: Keys, report: Report) -> bool:
        """Post this rank's ``report`` and count it; whether it was the last to arrive."""
        self._store.set(keys.report(self.rank), encode(report))
        return int(self._store.add(keys.count, 1)) == self.world

    def missing(self, keys: Keys) -> list[int]:
        """The ranks whose report of ``keys`` has not arrived."""
        return missing(self._store, keys, self.world)

    def reports(self, keys: Keys) -> list[Report]:
        """Every rank's report of commit ``keys``, by rank."""
        values = self._store.multi_get([keys.report(r) for r in range(self.world)])
        return [Report.decode(bytes(value).decode()) for value in values]

    def announce(self, keys: Keys, answer: Answer, previous: Keys | None) -> None:
        """Rank 0: set the result of commit ``keys``; drop the keys of the commit before."""
        self._store.set(keys.result, encode(answer))
        if previous is not None:  # every rank is past it
            for key in previous.spent(self.world):
                self._store.delete_key(key)

    def wait_acks(self, keys: Keys, seconds: float) -> None:
        """Rank 0: wait until every other rank acknowledged ``keys``' result.

        Raises ``torch.distributed.DistError`` after ``seconds``.
        """
        wait_acks(self._store, keys, self.world, seconds)

    def store_alive(self) -> bool:
        """Whether rank 0's store still takes connections (always, on rank 0).

        Asked with a plain socket: a ``TCPStore`` call on a closed connection prints a C++
        stack trace to stderr, which no Python setting silences.
        """
        if self.rank == 0:
            return True
        try:
            socket.create_connection(self.address, timeout=_PROBE_SECONDS).close()
        except OSError:
            return False
        return True

    # -- leave ---------------------------------------------------------------------------

    def leave(self, farewell: Any) -> None:
        """Run ``farewell()`` (if joined), then release everything (blocking)."""
        waiter = self._waiter
        try:
            if self._store is not None:
                farewell()
        finally:
            group, self._group = self._group, None
            try:
                if group is not None and dist.is_initialized():
                    dist.destroy_process_group(group)
            finally:
                self._store = self._waiting = None
                if waiter is not None:
                    waiter.shutdown(wait=False)  # it may still block on a key nobody sets
                if self._lock is not None:
                    self._lock.release()


# -- on a connection of the caller's (a thread that blocks on its own) ------------------------


def get(store: Any, key: str, seconds: float) -> str:
    """The value of ``key`` once set, waited for at most ``seconds`` on ``store``;
    ``torch.distributed.DistStoreError`` after that."""
    store.set_timeout(datetime.timedelta(seconds=max(seconds, 0.001)))
    return bytes(store.get(key)).decode()


def missing(store: Any, keys: Keys, world: int) -> list[int]:
    """The ranks whose report of ``keys`` has not arrived."""
    return [rank for rank in range(world) if not store.check([keys.report(rank)])]


def wait_acks(store: Any, keys: Keys, world: int, seconds: float) -> None:
    """Wait until every rank but 0 acknowledged ``keys``' result (``DistError`` after
    ``seconds``)."""
    if world > 1:
        acks = [keys.ack(rank) for rank in range(1, world)]
        store.wait(acks, datetime.timedelta(seconds=seconds))
