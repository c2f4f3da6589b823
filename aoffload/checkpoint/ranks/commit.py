"""One checkpoint across every rank of a ``torch.distributed`` job (``distributed=True``).

:class:`RankCommits` is the engine's :class:`~..core.roles.Coordinator` when it has ranks.
The ranks meet through :class:`~.rendezvous.Rendezvous`: the engine's own gloo group and a
``TCPStore`` rank 0 serves. This module is the protocol on top of it. It runs on the
engine's commit thread, never on the event loop: a rank whose loop is blocked in a long
synchronous step still reports its files the moment they are durable, so
``commit_timeout`` counts a rank as late only when its writer is.

- **start** (a collective, :meth:`RankCommits.join`). Rank 0 takes the directory lock,
  scans the directory and starts the store; one broadcast on the gloo group hands every rank
  the store's address, a run id and the scan, so every rank starts with the same catalog.
- **commit n** (every rank, same tags, same order) uses ``Keys.commit(run, n)``. Each rank
  writes its own files into its own ``.tmp-<tag>-<id>/``. Once they are durable it posts
  its :class:`~.reports.Report` (names, sizes, xxh3-64) and adds one to ``count``; the rank
  whose addition completes the count sets ``outcome`` to *written*. A rank whose write
  failed or whose writer died sets ``outcome`` to its :class:`~.reports.Failure` instead.
  ``outcome`` is set with ``compare_set``, so the first verdict wins. Meanwhile every rank
  blocks on ``outcome`` on its waiter thread, bounded by ``commit_timeout``. A failure
  anywhere therefore reaches every rank as soon as it is set, even while that rank's own
  writes still run (its commit raises at once; its directory is removed once its writes
  have ended): ``WorkerDiedError`` on the rank whose writer died, :class:`CheckpointError`
  naming the failed rank everywhere else. On *written*, rank 0 checks that file names are
  unique across ranks and renames every rank's files into its own directory
  (``format/write.gather``). It then writes one manifest, publishes the tag and
  ``latest``, and sets ``result`` (its :class:`~.reports.Answer`). The other ranks wait
  for ``result``, record the tag and acknowledge it.
- **ranks on their own nodes** (``node_local``: the remote tier makes the checkpoint
  whole, so no shared filesystem is needed). A rank whose temporary directory rank 0
  cannot see is *away*: rank 0 publishes the files it can gather, and, once told, an away
  rank publishes its own files in its own directory under the same tag and sequence.
- **timeouts and departures.** When ``commit_timeout`` runs out, ``store.check`` names the
  ranks whose report is missing. Closing the engine sets ``outcome`` of the commit in
  flight (or the next one) to "rank r closed its engine", so no peer waits for it; a
  trainer that dies leaves that word to its writer (``writer/watch.py``, armed by
  :meth:`RankCommits.arm`). Rank 0 keeps the store up until the last commit's
  acknowledgements arrive, waiting at most ``_ACK_SECONDS``. A dead rank 0 takes the
  store with it: the others see the lost connection at once.

Nothing a live peer owns is ever deleted: a rank removes only its own temporary
directory, and only once its writes have settled. Rank 0 removes a peer's directory
only after renaming out the files the peer reported durable.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ..._errors import CheckpointError, WorkerDiedError, first_line
from ..._runtime.threads import DaemonThreadExecutor
from ..core.commit import discard, written
from ..core.result import CommitResult, committed
from ..core.roles import Published
from ..format import layout, write
from ..format import metadata as _metadata
from ..meet.keys import Keys
from ..meet.reports import (
    WRITTEN,
    Answer,
    Failure,
    Report,
    Written,
    encode,
    merge_reports,
    verdict,
    warn_differing,
)
from .departure import Departure

if TYPE_CHECKING:
    from ..._runtime.core import WorkerCore
    from ..core.catalog import Catalog
    from ..core.roles import Resolve
    from ..core.tags import OpenTag
    from ..meet.rendezvous import Rendezvous
    from ..writer.calls import FileRecord

__all__ = ["RankCommits"]

logger = logging.getLogger(__name__)


def _entries(records: Mapping[str, FileRecord]) -> dict[str, layout.FileEntry]:
    return {name: layout.FileEntry(r.nbytes, r.xxh3_64) for name, r in records.items()}


def _sizes(files: Mapping[str, layout.FileEntry]) -> dict[str, int]:
    return {name: entry.bytes for name, entry in files.items()}


@dataclass(frozen=True, slots=True)
class _Commit:
    """Commit ``n`` of the run, under ``keys``: ``open_tag``, this rank's writes of it,
    when it was asked for, and whether it moves ``latest``."""

    n: int
    keys: Keys
    open_tag: OpenTag
    records: dict[str, FileRecord]
    started: float
    latest: bool

    def result(
        self, catalog: Catalog, sizes: Mapping[str, int], kept: Mapping[str, Any] | None
    ) -> CommitResult:
        """Its :class:`CommitResult`, published with ``sizes`` and ``kept`` metadata."""
        return committed(catalog.directory, self.open_tag, self.records, self.started, sizes, kept)


class RankCommits:
    """This rank's part in the commits of a distributed engine (its commit thread runs them).

    ``node_local``: a rank may keep its files in a directory of its own node (see the
    module); with a shared directory rank 0 gathers every rank's files.
    """

    together = True

    def __init__(
        self,
        rendezvous: Rendezvous,
        *,
        writer: WorkerCore | None,
        catalog: Catalog,
        durable: bool,
        node_local: bool = False,
    ) -> None:
        self.rendezvous = self._meet = rendezvous
        self.rank = rendezvous.rank
        self._writer, self._catalog = writer, catalog
        self._durable, self._node_local = durable, node_local
        self._next = 0
        self._in_flight: int | None = None
        self._last_ok: int | None = None
        self._writes = DaemonThreadExecutor("aoffload-ranks-writes")
        self._departure = Departure(rendezvous, writer)

    # -- start -----------------------------------------------------------------------------

    def join(self) -> layout.Scan:
        """Join the other ranks (a collective, blocking); return rank 0's scan."""
        if self._node_local:  # this rank's directory may be of its own
            self._catalog.directory.mkdir(parents=True, exist_ok=True)
        return self._meet.join()

    def arm(self) -> None:
        """Arm the writer to tell the others if this trainer dies (:mod:`.departure`)."""
        self._departure.arm(self._next)

    # -- commit -------------------------------------------------------------------------

    def commit(self, open_tag: OpenTag, started: float, latest: bool, resolve: Resolve) -> None:
        """Commit ``open_tag`` with every other rank (this is their ``n``-th commit).

        ``resolve`` gets the outcome as soon as it is known on every rank; a failed tag's
        directory is removed afterwards, once this rank's writes have ended.
        """
        n, self._next = self._next, self._next + 1
        self._in_flight = n
        self._departure.arm(n)
        keys = Keys.commit(self._meet.run, n)
        outcome = self._meet.wait_for(keys.outcome)
        own = self._writes.submit(written, self._writer, open_tag, self._catalog.latest)
        published = False
        try:
            either: list[concurrent.futures.Future[Any]] = [own, outcome]
            concurrent.futures.wait(either, return_when=concurrent.futures.FIRST_COMPLETED)
            if own.done():
                self._report(keys, open_tag, own)
            self._verdict(keys, open_tag.tag, outcome)
            this = _Commit(n, keys, open_tag, own.result(), started, latest)
            done = self._publish(this) if self.rank == 0 else self._published(this)
            published = True
            self._last_ok = n
            resolve(done, None)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever awaits the commit
            resolve(None, exc)
        finally:
            self._in_flight = None
            if not published:
                discard(open_tag, own)

    def _report(
        self, keys: Keys, open_tag: OpenTag, own: concurrent.futures.Future[dict[str, FileRecord]]
    ) -> None:
        """Tell every rank how this rank's writes ended; raise their failure here."""
        error = own.exception()
        if error is not None:
            what = "its writer died" if isinstance(error, WorkerDiedError) else "a write failed"
            try:
                self._meet.claim(
                    keys.outcome, encode(Failure(self.rank, f"{what}: {first_line(error)}"))
                )
            finally:
                raise error
        files = {n: Written(r.nbytes, r.xxh3_64, r.seconds) for n, r in own.result().items()}
        where = open_tag.tmpdir.name if files else ""
        report = Report(open_tag.tag, where, files, open_tag.metadata)
        try:
            if self._meet.report(keys, report):  # the last report: every rank's files are durable
                self._meet.claim(keys.outcome, WRITTEN)
        except dist.DistError as exc:
            raise CheckpointError(
                f"checkpoint {open_tag.tag!r}: lost the connection to the commit store on "
                f"rank 0 (rank 0 died or closed its engine: {first_line(exc)})"
            ) from exc

    def _verdict(self, keys: Keys, tag: str, outcome: concurrent.futures.Future[str]) -> None:
        """Wait for the outcome of the writes on every rank; raise unless all are durable."""
        nothing = f"nothing was published, {layout.LATEST!r} still names {self._catalog.latest!r}"
        try:
            value = outcome.result()
        except dist.DistStoreError:
            missing = self._meet.missing(keys)
            late = Failure(
                missing[0] if missing else -1,
                f"rank(s) {missing} did not report within commit_timeout={self._meet.timeout} s "
                "(a trainer died, is stuck, or skipped this commit)",
            )
            value = self._meet.claim(keys.outcome, encode(late))
        except dist.DistError as exc:
            raise CheckpointError(
                f"checkpoint {tag!r}: lost the connection to the commit store on rank 0 "
                f"(rank 0 died or closed its engine: {first_line(exc)}); {nothing}"
            ) from exc
        failure = verdict(value, WRITTEN)
        if failure is not None:
            raise CheckpointError(
                f"checkpoint {tag!r} failed on rank {failure.rank}: {failure.error}; {nothing}"
            )

    def _away(self, reports: list[Report]) -> list[int]:
        """The ranks with files whose temporary directory rank 0 cannot see (``node_local``)."""
        if not self._node_local:
            return []
        return [
            rank
            for rank, report in enumerate(reports)
            if rank and report.files and not (self._catalog.directory / report.dir).is_dir()
        ]

    def _publish(self, this: _Commit) -> Published:
        """Rank 0: gather the ranks' files, publish the tag, tell the others.

        The files of an away rank stay on its node: the tag names them and their sizes,
        and that rank publishes them itself once told.
        """
        catalog, keys, open_tag = self._catalog, this.keys, this.open_tag
        tag, kept = open_tag.tag, open_tag.metadata
        published: dict[str, layout.FileEntry] = {}
        try:
            reports = self._meet.reports(keys)
            entries, sources = merge_reports(tag, reports, catalog.directory)
            warn_differing(tag, kept, reports)
            away = self._away(reports)
            elsewhere = {name: entries[name].bytes for r in away for name in reports[r].files}
            if away:
                sources = {source: names for source, names in sources.items() if source.is_dir()}
            local = {n: e for n, e in entries.items() if n not in elsewhere}

            def result(files: Mapping[str, layout.FileEntry]) -> CommitResult:
                published.update(files)
                return this.result(catalog, _sizes(files) | elsewhere, kept)

            write.gather(open_tag.tmpdir, sources, durable=self._durable)
            done = catalog.publish(open_tag.tmpdir, tag, local, result, kept, latest=this.latest)
        except BaseException as exc:
            self._meet.set(keys.result, encode(Answer(False, error=first_line(exc))))
            raise
        peers = {name for rank, report in enumerate(reports) if rank for name in report.files}
        sizes = _sizes(published) | elsewhere
        answer = Answer(True, sequence=catalog.sequence, files=sizes, away=away, metadata=kept)
        previous = Keys.commit(keys.run, this.n - 1) if this.n else None
        self._meet.announce(keys, answer, previous)
        own = {name: entry for name, entry in published.items() if name not in peers}
        return Published(done, this.n, own)

    def _published(self, this: _Commit) -> Published:
        """Ranks but 0: wait for rank 0 to publish and take note of it; an away rank then
        publishes its own files in its own directory."""
        catalog, keys, open_tag = self._catalog, this.keys, this.open_tag
        answer = self._answer(keys, open_tag)
        kept = answer.metadata
        if self.rank not in answer.away:
            done = this.result(catalog, answer.files, kept)
            catalog.record(open_tag.tag, answer.sequence, done, latest=this.latest)
            catalog.forget_old()
            self._meet.set(keys.ack(self.rank), "1")
            return Published(done, this.n, _entries(this.records))
        published: dict[str, layout.FileEntry] = {}
        try:

            def result(files: Mapping[str, layout.FileEntry]) -> CommitResult:
                published.update(files)
                return this.result(catalog, dict(answer.files) | _sizes(files), kept)

            mine = _entries(this.records)
            done = catalog.publish(
                open_tag.tmpdir, open_tag.tag, mine, result, kept, latest=this.latest,
                sequence=answer.sequence,
            )  # fmt: skip
        except BaseException as exc:  # its upload can never happen: tell rank 0 at once
            failure = Failure(self.rank, f"its local publication failed: {first_line(exc)}")
            try:
                self._meet.claim(Keys.upload(keys.run, this.n).outcome, encode(failure))
            finally:
                self._meet.set(keys.ack(self.rank), "1")
            raise
        self._meet.set(keys.ack(self.rank), "1")
        return Published(done, this.n, published)

    def _answer(self, keys: Keys, open_tag: OpenTag) -> Answer:
        """Ranks but 0: rank 0's answer, once it has published ``open_tag``; raise if it
        could not. Warns when rank 0's metadata (the one kept) differs from this rank's."""
        tag = open_tag.tag
        try:
            answer = Answer.decode(self._meet.wait_for(keys.result).result())
        except dist.DistError as exc:
            raise CheckpointError(
                f"checkpoint {tag!r}: every rank wrote its files, but rank 0 did not say "
                f"whether it published them ({first_line(exc)}); check {self._catalog.directory}"
            ) from exc
        if not answer.ok:
            raise CheckpointError(
                f"checkpoint {tag!r}: rank 0 could not publish it: {answer.error}; "
                f"{layout.LATEST!r} still names {self._catalog.latest!r}"
            )
        differ = _metadata.differing(answer.metadata, open_tag.metadata)
        if differ:
            logger.warning(
                "rank %d: the metadata of checkpoint %r differs from rank 0's in %s; rank "
                "0's is kept: %r",
                self.rank,
                tag,
                differ,
                answer.metadata,
            )
        return answer

    # -- close --------------------------------------------------------------------------

    def disarm(self) -> None:
        """An orderly close: the writer stops without speaking for this rank."""
        self._departure.disarm()

    def leave(self, unfinished: str | None) -> None:
        """Tell the others this rank is gone (:meth:`.departure.Departure.leave`): ``unfinished``
        says why it leaves work undone (a tag saved but not committed, an exception leaving
        the engine, commits still running). Blocks; no commit of this rank is in flight."""
        n = self._in_flight if self._in_flight is not None else self._next
        settled = self._in_flight is None and self._last_ok == n - 1
        try:
            self._departure.leave(n, settled=settled, unfinished=unfinished, last_ok=self._last_ok)
        finally:
            self._writes.shutdown(wait=False)

    def release(self) -> None:
        """Nothing left to release: :meth:`leave` left the store and the directory lock."""
