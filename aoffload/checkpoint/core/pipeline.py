"""The staging pipeline: what happens to a file between ``stage()`` and the writer, on threads.

``stage()`` (:meth:`Pipeline.stage`, on the caller's thread) records what soundness needs
before it returns (each tensor's version counter, an event on each CUDA device's current
stream, a hold on memory a worker writes in place: :mod:`aoffload._runtime.gate`, released
when the copy ends) and hands one job to the pipeline's *stage thread*, which, in ``stage()`` order:

1. plans the state (:func:`.plan.plan`: ``torch.save``'s pickle, its storages and their
   layout, and a value the default load could not read back: an error with
   ``unloadable="error"``, else a warning at the fence);
2. waits for its tag's staging slot (:meth:`.tags.Tags.wait_slot`: backpressure), and
   reserves a region of it; a new shared-memory segment is mapped by the writer at once
   (its name is unlinked as soon as both processes map it);
3. hands the copy to the :class:`~.copy.CopyPool`, whose threads copy in GIL-free chunks
   and check every tensor's version counter against the one recorded at ``stage()``;

and the last copy thread out hands the file to the writer (one :class:`WriteRecords` call
through the thread-safe :class:`~aoffload._runtime.core.WorkerCore`) and resolves the
job's ``staged`` future. No step waits for the event loop: after a step that blocks the
loop longer than the copy, ``await staged`` finds it done.
"""

from __future__ import annotations

import concurrent.futures
import logging
import warnings
from typing import TYPE_CHECKING, Any

from ..._errors import CheckpointError, InvalidStateError
from ..._runtime.gate import GATE
from ..._runtime.threads import DaemonThreadExecutor
from ..writer.calls import Blob, FileRecord, MapSegment, Span, TorchRecord, WriteRecords
from .copy import CopyPool, stage_events
from .plan import cpu_storages, plan, restructured, versions

if TYPE_CHECKING:
    from ..._runtime.core import WorkerCore
    from ..._runtime.gate import Reading
    from .copy import Events
    from .loadable import Unloadable
    from .plan import Plan, Structure, Versions
    from .staging import Region, Segment
    from .tags import FileJob, Tags

__all__ = ["Pipeline"]

logger = logging.getLogger(__name__)


class Pipeline:
    """The stage thread and the copy pool of one engine."""

    def __init__(self, tags: Tags, writer: WorkerCore, unloadable: Unloadable = "warn") -> None:
        self._tags = tags
        self._writer = writer
        self._unloadable = unloadable
        self._thread = DaemonThreadExecutor("aoffload-stage")
        self._pool = CopyPool()
        self._copies: set[concurrent.futures.Future[float]] = set()

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
            slot = self._tags.wait_slot(job.open_tag)
            region, segment = slot.allocate(planned.nbytes)
            if segment is not None:
                self._map(segment)
            copy = self._pool.copy(region, planned, events, job.name)
        except BaseException as exc:  # noqa: BLE001 - the job's futures carry it
            GATE.end_read(reading)
            self._tags.failed(job, exc)
            return
        self._copies.add(copy)
        copy.add_done_callback(lambda _: GATE.end_read(reading))  # before the hand-off
        copy.add_done_callback(lambda done: self._hand_off(job, planned, region, done))

    def _map(self, segment: Segment) -> None:
        """Have the writer map ``segment``; drop its name once both processes map it."""

        def mapped(_: object, error: BaseException | None) -> None:
            segment.unlink()  # mapped in both (or the writer is gone, which fails the write)

        try:
            self._writer.submit_callback(MapSegment(segment.path, segment.size), mapped)
        except BaseException:
            segment.unlink()
            raise

    # -- the last copy thread ------------------------------------------------------------

    def _hand_off(
        self,
        job: FileJob,
        planned: Plan,
        region: Region,
        copy: concurrent.futures.Future[float],
    ) -> None:
        self._copies.discard(copy)
        try:
            seconds = copy.result()
            self._tags.add_seconds(job.open_tag, seconds)
            segment, base = region.segment.path, region.offset
            record = TorchRecord(
                Span(segment, base, planned.pickle_nbytes),
                tuple(
                    Span(segment, base + offset, storage.numel())
                    for storage, offset in zip(
                        planned.storages, planned.storage_offsets, strict=True
                    )
                ),
                tuple(
                    Blob(at, Span(segment, base + offset, len(value)))
                    for (at, value), offset in zip(planned.blobs, planned.blob_offsets, strict=True)
                ),
            )
            message = WriteRecords(
                str(job.open_tag.tmpdir / job.name), (record,), root=str(self._tags.directory)
            )

            def written(record: Any, error: BaseException | None) -> None:
                if error is not None:
                    job.written.set_exception(error)
                elif isinstance(record, FileRecord):
                    job.written.set_result(record)
                else:
                    job.written.set_exception(TypeError(f"the writer answered {record!r}"))

            self._writer.submit_callback(message, written)
        except BaseException as exc:  # noqa: BLE001 - the job's futures carry it
            self._tags.failed(job, exc)
            return
        job.staged.set_result(None)

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
        """Let the jobs queued end (those waiting for room fail), join every thread.

        Blocks; after it, nothing copies into staging memory any more.
        """
        self._thread.shutdown(wait=True)
        for copy in list(self._copies):
            try:
                copy.result()
            except BaseException:  # noqa: BLE001 - reported by the job's own futures
                logger.debug("a copy ended with an error while the engine closed")
        self._pool.shutdown()
