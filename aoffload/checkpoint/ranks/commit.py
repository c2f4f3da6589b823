"""One checkpoint across every rank of a ``torch.distributed`` job (``distributed=True``).

The ranks meet through :class:`~._ranks.Rendezvous` (:mod:`._ranks`): the engine's own gloo
group and a ``TCPStore`` rank 0 serves. This module is the protocol on top of it. It runs on
the engine's commit thread, never on the event loop: a rank whose loop is blocked in a
long synchronous step still reports its files the moment they are durable, so
``commit_timeout`` counts a rank as late only when its writer is.

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
  own writes still run (its commit raises at once; its directory is removed once its
  writes have ended): ``WorkerDiedError`` on the rank whose writer died,
  :class:`CheckpointError` naming the failed rank everywhere else. On *written*, rank 0
  checks that file names are unique across ranks and renames every rank's files into
  its own directory (:func:`.write.gather`). It then writes one manifest, publishes the
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

import concurrent.futures
import contextlib
import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..._errors import AoffloadError, CheckpointError, WorkerDiedError
from ..._runtime.core import WorkerCore
from ..._runtime.threads import DaemonThreadExecutor
from ..core.commit import Catalog, CommitResult, committed, discard, written
from ..core.tags import OpenTag
from ..format import layout, write
from ..format import metadata as _metadata
from ..writer.calls import FileRecord, WatchRank
from .rendezvous import Keys, Rendezvous, first_line

__all__ = ["Ranks", "merge_reports", "warn_differing"]

logger = logging.getLogger(__name__)

_WRITTEN = "written"
_ACK_SECONDS = 10.0
"""How long rank 0's close keeps the store up for the others to read the last result."""

Resolve = Callable[[CommitResult | None, BaseException | None], None]


def _ignore(value: object, error: BaseException | None) -> None:
    """A watch needs no answer (a dead writer fails it; the close says so)."""


def merge_reports(
    tag: str, reports: list[dict[str, Any]], directory: Path
) -> tuple[dict[str, layout.FileEntry], dict[Path, list[str]]]:
    """Every rank's files as manifest entries, and the peers' directories to gather."""
    entries: dict[str, layout.FileEntry] = {}
    owner: dict[str, int] = {}
    sources: dict[Path, list[str]] = {}
    for rank, report in enumerate(reports):
        if report["tag"] != tag:
            raise CheckpointError(
                f"rank {rank} committed tag {report['tag']!r} while rank 0 committed "
                f"{tag!r}: every rank must commit the same tags in the same order"
            )
        for name, (nbytes, xxh3, _) in report["files"].items():
            if name in owner:
                raise CheckpointError(
                    f"checkpoint {tag!r}: file {name!r} was saved by rank {owner[name]} "
                    f"and by rank {rank}; file names must be unique across ranks "
                    "(put the rank in the name)"
                )
            owner[name] = rank
            entries[name] = layout.FileEntry(nbytes, xxh3)
        if rank != 0 and report["files"]:
            sources[directory / report["dir"]] = list(report["files"])
    return entries, sources


def warn_differing(tag: str, kept: _metadata.Metadata | None, reports: list[Any]) -> None:
    """Rank 0: log the ranks whose commit metadata differs from rank 0's (which is kept)."""
    differ = {
        rank: keys
        for rank, report in enumerate(reports)
        if (keys := _metadata.differing(kept, report.get("metadata")))
    }
    if differ:
        logger.warning(
            "checkpoint %r: the commit metadata of rank(s) %s differs from rank 0's (keys: "
            "%s); rank 0's is kept. Pass the same metadata to commit() on every rank",
            tag,
            sorted(differ),
            sorted(set().union(*differ.values())),
        )


