"""The DCP route's side in the trainer: one :class:`Service` per running engine.

``StorageWriter`` calls it directly where it runs in the trainer (``dcp.save``, and
``async_save`` in ``THREAD`` mode, on DCP's thread), and through the engine's door from
DCP's daemon (``PROCESS`` mode). Per save, every rank makes two calls:

* :class:`WriteRank` (in ``write_data``): the rank's files (records built by the writer,
  their tensors as spans of staging memory); each file becomes a file of the tag in the
  engine (reserved, written by its writer process: ``O_DIRECT``, xxh3-64, fsync), the
  coordinator reserves ``.metadata`` too, then the rank starts the engine's commit of the
  tag, whatever happened (so that the ranks number their commits alike: a rank whose
  write failed makes the commit fail on every rank). Answers each file's record spans
  once it is durable.
* :class:`Finish` (the coordinator, in ``finish``): ``.metadata`` written into its
  reserved file, then the commit awaited: every rank's files durable, the manifest with
  every file's checksum, the tag and ``latest`` published atomically, retention, the
  remote tier. Its failure (on any rank) raises here, and DCP raises it on every rank.

:class:`Release` has the writer unmap segments a daemon's scratch staging made.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import stat
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._errors import CheckpointError, InvalidStateError
from ..checkpoint.core.external import External
from ..checkpoint.writer.calls import FileRecord, RawRecord, Record
from ._door import Door, DoorAddress
from ._location import METADATA
from ._memory import is_segment_path, watch

if TYPE_CHECKING:
    from ..checkpoint.core.engine import EngineCore
    from ..checkpoint.core.result import CommitResult
    from ..checkpoint.core.tags import FileJob

__all__ = ["Finish", "Release", "Service", "Submit", "WriteRank"]

logger = logging.getLogger(__name__)


Submit = Callable[["FileJob", tuple[Record, ...]], None]
"""How :meth:`Service.write_files`'s ``fill`` hands a file's records to the writer."""


@dataclass(frozen=True, slots=True)
class WriteRank:
    """One rank's files of ``tag`` (``files``: name -> records) and the segments their
    spans name; ``coordinator``: this rank finishes the save; ``metadata``: the commit's."""

    tag: str
    files: tuple[tuple[str, tuple[Record, ...]], ...]
    segments: tuple[str, ...]
    coordinator: bool
    metadata: Mapping[str, Any] | None
    refused: str | None = None
    """Why this rank's items could not be staged: its files fail, and so does the commit
    it still takes part in (so that the ranks number their commits alike)."""


@dataclass(frozen=True, slots=True)
class Finish:
    """The coordinator's last call: DCP's ``.metadata`` of ``tag``; commit it."""

    tag: str
    metadata: bytes


@dataclass(frozen=True, slots=True)
class Release:
    """The segments at ``paths`` are done with: have the writer unmap them."""

    paths: tuple[str, ...]


def _segment_size(path: str) -> int:
    """The size of the staging segment at ``path``, which must be one of this user's."""
    if not is_segment_path(path):
        raise InvalidStateError(f"{path!r} is not an aoffload staging segment")
    info = os.stat(path, follow_symlinks=False)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        raise InvalidStateError(f"{path!r} is not a staging segment of this user")
    return info.st_size


