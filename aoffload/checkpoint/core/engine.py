"""The checkpoint engine itself, as any thread sees it: synchronous and thread-safe.

:class:`EngineCore` owns everything a checkpoint engine is made of, and its threads do all the
work; nothing in it needs an event loop. :class:`~aoffload.CheckpointEngine` is its face for
both kinds of trainer. It is one process writing one local directory: who else takes part in
a commit (a :class:`~.roles.Coordinator`) and what stands behind the directory (a
:class:`~.roles.Tier`) are handed to it by the assembler: nothing here asks about features.

===================  ==============================================================
thread               work
===================  ==============================================================
the caller's         ``stage()``: validation, version counters, the job handed over;
                     ``commit()``: which tag, its future, the commit handed over
stage thread         plan, open the file in the writer, staging chunks (:mod:`.pipeline`)
copy pool            GIL-free copies of the chunks, fed to the writer; the version check
writer process       ``torch.save``'s archives into ``O_DIRECT`` files, fsync (``writer/``)
commit thread        one commit at a time, in request order, through the coordinator:
                     wait for the writes, fsync, publish, ``latest``, retention
                     (:mod:`.commit`, :mod:`.catalog`), with every rank (``ranks/``)
load thread          verify and load (:mod:`.load`); where the tier says the file is
trash thread         deleting retired tags
tier's threads       with ``remote=``: each committed tag's upload (``remote/``)
===================  ==============================================================

The tags in flight have one owner, :class:`~.tags.Tags`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..._errors import ClosedError, InvalidStateError, first_line
from ..._runtime.threads import DaemonThreadExecutor, Handoff, running_future
from ..format import layout, read, shm, write
from ..format import metadata as _metadata
from ..writer.calls import staging_room
from . import closing
from .load import MapLocation, load_from
from .pipeline import Pipeline
from .result import CommitResult
from .staging import SlotPool, default_cap
from .tags import Tags

if TYPE_CHECKING:
    from .loadable import Unloadable
    from .roles import Follower, Parts, Published
    from .tags import FileJob, OpenTag

__all__ = ["EngineCore"]

logger = logging.getLogger(__name__)


def _done(value: Any) -> concurrent.futures.Future[Any]:
    future: concurrent.futures.Future[Any] = running_future()
    future.set_result(value)
    return future


class EngineCore:
    """The engine behind :class:`~aoffload.CheckpointEngine` (see there for the options),
    made by the assembler from its :class:`~.roles.Parts`."""

    def __init__(
        self,
        parts: Parts,
        *,
        max_pending: int,
        unloadable: Unloadable,
        start_timeout: float,
        close_timeout: float,
        commit_timeout: float = 300.0,
        staging_bytes: int | None = None,
    ) -> None:
        self.directory = directory = parts.catalog.directory
        self.writer, self.catalog = parts.writer, parts.catalog
        self.coordinator, self.tier = parts.coordinator, parts.tier
        self.tags = Tags(directory, SlotPool(max_pending))
        self._max_pending = max_pending
        self._unloadable: Unloadable = unloadable
        self._start_timeout = start_timeout
        self._close_timeout = close_timeout
        self._commit_timeout = commit_timeout
        self._staging_bytes = staging_bytes
        self._pipeline: Pipeline | None = None
        self.staging_cap = 0
        """The staging cap in force once started: ``staging_bytes``, or the default cap."""
        self.staging_room = 0
        """What :attr:`staging_cap` leaves for staged bytes beside the writer's large
        buffers (:func:`~aoffload.checkpoint.writer.calls.staging_room`)."""
        self._commits: DaemonThreadExecutor | None = None
        self._loads: DaemonThreadExecutor | None = None
        self._tag_bytes = layout.MAX_TAG_BYTES
        self._running = False
        self._closed = False
        self._failure: str | None = None

    @property
    def pid(self) -> int | None:
        """The writer's process id while it runs, else ``None`` (always for a replica)."""
        return self.writer.pid if self.writer is not None and self._running else None

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Scan the directory (cleaning a crash's leftovers), start the writer (blocking).

        With ranks this is a collective. A failed start releases everything it took.
        """
        if self._running or self._closed:
            raise ClosedError("this checkpoint engine was already started; create a new one")
        try:
            self.tier.spawn()  # its process starts while the directory is scanned
            found = self.tier.join(self.coordinator.join())
            self.catalog.found(found)
            self._tag_bytes = layout.tag_limit(self.directory)
            self._commits = DaemonThreadExecutor("aoffload-commit")
            self._loads = DaemonThreadExecutor("aoffload-load")
            if self.writer is not None:
                shm.remove_dead()  # what SIGKILLed trainers left in /dev/shm
                chosen, latest = self._staging_bytes, read.latest_bytes(self.directory, found)
                cap = chosen or default_cap(self.coordinator.together)
                self.staging_cap, self.staging_room = cap, staging_room(cap)
                shm.check_room(latest, self._max_pending, cap, chosen is not None)
                self.writer.start(self._start_timeout)
                self._pipeline = Pipeline(self.tags, self.writer, cap, self._unloadable)
            self.coordinator.arm()
        except BaseException:
            self.close()
            raise
        self._running = True

    def check_running(self) -> None:
        """Raise why the engine cannot save or commit now (closed, or its writer died)."""
        if not self._running:
            raise ClosedError("the checkpoint engine is not running")
        if self.writer is not None:
            self.writer.check_running()

    # -- stage and commit ----------------------------------------------------------------

    def stage(self, state: object, name: str, tag: str) -> FileJob | None:
        """Start staging ``state`` as file ``name`` of ``tag``; its job (``None``: a replica).

        Validates here (bad names and tags raise :class:`InvalidStateError` at once) and
        records each tensor's version counter; the rest runs on the pipeline's threads.
        """
        self.tags.raise_background()
        self.check_running()
        name, tag = layout.validate_name(name), layout.validate_tag(tag, self._tag_bytes)
        if self._pipeline is None:  # a replica writes nothing
            if self.catalog.committed(tag):
                raise InvalidStateError(f"checkpoint {tag!r} is already committed; use a new tag")
            return None
        job = self.tags.add_file(tag, name, self.catalog.committed)
        try:
            self._pipeline.stage(job, state)
        except BaseException as exc:
            self.tags.failed(job, exc)
            self.tags.seen(job, exc)  # raised here, to the caller
            raise
        return job

    def seal(self, job: FileJob) -> None:
        """The fence, on the thread that owns the state: after ``job``'s copy has ended,
        raise if any of its tensors was modified in place since ``stage()`` was called.

        The copy threads check the version counters when the copy ends, but an in-place
        operation still running then bumps its counter only when it finishes; the thread
        that awaits the fence has finished all of its own. So a counter that moved by now
        fails the file (whether the modification overlapped the copy or followed it, which
        nobody can tell apart), and its tag can no longer be published: it is discarded.
        Idempotent; raises what the staging raised. Warns (once) when the file holds a
        value that the default load cannot read back (``unloadable="warn"``).
        (:meth:`.pipeline.Pipeline.fence` checks; this discards the tag.)
        """
        error = self._pipeline.fence(job) if self._pipeline is not None else None
        if error is None:
            return
        if self.tags.poison(job, error) and self._commits is not None:
            with contextlib.suppress(ClosedError):  # the commit discards the tag
                self.tags.commit_seen(self._start_commit(job.open_tag.tag, True))
        raise error

    def commit(
        self, tag: str | None = None, latest: bool = True, metadata: object = None
    ) -> concurrent.futures.Future[Any]:
        """Start (or find) the commit of ``tag``; the future of its :class:`CommitResult`.

        The engine owns the commit: a failure nobody sees through the future is raised by
        the engine's next call (:meth:`Tags.raise_background`). Raises at once what makes
        the commit impossible (:class:`InvalidStateError`: nothing saved, ``metadata``
        that JSON cannot hold; a dead writer).
        """
        self.tags.raise_background()
        self.check_running()
        return self._start_commit(tag, latest, _metadata.validate(metadata))

    def _start_commit(
        self, tag: str | None, latest: bool, metadata: _metadata.Metadata | None = None
    ) -> concurrent.futures.Future[Any]:
        if tag is not None:
            tag = layout.validate_tag(tag, self._tag_bytes)
            done = self.catalog.result(tag)
            if done is not None:
                if metadata is not None and metadata != done.metadata:
                    raise InvalidStateError(
                        f"checkpoint {tag!r} was committed with metadata {done.metadata!r}; "
                        "a later commit() of it cannot change that"
                    )
                return _done(done)
        together = self.coordinator.together
        if self.writer is None and not together:  # a replica alone: nothing to commit
            named = tag or ""
            path = self.directory / named
            return _done(CommitResult(named, path, (), 0, 0.0, 0.0, 0.0, metadata or {}))
        open_tag, started = self.tags.begin_commit(tag, empty_ok=together, metadata=metadata)
        future = open_tag.commit
        if future is None:  # pragma: no cover - begin_commit always sets it
            raise RuntimeError("a commit without a future")
        if started:
            self.tags.own(future)
            if self._commits is None:
                raise ClosedError("the checkpoint engine is not running")
            follower = self.tier.follow(open_tag, latest, self.tags)
            self._commits.submit(self._run_commit, open_tag, follower, time.perf_counter(), latest)
        return future

    def _run_commit(
        self, open_tag: OpenTag, follower: Follower, started: float, latest: bool
    ) -> None:
        """One commit, on the commit thread; resolves ``open_tag.commit``.

        A tag that succeeded frees its staging slot before its future resolves (its writes
        have ended); one that failed, once the coordinator has removed it.
        """
        future = open_tag.commit
        if future is None:  # pragma: no cover - begin_commit always sets it
            return
        ended = False

        def resolve(published: Published | None, error: BaseException | None) -> None:
            nonlocal ended
            if published is not None:
                ended = True
                self.tags.end_commit(open_tag, published=True)
                future.set_result(published.result)
                follower.committed(published)
            else:
                failure = error or RuntimeError(f"the commit of {open_tag.tag!r} had no outcome")
                future.set_exception(failure)
                follower.failed(failure)

        try:
            try:
                follower.early()
            except Exception:
                logger.exception("checkpoint %r: its early uploads could not start", open_tag.tag)
            self.coordinator.commit(open_tag, started, latest, resolve)
        except BaseException as exc:  # a coordinator that raised: the commit's failure
            if not future.done():
                resolve(None, exc)
            else:  # after the outcome (in what follows it): nobody waits on this thread
                logger.exception("checkpoint %r: what followed its commit failed", open_tag.tag)
        finally:
            if not future.done():  # pragma: no cover - every coordinator resolves
                resolve(None, None)
            if not ended:
                self.tags.end_commit(open_tag, published=False)

    def metadata(self, tag: str | None = None) -> _metadata.Metadata:
        """A copy of committed ``tag``'s metadata (default: the tag ``latest`` names).

        Read from what the engine knows (the manifests it scanned at start, its own
        commits): no I/O. ``{}`` for a tag committed without metadata; raises
        :class:`CheckpointError` when ``tag`` is not committed or nothing is.
        """
        return self.catalog.metadata(None if tag is None else layout.validate_tag(tag))

    def remove(
        self, tag: str, before: Callable[[], None] | None = None
    ) -> concurrent.futures.Future[bool]:
        """Delete committed ``tag`` once the commits requested before this call have ended.

        Runs on the commit thread, after those commits: a checkpoint is deleted only
        once the newer ones are durable. If one of them failed, ``tag`` is kept (logged
        at WARNING) and the future resolves to ``False``; likewise when ``tag`` is not
        committed. ``before()`` runs on the commit thread just before the deletion. Where
        ``latest`` names ``tag``, it moves to the newest other tag first.
        """
        self.tags.raise_background()
        self.check_running()
        tag = layout.validate_tag(tag)
        if self._commits is None:
            raise ClosedError("the checkpoint engine is not running")
        earlier = self.tags.commits()
        return self._commits.submit(self.catalog.remove_after, tag, earlier, before)

    # -- load ----------------------------------------------------------------------------

    def load(
        self,
        name: str,
        tag: str | None,
        map_location: MapLocation,
        verify: bool,
        weights_only: bool = True,
    ) -> concurrent.futures.Future[Handoff[Any]]:
        """Load file ``name`` of committed ``tag`` on the load thread, from where the tier
        says it is (:func:`.load.load_from`); the future of it, handed over
        (:class:`Handoff`) so that the load thread never frees the state.

        Reads this engine's own writes: the load thread first waits for the commits
        requested before this call (of ``tag``; with ``tag=None``, every one), so that
        ``latest`` is what they published (or, where one failed, what it was before).
        """
        if not self._running or self._loads is None:
            raise ClosedError("the checkpoint engine is not running")
        earlier = self.tags.commits(tag)

        def load() -> Any:
            concurrent.futures.wait(earlier)  # their failures are theirs: owned, raised later
            where = (self.tier, self.writer, name, tag, self.catalog.latest, self.catalog.tags)
            return load_from(*where, map_location, verify, weights_only)

        return self._loads.submit(Handoff.of(load))

    def uploaded(self, tag: str | None) -> concurrent.futures.Future[Any]:
        """The future of ``tag``'s upload to the remote tier (default: the newest commit)."""
        self.check_running()
        return self.tier.uploaded(None if tag is None else layout.validate_tag(tag))

    # -- close ---------------------------------------------------------------------------

    def failing(self, exc: BaseException) -> None:
        """``exc`` is leaving the code that uses this engine: the close that follows tells
        the other ranks (distributed) that this rank failed, naming ``exc``."""
        if self._failure is None:
            detail = f" ({first_line(exc)})" if str(exc).strip() else ""
            self._failure = f"{type(exc).__name__}{detail} left it"

    def close(self) -> None:
        """Finish the commits in flight, stop the threads and the writer, release everything.

        Blocks. The commits requested (``commit()``, ``commit_soon()``) are waited for, at
        most ``commit_timeout`` seconds in all (then abandoned: :class:`CheckpointError`
        names them, once everything is released). Tags saved but never committed are
        discarded, each logged at WARNING naming it. Raises the failure of a commit nobody
        saw fail, once everything is released. A distributed rank that closes with work
        undone (a tag saved but not committed, an exception leaving the engine, commits
        still running) tells the others at once.
        """
        if self._closed:
            return
        self._closed, self._running = True, False
        open_tags = self.tags.close()
        late: closing.Late = set()
        try:
            late = closing.wait_commits(open_tags, self.tags, self._commit_timeout)
            if self._pipeline is not None:
                self._pipeline.close()  # no copy touches staging memory after this
            closing.say_discarded(open_tags)
        finally:
            self._release(open_tags, closing.unfinished(open_tags, late, self._failure))
        self.tags.raise_background()
        error = closing.abandoned(open_tags, late, self._commit_timeout, self.catalog.latest)
        if error is not None:
            raise error

    def _release(self, open_tags: list[OpenTag], unfinished: str | None) -> None:
        """In this order: the tier (the uploads in flight, bounded by upload_timeout), the
        writer (it drains what was sent first), the others told, the threads, the staging
        memory; the directory's locks last: nothing of this engine writes any more."""
        try:
            self.tier.close()
        finally:
            try:
                self.coordinator.disarm()  # an orderly close: nobody speaks for this one
                if self.writer is not None:
                    self.writer.stop()
                    self.writer.release()
            finally:
                try:
                    self.coordinator.leave(unfinished)  # never waits on a dead peer
                finally:
                    if self._commits is not None:
                        self._commits.shutdown(wait=False)
                    self.catalog.close()
                    for open_tag in open_tags:
                        if open_tag.commit is None:
                            write.remove_tree(open_tag.tmpdir)
                    self.tags.release()
                    if self._loads is not None:
                        self._loads.shutdown(wait=False)
                    self.coordinator.release()
