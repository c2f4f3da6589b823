"""One checkpoint across every rank of a ``torch.distributed`` job (``distributed=True``).

The ranks meet through :class:`~._rendezvous.Rendezvous` (:mod:`._rendezvous`): the engine's
own gloo group, a ``TCPStore`` rank 0 serves, and two threads, so that no coordination ever
runs on the event loop. This module is the protocol on top of it:

- **start** (a collective, :meth:`Ranks.start`). Rank 0 takes the directory lock, scans
  the directory and starts the store; one broadcast on the gloo group hands every rank
  the store's address, a run id and the scan, so every rank starts with the same catalog.
- **commit n** (every rank, same tags, same order) uses keys ``aoffload/<run>/<n>/...``.
  Each rank writes its own files into its own ``.tmp-<tag>-<id>/``. Once they are
  durable it sets ``report/<rank>`` (names, sizes, xxh3-64) and adds one to ``count``;
  the rank whose addition completes the count sets ``outcome`` to *written*. A rank whose
  write failed or whose writer died sets ``outcome`` to its failure instead.
  ``outcome`` is set with ``compare_set``, so the first verdict wins. Meanwhile every rank
  blocks on ``outcome`` on its waiter thread, bounded by ``commit_timeout``. A failure
  anywhere therefore reaches every rank as soon as it is set, even while that rank's
  own writes still run: ``WorkerDiedError`` on the rank whose writer died,
  :class:`CheckpointError` naming the failed rank everywhere else. On *written*, rank 0
  checks that file names are unique across ranks and renames every rank's files into
  its own directory (:func:`._store.gather`). It then writes one manifest, publishes the
  tag and ``latest``, and sets ``result``. The other ranks wait for ``result``,
  record the tag and acknowledge it.
- **timeouts and departures.** When ``commit_timeout`` runs out, ``store.check`` names the
  ranks whose report is missing. ``aclose()`` sets ``outcome`` of the commit in flight
  (or the next one) to "rank r closed its engine", so no peer waits for it. Rank 0 keeps
  the store up until the last commit's acknowledgements arrive, waiting at most
  ``_ACK_SECONDS``. A dead rank 0 takes the store with it: the others see the lost
  connection at once.

Nothing a live peer owns is ever deleted: a rank removes only its own temporary
directory, and only once its writes have settled. Rank 0 removes a peer's directory
only after renaming out the files the peer reported durable.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

import torch.distributed as dist

from .._errors import CheckpointError, WorkerDiedError
from .._runtime.bridge import Bridge
from .._runtime.threads import mark_retrieved
from . import _store
from ._commit import Catalog, CommitResult, RunIO, Writes, committed, discard, write_out
from ._keys import Keys as _Keys
from ._keys import first_line as _first_line
from ._keys import merge_reports
from ._rendezvous import Rendezvous
from ._writer import FileRecord

__all__ = ["Ranks"]

logger = logging.getLogger(__name__)

_W = TypeVar("_W", bound=Writes)
_WRITTEN = "written"
_ACK_SECONDS = 10.0
"""How long rank 0's ``aclose()`` keeps the store up for the others to read the last result."""


