"""One file on its way from the staging pool to the writer (see :mod:`.pipeline`).

Chunks of the staging pool are taken in file order, copied on the copy pool's threads,
and fed to the writer in file order; the last one waits for the version check, so that a
file modified in place is dropped (:class:`AbortFile`) and never completed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..._runtime.gate import GATE
from ..writer.calls import (
    AbortFile,
    Blob,
    FeedFile,
    FileRecord,
    Span,
    Streamed,
    TorchRecord,
    WriteRecords,
)
from .copy import StreamCopy, check_versions

if TYPE_CHECKING:
    from ..._runtime.core import WorkerCore
    from ..._runtime.gate import Reading
    from .copy import CopyPool, Events
    from .plan import Plan
    from .staging import Chunk, StagingPool
    from .tags import FileJob, Tags

__all__ = ["FileFeed"]

logger = logging.getLogger(__name__)


class FileFeed:
    """One file on its way: chunks taken, copied, and fed to the writer in file order."""

    def __init__(
        self,
        job: FileJob,
        planned: Plan,
        events: Events,
        reading: Reading,
        *,
        writer: WorkerCore,
        pool: StagingPool,
        copies: CopyPool,
        tags: Tags,
        ended: Callable[[FileFeed], None],
    ) -> None:
        self._job, self._reading = job, reading
        self._plan: Plan | None = planned
        self._writer, self._pool, self._copies, self._tags = writer, pool, copies, tags
        self._ended = ended
        self._copy = StreamCopy(planned, events)
        self._path = str(job.open_tag.tmpdir / job.name)
        record = TorchRecord(  # every part streamed: fed chunk by chunk as it is copied
            Streamed(planned.pickle_nbytes),
            tuple(Streamed(storage.numel()) for storage in planned.storages),
            tuple(Blob(at, Streamed(len(value))) for at, value in planned.blobs),
        )
        root = str(job.open_tag.tmpdir.parent)
        self._message = WriteRecords(self._path, (record,), root=root, staging_cap=pool.cap)
        self._lock = threading.Lock()
        self._ready: dict[int, tuple[Chunk, int]] = {}  # copied, not yet fed
        self._fed = 0  # chunks handed to the writer, in order
        self._chunks = -(-self._copy.nbytes // self._pool.chunk)
        self._checked = False  # the version check passed: the last chunk may go
        self._taken = 0
        self._settled = 0  # chunks copied or given up
        self._all_taken = False
        self._failure: BaseException | None = None
        self._answered = False  # the writer answered the WriteRecords
        self._record: FileRecord | None = None
        self._resolved = False  # the job's outcome is set
        self._started = time.perf_counter()
        self.copied = threading.Event()
        """Set once the copy has ended (every chunk copied, or given up)."""

    def run(self) -> None:
        """Open the file in the writer, then take a chunk for each piece of it in turn
        (blocking while the staging pool is full) and hand it to a copy thread."""
        try:
            self._open()
        except BaseException as exc:  # noqa: BLE001 - the job's futures carry it
            with self._lock:
                self._answered = True  # nothing was sent: no answer will come
            self._fail(exc)
        chunk_bytes = self._pool.chunk
        at = 0
        while at < self._copy.nbytes and self._failure is None:
            try:
                chunk = self._pool.take(self._copy.nbytes - at)
            except BaseException as exc:  # noqa: BLE001 - the job's futures carry it
                self._fail(exc)
                break
            with self._lock:
                self._taken += 1
            self._copies.put(functools.partial(self._copy_chunk, at, chunk))
            at += chunk_bytes
        with self._lock:
            self._all_taken = True
            ended = self._settled == self._taken
        if ended:
            self._end()

    def _open(self) -> None:
        self._writer.submit_callback(self._message, self._written)

    # -- the copy threads -----------------------------------------------------------------

    def _copy_chunk(self, at: int, chunk: Chunk) -> None:
        nbytes, error = 0, None
        if self._failure is None:
            try:
                nbytes = self._copy.copy(at, chunk)
            except BaseException as exc:  # noqa: BLE001 - the job's futures carry it
                error = exc
        if error is not None:
            self._fail(error)
        with self._lock:
            if self._failure is None:
                self._ready[at // self._pool.chunk] = (chunk, nbytes)
                self._feed()  # under the lock: feeds leave in file order
            else:
                self._pool.give(chunk)
            self._settled += 1
            ended = self._all_taken and self._settled == self._taken
        if ended:
            self._end()

    def _feed(self) -> None:
        """Hand the writer the chunks copied so far that come next in the file (the lock
        is held). The last one waits for the version check: the writer never ends a file
        whose check failed, so that dropping it (:class:`AbortFile`) always finds it."""
        batch: list[tuple[Chunk, int]] = []
        limit = self._chunks if self._checked else self._chunks - 1
        while self._fed < limit and (ready := self._ready.pop(self._fed, None)) is not None:
            batch.append(ready)
            self._fed += 1
        if not batch:
            return
        spans = tuple(Span(chunk.segment.path, chunk.offset, nbytes) for chunk, nbytes in batch)

        def fed(_: object, error: BaseException | None) -> None:
            for chunk, _nbytes in batch:  # written, or never to be: the memory is free
                self._pool.give(chunk)

        try:
            self._writer.submit_callback(FeedFile(self._path, spans), fed)
        except BaseException as exc:  # noqa: BLE001 - the writer is gone: the job fails
            fed(None, exc)
            self._failure = self._failure or exc

    def _end(self) -> None:
        """The copy has ended (the last chunk copied, or the rest given up)."""
        GATE.end_read(self._reading)
        seconds = time.perf_counter() - self._started
        open_tag = self._job.open_tag
        self._tags.add_seconds(open_tag, seconds)
        open_tag.staging_bytes = self._pool.size
        open_tag.staging_peak = max(open_tag.staging_peak, self._pool.peak)
        logger.debug(
            "%r of checkpoint %r: %.1f MiB staged in %.3f s; staging memory %.0f MiB of %.0f "
            "MiB, %.0f MiB in use at most",
            self._job.name,
            open_tag.tag,
            self._copy.nbytes / 2**20,
            seconds,
            self._pool.size / 2**20,
            self._pool.cap / 2**20,
            self._pool.peak / 2**20,
        )
        self._copy.release()
        planned, self._plan = self._plan, None  # the state is the caller's again
        if self._failure is None and planned is not None:
            try:
                check_versions(planned, self._job.name)
            except BaseException as exc:  # noqa: BLE001 - the job's futures carry it
                self._fail(exc)
        del planned
        with self._lock:
            staged = self._failure is None
            if staged:
                self._checked = True
                self._feed()
        if staged:
            self._job.staged.set_result(None)
        self.copied.set()
        self._ended(self)
        self._settle()

    # -- failures and the writer's answer --------------------------------------------------

    def _fail(self, error: BaseException) -> None:
        """Stop the file at the first error: no more chunks, the writer drops the file."""
        with self._lock:
            if self._failure is not None:
                return
            self._failure = error
            ready, self._ready = list(self._ready.values()), {}
            answered = self._answered
        for chunk, _nbytes in ready:
            self._pool.give(chunk)
        if not answered:
            with contextlib.suppress(Exception):  # a dead writer answers the file itself
                self._writer.submit_callback(
                    AbortFile(self._path, f"{type(error).__name__}: {error}"), _ignore
                )

    def _written(self, record: Any, error: BaseException | None) -> None:
        """The writer's answer to the file (its reader thread)."""
        if error is None and not isinstance(record, FileRecord):
            error = TypeError(f"the writer answered {record!r}")
        with self._lock:
            self._answered = True
            if error is None:
                self._record = record
            elif self._failure is None:
                self._failure = error  # the writer failed first: stop the copy
        self._settle()

    def _settle(self) -> None:
        """Resolve ``written`` (and, on failure, ``staged``) once the copy has ended and
        the writer has answered; an outcome is set once."""
        with self._lock:
            if not (self.copied.is_set() and self._answered) or self._resolved:
                return
            self._resolved = True
            failure, record = self._failure, self._record
        job = self._job
        if failure is None and record is not None:
            job.written.set_result(record)
        elif not job.staged.done():
            self._tags.failed(job, failure or RuntimeError("no outcome"))
        else:  # staged, then the write failed: the commit raises it
            job.written.set_exception(failure or RuntimeError("no outcome"))


def _ignore(_: object, error: BaseException | None) -> None:
    """The answer to an :class:`AbortFile`: nothing to do."""
