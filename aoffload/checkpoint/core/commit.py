"""Commits, run on the engine's commit thread: what is committed, and how one commit runs.

:class:`Catalog` is the engine's view of the directory (committed tags in commit order,
``latest``, the last sequence number, the results of its own commits); the commit thread
updates it and any thread reads it. :func:`commit_local` is the whole commit of a
single-process engine as one blocking function: wait until every file of the tag is
written, fsync the tree, publish (:func:`.write.publish`: manifest last, rename,
``latest``), retire old tags. The distributed commit (:mod:`._distributed`) reuses its
pieces. Nothing here waits for the event loop: a commit completes while the loop is
blocked.
"""

from __future__ import annotations

import concurrent.futures
import copy
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..._errors import CheckpointError, InvalidStateError, RemoteError
from ..._runtime.core import WorkerCore
from ..._runtime.threads import DaemonThreadExecutor
from ..format import layout, write
from ..format.metadata import Metadata
from ..writer.calls import FileRecord, SyncTree
from .tags import OpenTag

__all__ = ["Catalog", "CommitResult", "commit_local", "committed", "discard", "written"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CommitResult:
    """What one ``commit()`` published, and how long each phase took.

    ``stage_seconds``: time spent copying the tag's tensors into staging memory (on
    aoffload's threads); ``write_seconds``: the writer's time serialising and fsyncing the
    files; ``commit_seconds``: from the ``commit()`` call until the tag and ``latest``
    were durable and published. A replica (``writer=False``) gets zero files.
    ``metadata`` is the commit's metadata as stored in the manifest (rank 0's, on every
    rank of a distributed engine); empty when the commit had none.
    """

    tag: str
    path: Path
    files: tuple[str, ...]
    bytes: int
    stage_seconds: float
    write_seconds: float
    commit_seconds: float
    metadata: Metadata = field(default_factory=dict)

    @property
    def write_gb_per_second(self) -> float:
        """Durable write throughput of the writer, in GB/s (10**9 bytes)."""
        return self.bytes / self.write_seconds / 1e9 if self.write_seconds > 0 else 0.0

    @property
    def stage_gb_per_second(self) -> float:
        """Staging copy throughput, in GB/s (10**9 bytes)."""
        return self.bytes / self.stage_seconds / 1e9 if self.stage_seconds > 0 else 0.0


def committed(
    directory: Path,
    open_tag: OpenTag,
    records: Mapping[str, FileRecord],
    started: float,
    sizes: Mapping[str, int],
    metadata: Metadata | None,
) -> CommitResult:
    """The :class:`CommitResult` of ``open_tag``, published with the files in ``sizes``.

    ``records`` are this process's own writes (their time is ``write_seconds``);
    ``sizes`` lists every published file, other ranks' included; ``metadata`` is what
    the manifest holds.
    """
    return CommitResult(
        tag=open_tag.tag,
        path=directory / open_tag.tag,
        files=tuple(sizes),
        bytes=sum(sizes.values()),
        stage_seconds=open_tag.stage_seconds,
        write_seconds=sum(record.seconds for record in records.values()),
        commit_seconds=time.perf_counter() - started,
        metadata=metadata or {},
    )


def written(
    writer: WorkerCore | None, open_tag: OpenTag, latest: str | None
) -> dict[str, FileRecord]:
    """Block until every file of ``open_tag`` is written, then fsync its directory tree.

    Raises :class:`CheckpointError` naming the first file whose staging or write failed,
    :class:`WorkerDiedError` if the writer died. A tag without files returns at once.
    """
    open_tag.raise_failures()
    records: dict[str, FileRecord] = {}
    for name, job in list(open_tag.files.items()):
        try:
            records[name] = job.written.result()
        except RemoteError as exc:
            raise CheckpointError(
                f"could not write {name!r} of checkpoint {open_tag.tag!r} to "
                f"{open_tag.tmpdir / name}: {exc.remote_message}; the checkpoint is "
                f"discarded, {layout.LATEST!r} still names {latest!r}"
            ) from exc
        except CheckpointError as exc:  # its staging failed (a tensor mutated, bad input)
            raise CheckpointError(
                f"file {name!r} of checkpoint {open_tag.tag!r} could not be staged ({exc}); "
                "the checkpoint is discarded"
            ) from exc
    if records and writer is not None:
        writer.request(SyncTree(str(open_tag.tmpdir)))
    return records


def discard(open_tag: OpenTag, *also: concurrent.futures.Future[Any]) -> None:
    """Remove the directory of a tag that failed, once its writes in flight (and ``also``)
    have ended: a write that ends later would recreate it, and reads its staging slot."""
    pending = [job.written for job in open_tag.files.values()] + list(also)
    concurrent.futures.wait(pending)
    write.remove_tree(open_tag.tmpdir)


def commit_local(
    open_tag: OpenTag,
    writer: WorkerCore | None,
    catalog: Catalog,
    started: float,
    latest: bool,
) -> CommitResult:
    """Commit the tag of a single-process engine: wait for its files, publish, retire.

    Runs on the commit thread. A tag that fails is removed (:func:`discard`) before the
    error is raised.
    """
    try:
        open_tag.raise_failures()
        if not open_tag.files:
            raise InvalidStateError(
                f"nothing was saved under tag {open_tag.tag!r}; nothing to commit"
            )
        records = written(writer, open_tag, catalog.latest)
        entries = {n: layout.FileEntry(r.nbytes, r.xxh3_64) for n, r in records.items()}

        def result(files: Mapping[str, layout.FileEntry]) -> CommitResult:
            sizes = {name: entry.bytes for name, entry in files.items()}
            return committed(
                catalog.directory, open_tag, records, started, sizes, open_tag.metadata
            )

        return catalog.publish(
            open_tag.tmpdir, open_tag.tag, entries, result, open_tag.metadata, latest=latest
        )
    except BaseException:
        discard(open_tag)
        raise


def _suffix() -> str:
    return uuid.uuid4().hex[:8]


class Catalog:
    """The committed tags of one directory, as of the engine's start and its own commits.

    The commit thread changes it; any thread reads it.
    """

    def __init__(self, directory: Path, *, durable: bool, keep_last: int | None) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._tags: list[str] = []
        self.latest: str | None = None
        self.sequence = 0
        self._results: dict[str, CommitResult] = {}
        self._metadata: dict[str, Metadata] = {}
        self._durable = durable
        self._keep_last = keep_last
        self._trash: DaemonThreadExecutor | None = None
        self._deletions: set[concurrent.futures.Future[None]] = set()
        self.holding: Callable[[str], concurrent.futures.Future[Any] | None] | None = None
        """What still reads a committed tag (its upload): retention deletes it after."""

    @property
    def tags(self) -> list[str]:
        """Committed tags, oldest first."""
        with self._lock:
            return list(self._tags)

    def found(self, scan: layout.Scan) -> None:
        """Take what a scan of the directory found."""
        with self._lock:
            self._tags, self.sequence, self.latest = list(scan.tags), scan.sequence, scan.latest
            self._metadata = {tag: scan.metadata[tag] for tag in scan.tags if tag in scan.metadata}

    def committed(self, tag: str) -> bool:
        """Whether ``tag`` is committed (and so cannot be saved into again)."""
        with self._lock:
            return tag in self._results or tag in self._tags

    def metadata(self, tag: str | None) -> Metadata:
        """A copy of committed ``tag``'s metadata (``{}`` if it has none; ``None``: the
        tag ``latest`` names); :class:`CheckpointError` if it is not committed."""
        with self._lock:
            if tag is None and self.latest is None:
                raise CheckpointError(f"{self.directory} holds no committed checkpoint")
            tag = self.latest if tag is None else tag
            if tag not in self._tags:
                known = ", ".join(self._tags) or "none"
                raise CheckpointError(
                    f"{self.directory} has no committed checkpoint {tag!r} (it has: {known})"
                )
            return copy.deepcopy(self._metadata.get(tag, {}))

    def result(self, tag: str) -> CommitResult | None:
        """The result of this engine's commit of ``tag``, if it made one."""
        with self._lock:
            return self._results.get(tag)

    def publish(
        self,
        tmpdir: Path,
        tag: str,
        files: Mapping[str, layout.FileEntry],
        result: Callable[[Mapping[str, layout.FileEntry]], CommitResult],
        metadata: Metadata | None,
        *,
        latest: bool = True,
        sequence: int | None = None,
    ) -> CommitResult:
        """Publish ``tmpdir`` as ``tag`` (its manifest holding ``metadata``) and (with
        ``latest``) move ``latest``; then retire.

        ``result(files)`` builds the :class:`CommitResult` from every published file.
        ``sequence`` is the tag's (default: one above the last). Raises
        :class:`CheckpointError` (``latest`` unchanged) if publishing failed.
        """
        sequence = self.sequence + 1 if sequence is None else sequence
        publish = functools.partial(
            write.publish,
            tmpdir,
            self.directory,
            tag,
            sequence,
            files,
            durable=self._durable,
            latest=latest,
            metadata=metadata,
        )
        try:
            published = publish()
        except OSError as exc:
            raise CheckpointError(
                f"could not publish checkpoint {tag!r} in {self.directory}: {exc}; "
                f"{layout.LATEST!r} still names {self.latest!r}"
            ) from exc
        done = result(published)
        self.record(tag, sequence, done, latest=latest)
        logger.info(
            "checkpoint %s committed: %d files, %.3f GB, staged in %.3f s, written in "
            "%.3f s (%.2f GB/s), commit %.3f s",
            tag,
            len(done.files),
            done.bytes / 1e9,
            done.stage_seconds,
            done.write_seconds,
            done.write_gb_per_second,
            done.commit_seconds,
        )
        self._retire()
        return done

    def record(self, tag: str, sequence: int, done: CommitResult, *, latest: bool) -> None:
        """Take note that ``tag`` was published as ``sequence`` (by this engine or rank 0)."""
        with self._lock:
            self.sequence = sequence
            self._tags.append(tag)
            if latest:
                self.latest = tag
            self._results[tag] = done
            if done.metadata:
                self._metadata[tag] = copy.deepcopy(done.metadata)

    def forget_old(self) -> None:
        """Apply ``keep_last`` to this view only (rank 0 deletes the tags themselves)."""
        with self._lock:
            while self._keep_last is not None and len(self._tags) > self._keep_last:
                tag = self._tags.pop(0)
                self._results.pop(tag, None)
                self._metadata.pop(tag, None)

    def _retire(self) -> None:
        while True:
            with self._lock:
                if self._keep_last is None or len(self._tags) <= self._keep_last:
                    return
                tag = self._tags.pop(0)
                self._results.pop(tag, None)
                self._metadata.pop(tag, None)
            try:
                self._delete(tag)
            except OSError:
                logger.exception("retention could not delete checkpoint %r; left in place", tag)

    def _delete(self, tag: str) -> None:
        """Rename ``tag`` out of the listing, then delete it in the background; a tag its
        upload still reads (:attr:`holding`) goes once the upload ends."""
        if not (self.directory / tag).is_dir():
            return  # only in the remote tier
        held = self.holding(tag) if self.holding is not None else None
        # Deleting GiBs takes a while: on a thread of its own, off the commit's path;
        # close() waits for it.
        if self._trash is None:
            self._trash = DaemonThreadExecutor("aoffload-checkpoint-trash")
        if held is None:
            trash = write.retire(self.directory, tag, _suffix())
            deletion = self._trash.submit(write.remove_tree, trash)
        else:
            deletion = self._trash.submit(self._retire_after, tag, held)
        self._deletions.add(deletion)
        deletion.add_done_callback(self._deleted)

    def remove_after(
        self,
        tag: str,
        earlier: list[concurrent.futures.Future[Any]],
        before: Callable[[], None] | None,
    ) -> bool:
        """:meth:`remove` ``tag`` unless one of the ``earlier`` commits (ended by now: the
        commit thread runs this after them) failed; ``before()`` runs first."""
        failed = [f.exception() for f in earlier if f.done() and f.exception() is not None]
        if failed:
            logger.warning("checkpoint %r is kept: a newer commit failed (%s)", tag, failed[0])
            return False
        if not self.committed(tag):
            return False
        if before is not None:
            before()
        return self.remove(tag)

    def remove(self, tag: str) -> bool:
        """Delete committed ``tag`` now (the commit thread); whether it was committed.

        Where ``latest`` names it, ``latest`` first moves (atomically) to the newest other
        committed tag, or goes: it never names a tag being deleted.
        """
        with self._lock:
            if tag not in self._tags:
                return False
            self._tags.remove(tag)
            self._results.pop(tag, None)
            self._metadata.pop(tag, None)
            moved = self.latest == tag
            if moved:
                self.latest = self._tags[-1] if self._tags else None
        if moved:
            write.point_latest(self.directory, self.latest, durable=self._durable)
        self._delete(tag)
        return True

    def _retire_after(self, tag: str, held: concurrent.futures.Future[Any]) -> None:
        concurrent.futures.wait([held])
        write.remove_tree(write.retire(self.directory, tag, _suffix()))

    def _deleted(self, deletion: concurrent.futures.Future[None]) -> None:
        self._deletions.discard(deletion)
        if deletion.exception() is not None:
            logger.error(
                "retention could not delete an old checkpoint; a later start removes it",
                exc_info=deletion.exception(),
            )

    def close(self) -> None:
        """Wait for the deletions retention started, then stop their thread (blocking)."""
        concurrent.futures.wait(list(self._deletions))
        if self._trash is not None:
            self._trash.shutdown(wait=True)
