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

Each file is a :class:`.feed.FileFeed`. A copy thread copies its chunk (GIL-free), and the
chunks copied so far are fed to the writer in file order (:class:`FeedFile`); the writer's
reply to a feed gives its chunks back to the pool. So the write follows the copy chunk by
chunk, and a file larger than the cap streams through it. The thread that copies the last
chunk compares every tensor's version counter with the one recorded at ``stage()`` and
resolves the job's ``staged`` future: the fence returns when the last chunk is copied. The
writer answers the file's :class:`WriteRecords` once its last byte is written and fsynced
(``written``). No step waits for the event loop: after a step longer than the streaming, the
fence is free.

A failure (a copy, the version check, the writer) stops the file: no more chunks are
taken, the writer is told to drop the file (:class:`AbortFile`), and once the copy has
ended and the writer has answered, both futures fail with the first error.
"""

from __future__ import annotations

import threading
import warnings
from typing import TYPE_CHECKING

from ..._errors import CheckpointError, InvalidStateError
from ..._runtime.gate import GATE
from ..._runtime.threads import DaemonThreadExecutor
from ..writer.calls import MapSegment
from .copy import CopyPool, stage_events
from .feed import FileFeed
from .plan import cpu_storages, plan, restructured, versions
from .staging import StagingPool

if TYPE_CHECKING:
    from ..._runtime.core import WorkerCore
    from ..._runtime.gate import Reading
    from .copy import Events
    from .loadable import Unloadable
    from .plan import Structure, Versions
    from .staging import Segment
    from .tags import FileJob, Tags

__all__ = ["Pipeline"]


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
        self._streams: set[FileFeed] = set()
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
            stream = FileFeed(
                job,
                planned,
                events,
                reading,
                writer=self._writer,
                pool=self.staging,
                copies=self.copies,
                tags=self._tags,
                ended=self._ended,
            )
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

    def _ended(self, stream: FileFeed) -> None:
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