class Ranks:
    """This rank's part in the commits of a distributed :class:`CheckpointEngine`."""

    def __init__(self, directory: Path, *, writer: bool, durable: bool, timeout: float) -> None:
        self._meet = Rendezvous(directory, writer=writer, timeout=timeout)
        self.rank = self._meet.rank
        self.world = self._meet.world
        self._directory = directory
        self._durable = durable
        self._timeout = timeout
        self._next = 0
        self._in_flight: int | None = None
        self._last_ok: int | None = None
        self._settling: set[asyncio.Task[None]] = set()

    async def start(self) -> _store.Scan:
        """Join the other ranks (a collective); return rank 0's scan of the directory."""
        return await self._meet.join()

    # -- commit -------------------------------------------------------------------------

    async def commit(
        self,
        open_tag: _W,
        bridge: Bridge | None,
        catalog: Catalog,
        run_io: RunIO,
        started: float,
        latest: bool,
        finish: Callable[[_W], None],
    ) -> CommitResult:
        """Commit ``open_tag`` with every other rank (this is their ``n``-th commit)."""
        n, self._next = self._next, self._next + 1
        self._in_flight = n
        keys = _Keys(self._meet.run, n)
        outcome = asyncio.ensure_future(self._meet.wait_for(keys.outcome))
        outcome.add_done_callback(mark_retrieved)
        own = asyncio.ensure_future(write_out(bridge, open_tag, catalog.latest))
        own.add_done_callback(mark_retrieved)
        published = False
        try:
            await asyncio.wait([own, outcome], return_when=asyncio.FIRST_COMPLETED)
            if own.done():
                await self._report(keys, open_tag, own)
            await self._verdict(keys, open_tag.tag, outcome, catalog.latest)
            if self.rank == 0:
                done = await self._publish(
                    keys, open_tag, own.result(), catalog, run_io, started, latest
                )
            else:
                done = await self._published(keys, open_tag, own.result(), catalog, started, latest)
            published = True
            self._last_ok = n
            return done
        finally:
            self._in_flight = None
            if published:
                finish(open_tag)
            else:
                settle = asyncio.ensure_future(self._settle(open_tag, own, run_io, finish))
                self._settling.add(settle)
                settle.add_done_callback(self._settling.discard)
                settle.add_done_callback(mark_retrieved)

    async def _settle(
        self,
        open_tag: _W,
        own: asyncio.Future[dict[str, FileRecord]],
        run_io: RunIO,
        finish: Callable[[_W], None],
    ) -> None:
        """Once this rank's writes of a failed tag have ended, remove its directory."""
        try:
            await discard(open_tag, run_io, own)
        finally:
            finish(open_tag)

    async def _report(
        self, keys: _Keys, open_tag: Writes, own: asyncio.Future[dict[str, FileRecord]]
    ) -> None:
        """Tell every rank how this rank's writes ended; raise their failure here."""
        error = own.exception()
        if error is not None:
            what = "its writer died" if isinstance(error, WorkerDiedError) else "a write failed"
            message = json.dumps({"rank": self.rank, "error": f"{what}: {_first_line(error)}"})
            try:
                await self._meet.control(self._meet.claim, keys.outcome, message)
            finally:
                raise error
        files = {n: [r.nbytes, r.xxh3_64, r.seconds] for n, r in own.result().items()}
        report = json.dumps(
            {"tag": open_tag.tag, "dir": open_tag.tmpdir.name if files else "", "files": files}
        )

        def send() -> None:
            if self._meet.report(keys, report):  # the last report: every rank's files are durable
                self._meet.claim(keys.outcome, _WRITTEN)

        try:
            await self._meet.control(send)
        except dist.DistError as exc:
            raise CheckpointError(
                f"checkpoint {open_tag.tag!r}: lost the connection to the commit store on "
                f"rank 0 (rank 0 died or closed its engine: {_first_line(exc)})"
            ) from exc

    async def _verdict(
        self, keys: _Keys, tag: str, outcome: asyncio.Future[str], latest: str | None
    ) -> None:
        """Wait for the outcome of the writes on every rank; raise unless all are durable."""
        nothing = f"nothing was published, {_store.LATEST!r} still names {latest!r}"
        try:
            value = await outcome
        except dist.DistStoreError:
            missing = await self._meet.control(self._meet.missing, keys)
            message = json.dumps(
                {
                    "rank": missing[0] if missing else -1,
                    "error": f"rank(s) {missing} did not report within commit_timeout="
                    f"{self._timeout} s (a trainer died, is stuck, or skipped this commit)",
                }
            )
            value = await self._meet.control(self._meet.claim, keys.outcome, message)
        except dist.DistError as exc:
            raise CheckpointError(
                f"checkpoint {tag!r}: lost the connection to the commit store on rank 0 "
                f"(rank 0 died or closed its engine: {_first_line(exc)}); {nothing}"
            ) from exc
        if value == _WRITTEN:
            return
        failure = json.loads(value)
        raise CheckpointError(
            f"checkpoint {tag!r} failed on rank {failure['rank']}: {failure['error']}; {nothing}"
        )

    async def _publish(
        self,
        keys: _Keys,
        open_tag: Writes,
        records: dict[str, FileRecord],
        catalog: Catalog,
        run_io: RunIO,
        started: float,
        latest: bool,
    ) -> CommitResult:
        """Rank 0: gather every rank's files, publish the tag, tell the others."""
        tag = open_tag.tag
        published: dict[str, _store.FileEntry] = {}
        try:
            reports = await self._meet.control(self._meet.reports, keys)
            entries, sources = merge_reports(tag, reports, self._directory)

            def result(files: Mapping[str, _store.FileEntry]) -> CommitResult:
                published.update(files)
                sizes = {name: entry.bytes for name, entry in files.items()}
                return committed(catalog.directory, open_tag, records, started, sizes)

            await run_io(lambda: _store.gather(open_tag.tmpdir, sources, durable=self._durable))
            done = await catalog.publish(
                run_io, open_tag.tmpdir, tag, entries, result, latest=latest
            )
        except BaseException as exc:
            failure = json.dumps({"ok": False, "error": _first_line(exc)})
            await self._meet.control(self._meet.set, keys.result, failure)
            raise
        sizes = {name: entry.bytes for name, entry in published.items()}
        answer = json.dumps({"ok": True, "sequence": catalog.sequence, "files": sizes})
        await self._meet.control(self._meet.announce, keys, answer)
        return done

    async def _published(
        self,
        keys: _Keys,
        open_tag: Writes,
        records: dict[str, FileRecord],
        catalog: Catalog,
        started: float,
        latest: bool,
    ) -> CommitResult:
        """Ranks but 0: wait for rank 0 to publish; take note of it."""
        tag = open_tag.tag
        try:
            answer = json.loads(await self._meet.wait_for(keys.result))
        except dist.DistError as exc:
            raise CheckpointError(
                f"checkpoint {tag!r}: every rank wrote its files, but rank 0 did not say "
                f"whether it published them ({_first_line(exc)}); check {catalog.directory}"
            ) from exc
        if not answer["ok"]:
            raise CheckpointError(
                f"checkpoint {tag!r}: rank 0 could not publish it: {answer['error']}; "
                f"{_store.LATEST!r} still names {catalog.latest!r}"
            )
        done = committed(catalog.directory, open_tag, records, started, answer["files"])
        catalog.record(tag, int(answer["sequence"]), done, latest=latest)
        catalog.forget_old()
        await self._meet.control(self._meet.set, keys.ack(self.rank), "1")
        return done

    # -- close --------------------------------------------------------------------------

    async def close(self, *, writer_died: bool) -> None:
        """Tell the others this rank is gone, keep the store up for their last read, leave."""
        if self._settling:
            await asyncio.wait(self._settling)  # the writer is closed: its writes have ended
        await self._meet.leave(lambda: self._farewell(writer_died))

    def _farewell(self, writer_died: bool) -> None:
        n = self._in_flight if self._in_flight is not None else self._next
        settled = self._in_flight is None and self._last_ok == n - 1 and not writer_died
        if self.rank != 0 and settled:
            # The usual end: every commit of this rank succeeded. Rank 0 may have closed
            # its store already; leave quietly (a rank that fails says so, below).
            return
        why = "its checkpoint writer died" if writer_died else "it closed its engine"
        outcome = _Keys(self._meet.run, n).outcome
        try:
            self._meet.claim(outcome, json.dumps({"rank": self.rank, "error": why}))
        except dist.DistError as exc:  # rank 0 closed first (the usual order) or died
            logger.debug("closing: the commit store is gone (%s)", _first_line(exc))
            return
        if self.rank == 0 and self._last_ok is not None and self.world > 1:
            try:
                self._meet.wait_acks(_Keys(self._meet.run, self._last_ok), _ACK_SECONDS)
            except dist.DistError as exc:
                logger.warning(
                    "closing: not every rank acknowledged the last checkpoint within %s s "
                    "(%s); a rank that was still reading it reports a lost store",
                    _ACK_SECONDS,
                    _first_line(exc),
                )
