"""Files whose records the caller builds (the DCP route): reserved, written, committed.

An engine's own files go through :meth:`~.engine.EngineCore.stage` (plan, copy, write).
``aoffload.dcp``'s ``StorageWriter`` builds each file's records itself (DCP's write items,
their bytes already in staging memory it owns) and hands them over here, on the thread DCP
calls it on:

1. :meth:`External.reserve` a file of a tag (it takes the tag's slot, as ``stage()``
   does, and may wait for it: backpressure);
2. :meth:`External.write` it: one :class:`~..writer.calls.WriteRecords`, whose answer
   resolves the file's ``written`` future, as a staged file's does; or
   :meth:`External.fail` it;
3. :meth:`External.commit` the tag: the engine's own commit (its coordinator, so every
   rank of a distributed engine takes part), started at once; DCP reports its outcome, so
   the engine does not raise it again.

The staging segments the records name are mapped in the writer by :meth:`External.map`
and unmapped by :meth:`External.unmap` once their owner is done with them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
from typing import TYPE_CHECKING, Any

from ..._errors import ClosedError
from ..format import layout
from ..format import metadata as _metadata
from ..writer.calls import FileRecord, MapSegment, Record, UnmapSegment, WriteRecords

if TYPE_CHECKING:
    from .engine import EngineCore
    from .tags import FileJob

__all__ = ["External"]

logger = logging.getLogger(__name__)


def _settle(
    future: concurrent.futures.Future[Any], value: Any, error: BaseException | None
) -> None:
    """Resolve ``future`` unless something resolved it first (a failure racing a write)."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)


class External:
    """Files of an engine written from records built by the caller (thread-safe)."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core
        self._lock = threading.Lock()
        self._mapped: dict[str, int] = {}

    @property
    def directory(self) -> str:
        """The engine's checkpoint directory, as the writer calls name it."""
        return str(self._core.directory)

    def _writer(self) -> Any:
        self._core.check_running()
        writer = self._core.writer
        if writer is None:
            raise ClosedError("a replica (writer=False) writes no files")
        return writer

    # -- staging memory ---------------------------------------------------------------------

    def map(self, path: str, size: int) -> None:
        """Have the writer map the segment at ``path`` (``size`` bytes), once (blocking)."""
        with self._lock:
            if self._mapped.get(path) == size:
                return
        self._writer().request(MapSegment(path, size))
        with self._lock:
            self._mapped[path] = size

    def unmap(self, path: str) -> None:
        """Have the writer unmap ``path`` if it mapped it (blocking; nothing if it is gone)."""
        with self._lock:
            if self._mapped.pop(path, None) is None:
                return
        writer = self._core.writer
        if writer is None or writer.death is not None:
            return
        with contextlib.suppress(ClosedError):
            writer.request(UnmapSegment(path))

    # -- files --------------------------------------------------------------------------------

    def reserve(self, tag: str, name: str) -> FileJob:
        """A file ``name`` of ``tag`` to be written by :meth:`write` (blocking: it waits for
        the tag's staging slot, as a staged file does). Raises what ``stage()`` raises for
        a bad name or tag, a tag already committed or being committed (not a failure of an
        earlier commit: that one is the engine's next call's to raise)."""
        core = self._core
        self._writer()
        name, tag = layout.validate_name(name), layout.validate_tag(tag, core._tag_bytes)
        job = core.tags.add_file(tag, name, core.catalog.committed)
        try:
            core.tags.wait_slot(job.open_tag)
        except BaseException as exc:
            self.fail(job, exc)
            raise
        return job

    def write(self, job: FileJob, records: tuple[Record, ...]) -> None:
        """Write ``job``'s file as ``records`` (their spans mapped by :meth:`map`); its
        ``written`` future resolves with the writer's answer (durable, hashed)."""
        open_tag = job.open_tag
        message = WriteRecords(
            str(open_tag.tmpdir / job.name),
            records,
            root=self.directory,
            staging_cap=self._core.staging_cap,
        )

        def written(record: Any, error: BaseException | None) -> None:
            if error is None and not isinstance(record, FileRecord):
                error = TypeError(f"the writer answered {record!r}")
            _settle(job.written, record, error)
            _settle(job.staged, None, error)

        try:
            self._writer().submit_callback(message, written)
        except BaseException as exc:
            self.fail(job, exc)
            raise

    def fail(self, job: FileJob, error: BaseException) -> None:
        """``job`` will not be written: its tag's commit fails with ``error``."""
        if job.written.done():
            return
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            self._core.tags.failed(job, error)

    def poison(self, job: FileJob, error: BaseException) -> None:
        """``job``'s tag must not be published (before its commit starts): the commit
        fails, naming ``error``, on every rank."""
        self._core.tags.poison(job, error)

    # -- commit -------------------------------------------------------------------------------

    def commit(self, tag: str, metadata: object) -> concurrent.futures.Future[Any]:
        """Start the commit of ``tag`` (all of its files reserved by now); its future.

        Whoever calls this reports the outcome (DCP raises it on every rank): the engine
        does not raise a failure of it from its next call.
        """
        core = self._core
        core.check_running()
        # Not EngineCore.commit(): a failure of an earlier commit must not stop this rank
        # from taking part in this one (the ranks number their commits alike).
        future: concurrent.futures.Future[Any] = core._start_commit(
            tag, True, _metadata.validate(metadata)
        )
        core.tags.commit_seen(future)
        return future