class Ranks:
    """This rank's part in the commits of a distributed engine (run on its commit thread)."""

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
        self._writes = DaemonThreadExecutor("aoffload-ranks-writes")

    @property
    def rendezvous(self) -> Rendezvous:
        """This rank's link to the others (the preemption notice uses it too)."""
        return self._meet

    def start(self) -> layout.Scan:
        """Join the other ranks (a collective, blocking); return rank 0's scan."""
        return self._meet.join()

    def watch(self, writer: WorkerCore | None, n: int | None = None) -> None:
        """Arm ``writer`` to tell the others if this trainer dies before commit ``n``
        (default: the next) or the one after ends (:class:`WatchRank`); a replica has
        no writer to say it."""
        if writer is None or not self._meet.run:
            return
        host, port = self._meet.address
        call = WatchRank(host, port, self._meet.run, self.rank, self._next if n is None else n)
        with contextlib.suppress(AoffloadError):  # a dead writer: the commit reports it
            writer.submit_callback(call, _ignore)

    def disarm(self, writer: WorkerCore | None) -> None:
        """An orderly close: ``writer`` stops without speaking for this rank."""
        if writer is None or writer.pid is None or writer.death is not None:
            return  # never started (a failed start), or gone
        with contextlib.suppress(AoffloadError):
            writer.submit_callback(WatchRank(), _ignore)

    # -- commit -------------------------------------------------------------------------

    def commit(
        self,
        open_tag: OpenTag,
        writer: WorkerCore | None,
        catalog: Catalog,
        started: float,
        latest: bool,
        resolve: Resolve,
    ) -> None:
        """Commit ``open_tag`` with every other rank (this is their ``n``-th commit).

        ``resolve`` gets the outcome as soon as it is known on every rank; a failed tag's
        directory is removed afterwards, once this rank's writes have ended.
        """
        n, self._next = self._next, self._next + 1
        self._in_flight = n
        self.watch(writer, n)
        keys = Keys(self._meet.run, n)
        outcome = self._meet.wait_for(keys.outcome)
        own = self._writes.submit(written, writer, open_tag, catalog.latest)
        published = False
        try:
            either: list[concurrent.futures.Future[Any]] = [own, outcome]
            concurrent.futures.wait(either, return_when=concurrent.futures.FIRST_COMPLETED)
            if own.done():
                self._report(keys, open_tag, own)
            self._verdict(keys, open_tag.tag, outcome, catalog.latest)
            if self.rank == 0:
                done = self._publish(keys, open_tag, own.result(), catalog, started, latest)
            else:
                done = self._published(keys, open_tag, own.result(), catalog, started, latest)
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
            message = json.dumps({"rank": self.rank, "error": f"{what}: {first_line(error)}"})
            try:
                self._meet.claim(keys.outcome, message)
            finally:
                raise error
        files = {n: [r.nbytes, r.xxh3_64, r.seconds] for n, r in own.result().items()}
        report = json.dumps(
            {
                "tag": open_tag.tag,
                "dir": open_tag.tmpdir.name if files else "",
                "files": files,
                "metadata": open_tag.metadata,
            }
        )
        try:
            if self._meet.report(keys, report):  # the last report: every rank's files are durable
                self._meet.claim(keys.outcome, _WRITTEN)
        except dist.DistError as exc:
            raise CheckpointError(
                f"checkpoint {open_tag.tag!r}: lost the connection to the commit store on "
                f"rank 0 (rank 0 died or closed its engine: {first_line(exc)})"
            ) from exc

    def _verdict(
        self, keys: Keys, tag: str, outcome: concurrent.futures.Future[str], latest: str | None
    ) -> None:
        """Wait for the outcome of the writes on every rank; raise unless all are durable."""
        nothing = f"nothing was published, {layout.LATEST!r} still names {latest!r}"
        try:
            value = outcome.result()
        except dist.DistStoreError:
            missing = self._meet.missing(keys)
            message = json.dumps(
                {
                    "rank": missing[0] if missing else -1,
                    "error": f"rank(s) {missing} did not report within commit_timeout="
                    f"{self._timeout} s (a trainer died, is stuck, or skipped this commit)",
                }
            )
            value = self._meet.claim(keys.outcome, message)
        except dist.DistError as exc:
            raise CheckpointError(
                f"checkpoint {tag!r}: lost the connection to the commit store on rank 0 "
                f"(rank 0 died or closed its engine: {first_line(exc)}); {nothing}"
            ) from exc
        if value == _WRITTEN:
            return
        failure = json.loads(value)
        raise CheckpointError(
            f"checkpoint {tag!r} failed on rank {failure['rank']}: {failure['error']}; {nothing}"
        )

    def _publish(
        self,
        keys: Keys,
        open_tag: OpenTag,
        records: dict[str, FileRecord],
        catalog: Catalog,
        started: float,
        latest: bool,
    ) -> CommitResult:
        """Rank 0: gather the ranks' files, publish the tag, tell the others.

        The files of an *away* rank (:meth:`_away`) stay on its node: the tag names them and
        their sizes, and that rank publishes them itself once told.
        """
        tag = open_tag.tag
        published: dict[str, layout.FileEntry] = {}
        kept = open_tag.metadata
        try:
            reports = self._meet.reports(keys)
            entries, sources = merge_reports(tag, reports, self._directory)
            warn_differing(tag, kept, reports)
            away = self._away(reports)
            elsewhere = {name: entries[name].bytes for r in away for name in reports[r]["files"]}
            if away:
                sources = {source: names for source, names in sources.items() if source.is_dir()}
            local = {n: e for n, e in entries.items() if n not in elsewhere}

            def result(files: Mapping[str, layout.FileEntry]) -> CommitResult:
                published.update(files)
                sizes = {name: entry.bytes for name, entry in files.items()} | elsewhere
                return committed(catalog.directory, open_tag, records, started, sizes, kept)

            write.gather(open_tag.tmpdir, sources, durable=self._durable)
            done = catalog.publish(open_tag.tmpdir, tag, local, result, kept, latest=latest)
        except BaseException as exc:
            self._meet.set(keys.result, json.dumps({"ok": False, "error": first_line(exc)}))
            raise
        self._gathered(tag, reports, published)
        sizes = {name: entry.bytes for name, entry in published.items()} | elsewhere
        answer = {
            "ok": True,
            "sequence": catalog.sequence,
            "files": sizes,
            "away": away,
            "metadata": kept,
        }
        self._meet.announce(keys, json.dumps(answer))
        return done

    def _away(self, reports: list[dict[str, Any]]) -> list[int]:
        """The ranks whose files rank 0 cannot gather: none, on one filesystem."""
        return []

    def _gathered(
        self, tag: str, reports: list[dict[str, Any]], published: dict[str, layout.FileEntry]
    ) -> None:
        """Rank 0, once ``tag`` is published with ``published``: nothing more to note here."""

    def _published(
        self,
        keys: Keys,
        open_tag: OpenTag,
        records: dict[str, FileRecord],
        catalog: Catalog,
        started: float,
        latest: bool,
    ) -> CommitResult:
        """Ranks but 0: wait for rank 0 to publish; take note of it."""
        answer = self._answer(keys, open_tag, catalog)
        kept = answer.get("metadata")
        done = committed(catalog.directory, open_tag, records, started, answer["files"], kept)
        catalog.record(open_tag.tag, int(answer["sequence"]), done, latest=latest)
        catalog.forget_old()
        self._meet.set(keys.ack(self.rank), "1")
        return done

    def _answer(self, keys: Keys, open_tag: OpenTag, catalog: Catalog) -> dict[str, Any]:
        """Ranks but 0: rank 0's answer, once it has published ``open_tag``; raise if it
        could not. Warns when rank 0's metadata (the one kept) differs from this rank's."""
        tag = open_tag.tag
        try:
            answer: dict[str, Any] = json.loads(self._meet.wait_for(keys.result).result())
        except dist.DistError as exc:
            raise CheckpointError(
                f"checkpoint {tag!r}: every rank wrote its files, but rank 0 did not say "
                f"whether it published them ({first_line(exc)}); check {catalog.directory}"
            ) from exc
        if not answer["ok"]:
            raise CheckpointError(
                f"checkpoint {tag!r}: rank 0 could not publish it: {answer['error']}; "
                f"{layout.LATEST!r} still names {catalog.latest!r}"
            )
        kept = answer.get("metadata")
        differ = _metadata.differing(kept, open_tag.metadata)
        if differ:
            logger.warning(
                "rank %d: the metadata of checkpoint %r differs from rank 0's in %s; rank "
                "0's is kept: %r",
                self.rank,
                tag,
                differ,
                kept,
            )
        return answer

    # -- close --------------------------------------------------------------------------

    def close(self, *, writer_died: bool, unfinished: str | None = None) -> None:
        """Tell the others this rank is gone, keep the store up for their last read, leave.

        ``unfinished`` says why this rank leaves with work it did not finish (a tag saved
        but not committed, an exception leaving the engine, commits still running): the
        peers' next ``commit()`` then fails at once, naming this rank. Blocks; the commit
        thread has stopped (no commit of this rank is in flight).
        """
        try:
            self._meet.leave(lambda: self._farewell(writer_died, unfinished))
        finally:
            self._writes.shutdown(wait=False)

    def _farewell(self, writer_died: bool, unfinished: str | None) -> None:
        n = self._in_flight if self._in_flight is not None else self._next
        settled = (
            self._in_flight is None
            and self._last_ok == n - 1
            and not writer_died
            and unfinished is None
        )
        if self.rank != 0 and settled:
            # The usual end: every commit of this rank succeeded and nothing is left
            # undone. Rank 0 may have closed its store already; leave quietly (a rank
            # that fails says so, below).
            return
        if writer_died:
            why = "its checkpoint writer died"
        elif unfinished is not None:
            why = f"it closed its engine: {unfinished}"
        else:
            why = "it closed its engine"
        outcome = Keys(self._meet.run, n).outcome
        if not self._meet.store_alive():  # rank 0 closed first (the usual order) or died
            logger.debug("closing: the commit store is gone; rank %d leaves (%s)", self.rank, why)
            return
        try:
            self._meet.claim(outcome, json.dumps({"rank": self.rank, "error": why}))
        except dist.DistError as exc:  # rank 0 closed first (the usual order) or died
            logger.debug("closing: the commit store is gone (%s)", first_line(exc))
            return
        if self.rank == 0 and self._last_ok is not None and self.world > 1:
            try:
                self._meet.wait_acks(Keys(self._meet.run, self._last_ok), _ACK_SECONDS)
            except dist.DistError as exc:
                logger.warning(
                    "closing: not every rank acknowledged the last checkpoint within %s s "
                    "(%s); a rank that was still reading it reports a lost store",
                    _ACK_SECONDS,
                    first_line(exc),
                )