class Service:
    """The DCP route's calls into one engine (thread-safe; blocking calls)."""

    def __init__(self, core: EngineCore) -> None:
        self._external = External(core)
        self._lock = threading.Lock()
        self._pending: dict[str, tuple[concurrent.futures.Future[Any], FileJob]] = {}
        self._door: Door | None = None
        self._closed = False
        # a stager of this process closing a segment: have the writer unmap it
        self._watch = watch(self._external.unmap)

    # -- the calls ------------------------------------------------------------------------

    def serve(self, request: object) -> Any:
        """Answer one call (from the door)."""
        if isinstance(request, WriteRank):
            return self.write(request)
        if isinstance(request, Finish):
            return self.finish(request)
        if isinstance(request, Release):
            return self.release(request)
        raise InvalidStateError(f"not a call of the DCP door: {type(request).__name__}")

    def write(self, request: WriteRank) -> tuple[FileRecord, ...]:
        """Write one rank's files of the tag, then start the commit (see the module)."""
        external = self._external

        def fill(jobs: list[FileJob], submit: Submit) -> None:
            if request.refused is not None:
                raise CheckpointError(f"this rank's items could not be staged: {request.refused}")
            for path in request.segments:
                external.map(path, _segment_size(path))
            for job, (_, records) in zip(jobs, request.files, strict=True):
                submit(job, records)

        names = [name for name, _ in request.files]
        return self.write_files(request.tag, names, request.coordinator, request.metadata, fill)

    def write_files(
        self,
        tag: str,
        names: list[str],
        coordinator: bool,
        metadata: Mapping[str, Any] | None,
        fill: Callable[[list[FileJob], Submit], None],
    ) -> tuple[FileRecord, ...]:
        """Reserve the rank's files ``names`` of ``tag`` (and ``.metadata`` on the
        coordinator), have ``fill`` hand each to the writer (``submit(job, records)``, in
        this process), wait until they are durable, then start the commit, whatever
        happened. If ``fill`` fails, the files it handed over are waited for first (the
        writer is done with the tag's folder before the commit discards it)."""
        external = self._external
        jobs: list[FileJob] = []
        submitted: list[FileJob] = []
        reserved_metadata: FileJob | None = None
        failure: BaseException | None = None

        def submit(job: FileJob, records: tuple[Record, ...]) -> None:
            submitted.append(job)
            external.write(job, records)

        try:
            for name in names:
                jobs.append(external.reserve(tag, name))
            if coordinator:
                reserved_metadata = external.reserve(tag, METADATA)
            fill(jobs, submit)
            return tuple(job.written.result() for job in jobs)
        except BaseException as exc:
            failure = exc
            concurrent.futures.wait([job.written for job in submitted])
            for job in jobs:
                if job not in submitted:
                    external.fail(job, exc)
            raise
        finally:
            self._commit(tag, metadata, jobs, reserved_metadata, failure)

    @property
    def external(self) -> External:
        """The engine's files written from records built here (what ``fill`` writes with)."""
        return self._external

    def _commit(
        self,
        tag: str,
        metadata: Mapping[str, Any] | None,
        jobs: list[FileJob],
        reserved_metadata: FileJob | None,
        failure: BaseException | None,
    ) -> None:
        """Start the commit of the tag: every rank does, once its part is written or failed."""
        external = self._external
        reserved = [*jobs, *([reserved_metadata] if reserved_metadata is not None else [])]
        if not reserved:
            return  # the tag is not open here (committed already, a closed engine): no commit
        if failure is not None:
            external.poison(reserved[0], failure)
            if reserved_metadata is not None:
                external.fail(reserved_metadata, failure)
        try:
            commit = external.commit(tag, metadata)
        except BaseException:
            if failure is None:
                raise
            logger.exception("checkpoint %r: its commit could not start", tag)
            return
        if reserved_metadata is None or failure is not None:
            return
        job = reserved_metadata

        def ended(future: concurrent.futures.Future[Any]) -> None:
            error = future.exception()
            if error is not None:  # another rank failed: .metadata will never come
                external.fail(job, error)
            with self._lock:
                if self._pending.get(tag, (None,))[0] is future:
                    del self._pending[tag]

        with self._lock:
            self._pending[tag] = (commit, job)
        commit.add_done_callback(ended)

    def finish(self, request: Finish) -> CommitResult:
        """Write ``.metadata`` and wait for the commit (see the module)."""
        with self._lock:
            pending = self._pending.get(request.tag)
        if pending is None:
            raise CheckpointError(
                f"checkpoint {request.tag!r}: finish() without this rank's write_data() (or "
                "its commit already failed)"
            )
        commit, job = pending
        try:
            self._external.write(job, (RawRecord(request.metadata),))
        except BaseException as exc:
            self._external.fail(job, exc)
            raise
        result: CommitResult = commit.result()
        return result

    def release(self, request: Release) -> None:
        """Have the writer unmap the segments at ``request.paths``."""
        for path in request.paths:
            self._external.unmap(path)

    # -- the door -------------------------------------------------------------------------

    def door(self) -> DoorAddress:
        """The address of this engine's door, opened on first use."""
        with self._lock:
            if self._closed:
                raise CheckpointError("the checkpoint engine is closed")
            if self._door is None:
                self._door = Door(self.serve)
            return self._door.address

    def close(self) -> None:
        """Close the door and fail the saves whose ``finish`` never came (before the
        engine stops, so that their commits end). Idempotent."""
        with self._lock:
            self._closed = True
            door, self._door = self._door, None
            pending = list(self._pending.values())
        if door is not None:
            door.close()
        for _, job in pending:
            self._external.fail(job, CheckpointError("the engine closed before DCP finished"))
