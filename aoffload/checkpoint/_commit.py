"""What a directory has committed, and the phases of a commit: wait for the writes, publish, retain.

:class:`Catalog` is the engine's view of the directory (committed tags in commit order,
``latest``, the last sequence number, the results of its own commits). Its
:meth:`Catalog.publish` runs the publish phase of :mod:`._store` as one call on the
engine's I/O thread and then applies ``keep_last``: old tags are renamed away at once
and deleted on a thread of their own, so dropping a GiB-sized tag never lengthens a
commit.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from .._errors import CheckpointError, InvalidStateError, RemoteError
from .._runtime.bridge import Bridge
from .._runtime.threads import DaemonThreadExecutor
from . import _store
from ._writer import FileRecord, SyncTree

__all__ = ["Catalog", "CommitResult", "Writes", "commit_one", "discard", "write_out"]

logger = logging.getLogger(__name__)

RunIO = Callable[..., Awaitable[Any]]
"""Runs a blocking function with its arguments on the engine's I/O thread."""


@dataclass(frozen=True, slots=True)
class CommitResult:
    """What one ``commit()`` published, and how long each phase took.

    ``stage_seconds``: time spent copying the tag's tensors into staging memory (what
    ``save()`` cost the trainer); ``write_seconds``: the writer's time serialising and
    fsyncing the files; ``commit_seconds``: from the ``commit()`` call until the tag and
    ``latest`` were durable and published. A replica (``writer=False``) gets zero files.
    """

    tag: str
    path: Path
    files: tuple[str, ...]
    bytes: int
    stage_seconds: float
    write_seconds: float
    commit_seconds: float

    @property
    def write_gb_per_second(self) -> float:
        """Durable write throughput of the writer, in GB/s (10**9 bytes)."""
        return self.bytes / self.write_seconds / 1e9 if self.write_seconds > 0 else 0.0

    @property
    def stage_gb_per_second(self) -> float:
        """Staging copy throughput, in GB/s (10**9 bytes)."""
        return self.bytes / self.stage_seconds / 1e9 if self.stage_seconds > 0 else 0.0


class Writes(Protocol):
    """What a commit needs of a tag the engine has open: its files and where they go."""

    tag: str
    tmpdir: Path
    writes: dict[str, asyncio.Future[FileRecord]]
    stage_seconds: float

    def raise_failures(self) -> None:
        """Raise the first failure of a staging nobody awaited, once."""


_W = TypeVar("_W", bound=Writes)


def committed(
    directory: Path,
    open_tag: Writes,
    records: Mapping[str, FileRecord],
    started: float,
    sizes: Mapping[str, int],
) -> CommitResult:
    """The :class:`CommitResult` of ``open_tag``, published with the files in ``sizes``.

    ``records`` are this process's own writes (their time is ``write_seconds``);
    ``sizes`` lists every published file, other ranks' included.
    """
    return CommitResult(
        tag=open_tag.tag,
        path=directory / open_tag.tag,
        files=tuple(sizes),
        bytes=sum(sizes.values()),
        stage_seconds=open_tag.stage_seconds,
        write_seconds=sum(record.seconds for record in records.values()),
        commit_seconds=time.perf_counter() - started,
    )


async def write_out(
    bridge: Bridge | None, open_tag: Writes, latest: str | None
) -> dict[str, FileRecord]:
    """Wait until every file of ``open_tag`` is written, then fsync its directory tree.

    Raises :class:`CheckpointError` naming the first file whose write failed,
    :class:`WorkerDiedError` if the writer died. A tag with no files (a replica, or a
    rank that saved nothing) needs no writer and returns at once.
    """
    open_tag.raise_failures()
    records: dict[str, FileRecord] = {}
    for name, future in open_tag.writes.items():
        try:
            records[name] = await future
        except RemoteError as exc:
            raise CheckpointError(
                f"could not write {name!r} of checkpoint {open_tag.tag!r} to "
                f"{open_tag.tmpdir / name}: {exc.remote_message}; the checkpoint is "
                f"discarded, {_store.LATEST!r} still names {latest!r}"
            ) from exc
    if records and bridge is not None:
        await bridge.request(SyncTree(str(open_tag.tmpdir)))
    return records


async def commit_one(
    open_tag: _W,
    bridge: Bridge | None,
    catalog: Catalog,
    run_io: RunIO,
    started: float,
    latest: bool,
    finish: Callable[[_W], None],
) -> CommitResult:
    """Commit the tag of a single-process engine: wait for its files, publish, retain.

    A tag that fails is removed (:func:`discard`) before the error is raised.
    """
    tag, published = open_tag.tag, False
    try:
        open_tag.raise_failures()
        if not open_tag.writes:
            raise InvalidStateError(f"nothing was saved under tag {tag!r}; nothing to commit")
        records = await write_out(bridge, open_tag, catalog.latest)
        entries = {n: _store.FileEntry(r.nbytes, r.xxh3_64) for n, r in records.items()}

        def result(files: Mapping[str, _store.FileEntry]) -> CommitResult:
            sizes = {name: entry.bytes for name, entry in files.items()}
            return committed(catalog.directory, open_tag, records, started, sizes)

        done = await catalog.publish(run_io, open_tag.tmpdir, tag, entries, result, latest=latest)
        published = True
        return done
    finally:
        try:
            if not published:
                await discard(open_tag, run_io)
        finally:
            finish(open_tag)


