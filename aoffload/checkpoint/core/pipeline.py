"""The staging pipeline: what happens to a file between ``stage()`` and the writer, on threads.

``stage()`` (:meth:`Pipeline.stage`, on the caller's thread) records what soundness needs
before it returns (each tensor's version counter, an event on each CUDA device's current
stream, a hold on memory a worker writes in place: :mod:`aoffload._runtime.gate`, released
when the copy ends) and hands one job to the pipeline's *stage thread*, which, in
``stage()`` order:

1. plans the state (:func:`.plan.plan`: ``torch.save``'s pickle, its storages and their
   layout, and a value the default load could not read back: an error with
   ``unloadable="error"``, else a warning at the fence);
2. waits for its tag's place among the ``max_pending`` tags (:meth:`.tags.Tags.wait_slot`);
3. opens the file in the writer (one :class:`WriteRecords` whose parts are all
   :class:`Streamed`), then takes a chunk of the staging pool for each piece of the file
   in turn (:meth:`.staging.StagingPool.take`: it blocks while every chunk holds bytes the
   writer has not written, which is the staging cap's backpressure) and hands each to
   the :class:`~.copy.CopyPool`.

A copy thread copies its chunk (GIL-free), and the chunks copied so far are fed to the
writer in file order (:class:`FeedFile`); the writer's reply to a feed gives its chunks
back to the pool. So the write follows the copy chunk by chunk, and a file larger than
the cap streams through it. The thread that copies the last chunk compares every
tensor's version counter with the one recorded at ``stage()`` and resolves the job's
``staged`` future: the fence returns when the last chunk is copied. The writer answers
the file's :class:`WriteRecords` once its last byte is written and fsynced (``written``).
No step waits for the event loop: after a step longer than the streaming, the fence is free.

A failure (a copy, the version check, the writer) stops the file: no more chunks are
taken, the writer is told to drop the file (:class:`AbortFile`), and once the copy has
ended and the writer has answered, both futures fail with the first error.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import warnings
from typing import TYPE_CHECKING, Any

from ..._errors import CheckpointError, InvalidStateError
from ..._runtime.gate import GATE
from ..._runtime.threads import DaemonThreadExecutor
from ..writer.calls import (
    AbortFile,
    Blob,
    FeedFile,
    FileRecord,
    MapSegment,
    Span,
    Streamed,
    TorchRecord,
    WriteRecords,
)
from .copy import CopyPool, StreamCopy, check_versions, stage_events
from .plan import cpu_storages, plan, restructured, versions
from .staging import StagingPool

if TYPE_CHECKING:
    from ..._runtime.core import WorkerCore
    from ..._runtime.gate import Reading
    from .copy import Events
    from .loadable import Unloadable
    from .plan import Plan, Structure, Versions
    from .staging import Chunk, Segment
    from .tags import FileJob, Tags

__all__ = ["Pipeline"]

logger = logging.getLogger(__name__)


class Pipeline:
    """The stage thread, the copy pool and the staging memory of one engine."""

    def __init__(
        self,
        tags: Tags,
        writer: WorkerCore,
        staging_bytes: int,
        unloadable: Unloadable = "warn",
    ) -> None:
        self._tags = tags
        self._writer = writer
        self._unloadable = unloadable
        self._thread = DaemonThreadExecutor("aoffload-stage")
        self.copies = CopyPool()
        self.staging = StagingPool(staging_bytes, self._map)
        self._streams: set[_FileStream] = set()
        self._lock = threading.Lock()

    def stage(self, job: FileJob, state: object) -> None:
        """Start staging ``state`` as ``job`` (the caller's thread; O(entries), never O(bytes)).

        Memory a worker writes in place (OffloadAdam's parameters) is held until the copy
        ends, so that the worker's next write waits for it; held while a step is writing
        it, the staging is refused here (see :mod:`aoffload._runtime.gate`).
        """
        structure: Structure = []
        recorded = versions(state, structure)
        job.structure = structure  # for the fence: a key added or removed since stage()
        reading = GATE.begin_read(cpu_storages(state) if GATE.guarding() else ())
        if reading.busy is not None:
            raise CheckpointError(
                f"cannot stage {job.name!r}: it holds {reading.busy}, which its worker is "
                "stepping now (the backward sent them and the step has not returned). Stage "
                "the parameters between steps: after `await opt.astep()` (or `opt.step()`) "
                "and before the next backward"
            )
        try:
            events = stage_events()
            self._thread.submit(self._run, job, state, recorded, events, reading)
        except BaseException:
            GATE.end_read(reading)
            raise

    # -- the stage thread ----------------------------------------------------------------

    def _run(
        self, job: FileJob, state: object, recorded: Versions, events: Events, reading: Reading
    ) -> None:
        try:
            planned = plan(state, job.name, recorded, check=self._unloadable != "ignore")
            del state
            if planned.unloadable is not None and self._unloadable == "error":
                raise InvalidStateError(f"{planned.unloadable} (unloadable='error')")
            job.plan = planned
            self._tags.wait_slot(job.open_tag)
            stream = _FileStream(self, job, planned, events, reading)
        except BaseException as exc:  # noqa: BLE001 - the job's futures carry it
            GATE.end_read(reading)
            self._tags.failed(job, exc)
            return
        with self._lock:
            self._streams.add(stream)
        stream.run()

    def _map(self, segment: Segment) -> None:
        """Have the writer map ``segment``; drop its name once both processes map it."""

        def mapped(_: object, error: BaseException | None) -> None:
            segment.unlink()  # mapped in both (or the writer is gone, which fails the write)

        try:
            self._writer.submit_callback(MapSegment(segment.path, segment.size), mapped)
        except BaseException:
            segment.unlink()
            raise

    def _ended(self, stream: _FileStream) -> None:
        with self._lock:
            self._streams.discard(stream)

    # -- the fence (the thread that owns the state) ----------------------------------------

    def fence(self, job: FileJob) -> CheckpointError | None:
        """The fence's check of ``job`` (see :meth:`.engine.EngineCore.seal`): the error of a
        file found modified in place since ``stage()`` (for the engine to discard its tag),
        or ``None``. Raises what the staging raised, or what an earlier fence found."""
        job.staged.result()
        if job.sealed is not False:
            if isinstance(job.sealed, BaseException):
                raise job.sealed
            return None
        # The check is the plan's last use: drop it, so that the tag, alive until it is
        # published, does not keep the caller's tensors alive too.
        planned, job.plan = job.plan, None
        structure, job.structure = job.structure, []
        moved = None if planned is None else planned.modified()
        changed = None if planned is None else restructured(structure, planned.state)
        if changed is not None and moved is None:
            return CheckpointError(
                f"cannot save {job.name!r}: {changed} after stage() and before `await staged`; "
                f"checkpoint {job.open_tag.tag!r} is discarded. Do not change a staged state "
                "(its tensors, or the keys of its dicts) until the fence (`await staged`, or "
                "save()) has returned"
            )
        if moved is None:
            job.sealed = True
            if planned is not None and planned.unloadable is not None:
                warnings.warn(
                    f"{planned.unloadable}. CheckpointEngine(unloadable='error') makes this "
                    "an error, unloadable='ignore' silences it",
                    UserWarning,
                    stacklevel=4,
                )
            return None
        key, before, after = moved
        return CheckpointError(
            f"cannot save {job.name!r}: {key} was modified in place after stage() and before "
            f"`await staged` (its version counter moved from {before} to {after}); checkpoint "
            f"{job.open_tag.tag!r} is discarded. Do not modify staged tensors until the fence "
            "(`await staged`, or save()) has returned; a module in training mode updates its "
            "running statistics (BatchNorm's) in its forward pass: fence before it"
        )

    # -- close ---------------------------------------------------------------------------

    def close(self) -> None:
        """Let the jobs queued end (those waiting for room or for staging memory fail),
        join every thread, unmap the staging memory. Blocks."""
        self.staging.interrupt()
        self._thread.shutdown(wait=True)
        with self._lock:
            streams = list(self._streams)
        for stream in streams:
            stream.copied.wait()
        self.copies.shutdown()
        self.staging.close()


class _FileStream:
    """One file on its way: chunks taken, copied, and fed to the writer in file order."""

    def __init__(
        self, pipeline: Pipeline, job: FileJob, planned: Plan, events: Events, reading: Reading
    ) -> None:
        self._pipeline, self._job, self._reading = pipeline, job, reading
        self._plan: Plan | None = planned
        self._writer = pipeline._writer
        self._pool = pipeline.staging
        self._copy = StreamCopy(planned, events)
        self._path = str(job.open_tag.tmpdir / job.name)
        record = TorchRecord(  # every part streamed: fed chunk by chunk as it is copied
            Streamed(planned.pickle_nbytes),
            tuple(Streamed(storage.numel()) for storage in planned.storages),
            tuple(Blob(at, Streamed(len(value))) for at, value in planned.blobs),
        )
        root = str(job.open_tag.tmpdir.parent)
        self._message = WriteRecords(self._path, (record,), root=root)
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
            self._pipeline.copies.put(functools.partial(self._copy_chunk, at, chunk))
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
        self._pipeline._tags.add_seconds(open_tag, seconds)
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
        self._pipeline._ended(self)
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
            self._pipeline._tags.failed(job, failure or RuntimeError("no outcome"))
        else:  # staged, then the write failed: the commit raises it
            job.written.set_exception(failure or RuntimeError("no outcome"))


def _ignore(_: object, error: BaseException | None) -> None:
    """The answer to an :class:`AbortFile`: nothing to do."""