async def discard(open_tag: Writes, run_io: RunIO, *also: asyncio.Future[Any]) -> None:
    """Remove the directory of a tag that failed, once its writes in flight (and ``also``)
    have ended: a write that ends later would recreate it, and reads its staging slot."""
    pending = [future for future in (*also, *open_tag.writes.values()) if not future.done()]
    if pending:
        await asyncio.wait(pending)
    await run_io(_store.remove_tree, open_tag.tmpdir)


class Catalog:
    """The committed tags of one directory, as of the engine's start and its own commits."""

    def __init__(self, directory: Path, *, durable: bool, keep_last: int | None) -> None:
        self.directory = directory
        self.tags: list[str] = []
        self.latest: str | None = None
        self.sequence = 0
        self.results: dict[str, CommitResult] = {}
        self._durable = durable
        self._keep_last = keep_last
        self._trash: DaemonThreadExecutor | None = None
        self._deletions: set[asyncio.Future[None]] = set()

    def found(self, scan: _store.Scan) -> None:
        """Take what a scan of the directory found."""
        self.tags, self.sequence, self.latest = scan.tags, scan.sequence, scan.latest

    def committed(self, tag: str) -> bool:
        """Whether ``tag`` is committed (and so cannot be saved into again)."""
        return tag in self.results or tag in self.tags

    async def publish(
        self,
        run_io: RunIO,
        tmpdir: Path,
        tag: str,
        files: Mapping[str, _store.FileEntry],
        result: Callable[[Mapping[str, _store.FileEntry]], CommitResult],
        *,
        latest: bool = True,
    ) -> CommitResult:
        """Publish ``tmpdir`` as ``tag`` and (with ``latest``) move ``latest``; then retain.

        ``result(files)`` builds the :class:`CommitResult` from every published file once
        the tag is published. Raises :class:`CheckpointError` (``latest`` unchanged) if
        publishing failed.
        """
        try:
            publish = functools.partial(
                _store.publish,
                tmpdir,
                self.directory,
                tag,
                self.sequence + 1,
                files,
                durable=self._durable,
                latest=latest,
            )
            published: Mapping[str, _store.FileEntry] = await run_io(publish)
        except OSError as exc:
            raise CheckpointError(
                f"could not publish checkpoint {tag!r} in {self.directory}: {exc}; "
                f"{_store.LATEST!r} still names {self.latest!r}"
            ) from exc
        done = result(published)
        self.record(tag, self.sequence + 1, done, latest=latest)
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
        await self._retain(run_io)
        return done

    def record(self, tag: str, sequence: int, done: CommitResult, *, latest: bool) -> None:
        """Take note that ``tag`` was published as ``sequence`` (by this engine or rank 0)."""
        self.sequence = sequence
        self.tags.append(tag)
        if latest:
            self.latest = tag
        self.results[tag] = done

    def forget_old(self) -> None:
        """Apply ``keep_last`` to this view only (rank 0 deletes the tags themselves)."""
        while self._keep_last is not None and len(self.tags) > self._keep_last:
            self.results.pop(self.tags.pop(0), None)

    async def _retain(self, run_io: RunIO) -> None:
        if self._keep_last is None:
            return
        while len(self.tags) > self._keep_last:
            tag = self.tags.pop(0)
            self.results.pop(tag, None)
            try:
                trash = await run_io(_store.retire, self.directory, tag, uuid.uuid4().hex[:8])
            except OSError:
                logger.exception("retention could not delete checkpoint %r; left in place", tag)
                continue
            # Deleting GiBs takes a while: on its own thread, off commit()'s path and off the
            # I/O thread that stages the next save(); close() waits for it.
            if self._trash is None:
                self._trash = DaemonThreadExecutor("aoffload-checkpoint-trash")
            loop = asyncio.get_running_loop()
            deletion = loop.run_in_executor(self._trash, _store.remove_tree, trash)
            self._deletions.add(deletion)
            deletion.add_done_callback(self._deleted)

    def _deleted(self, deletion: asyncio.Future[None]) -> None:
        self._deletions.discard(deletion)
        if not deletion.cancelled() and deletion.exception() is not None:
            logger.error(
                "retention could not delete an old checkpoint; a later start removes it",
                exc_info=deletion.exception(),
            )

    async def close(self) -> None:
        """Wait for the deletions retention started, then stop their thread."""
        if self._deletions:
            await asyncio.wait(self._deletions)
        if self._trash is not None:
            self._trash.shutdown(wait=True)  # idle: every deletion is done
