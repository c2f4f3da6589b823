"""The checkpoint engine itself, as any thread sees it: synchronous and thread-safe.

:class:`EngineCore` owns everything a checkpoint engine is made of, and its threads do all
the work; nothing in it needs an event loop. :class:`~._engine.CheckpointEngine` is its
asyncio face and the DeepSpeed adapter (:mod:`aoffload.deepspeed`) uses it directly.

===================  ==============================================================
thread               work
===================  ==============================================================
the caller's         ``stage()``: validation, version counters, the job handed over;
                     ``commit()``: which tag, its future, the commit handed over
stage thread         plan, wait for a staging slot, reserve space (:mod:`._pipeline`)
copy pool            the GIL-free copy, the version check, the hand-off to the writer
writer process       ``torch.save`` into ``O_DIRECT`` files, fsync (:mod:`.writer`)
commit thread        one commit at a time, in request order: wait for the writes,
                     fsync, publish, ``latest``, retention (:mod:`._commit`), with
                     every rank (:mod:`._distributed`)
load thread          verify and load (:mod:`._load`); from the remote tier
                     through its cache (:mod:`._upload`)
trash thread         deleting retired tags
upload thread        with ``remote=``: each committed tag, in commit order, through
                     the uploader process (:mod:`._upload`, :mod:`.remote`)
preemption threads   a preemption notice's announcer and watcher (:mod:`._agreement`)
===================  ==============================================================

The tags in flight have one owner, :class:`~._tags.Tags`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from ..._errors import CheckpointError, ClosedError, InvalidStateError
from ..._runtime.core import WorkerCore
from ..._runtime.threads import DaemonThreadExecutor, Handoff, running_future
from ..format import layout, read, write
from ..format import layout as _untrusted
from ..format import lock as _lock
from ..format import metadata as _metadata
from ..format import shm as _shm
from ..preemption.notice import PreemptionNotice, signal_set
from ..ranks.commit import Ranks
from ..ranks.rendezvous import first_line
from ..remote.ranks import SpreadRanks
from ..remote.resume import load_either
from ..remote.tier import RemoteTier
from ..writer import TARGET
from ..writer.calls import WriterConfig
from .commit import Catalog, CommitResult, commit_local
from .load import MapLocation, in_writer, load_file
from .pipeline import Pipeline, Unloadable
from .plan import modified
from .tags import FileJob, OpenTag, Tags

__all__ = ["EngineCore"]

logger = logging.getLogger(__name__)


def _scan_alone(directory: Path, writer: bool) -> tuple[_lock.DirectoryLock | None, layout.Scan]:
    """Scan ``directory`` at the start of a single-process engine.

    A writer creates the directory and takes the directory locks (see :mod:`._lock`):
    the writer lock, which refuses a second live writer, and the shared lock, held while
    the engine lives; leftovers of dead runs are removed only by an engine alone in the
    directory. A replica only reads. An OS error is a :class:`CheckpointError` naming it.
    """
    try:
        if not writer:
            return None, read.scan(directory, clean=False)
        directory.mkdir(parents=True, exist_ok=True)
        return _lock.hold_shared(
            directory, lambda sole: read.scan(directory, clean=sole), writer=True
        )
    except OSError as exc:
        raise CheckpointError(f"cannot use {directory} as a checkpoint directory: {exc}") from exc


def _latest_bytes(directory: Path, found: layout.Scan) -> int:
    """The size of the directory's latest checkpoint (0: none, or unreadable)."""
    if found.latest is None or found.latest not in found.tags:
        return 0
    try:
        manifest = read.read_manifest(directory / found.latest / layout.MANIFEST)
    except (OSError, CheckpointError):
        return 0
    return sum(entry["bytes"] for entry in manifest["files"].values())


def _done(value: Any) -> concurrent.futures.Future[Any]:
    future: concurrent.futures.Future[Any] = running_future()
    future.set_result(value)
    return future


class EngineCore:
    """The engine behind :class:`~aoffload.CheckpointEngine`; see that class for the options."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        max_pending: int = 1,
        writer: bool = True,
        durable: bool = True,
        start_timeout: float = 60.0,
        close_timeout: float = 30.0,
        direct_io: bool = True,
        distributed: bool = False,
        commit_timeout: float = 300.0,
        unloadable: Unloadable = "warn",
        remote: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        upload_timeout: float = 600.0,
        early_uploads: bool = False,
        upload_backoff: float = 0.5,
    ) -> None:
        if unloadable not in ("warn", "error", "ignore"):
            raise ValueError(f"unloadable must be 'warn', 'error' or 'ignore', not {unloadable!r}")
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be None or an int >= 1, not {keep_last!r}")
        if not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending must be an int >= 1, not {max_pending!r}")
        self.directory = Path(directory)
        self._start_timeout = start_timeout
        self._unloadable: Unloadable = unloadable
        self._close_timeout = close_timeout
        config = WriterConfig(durable=durable, direct_io=direct_io)
        self.writer = (
            WorkerCore(TARGET, config, name="checkpoint-writer", close_timeout=close_timeout)
            if writer
            else None
        )
        self.tags = Tags(self.directory, max_pending)
        self._max_pending = max_pending
        self.catalog = Catalog(self.directory, durable=durable, keep_last=keep_last)
        self.remote = (
            RemoteTier(
                self.directory,
                remote,
                storage_options,
                keep_last=keep_last,
                upload_timeout=upload_timeout,
                upload_backoff=upload_backoff,
                early=early_uploads,
                close_timeout=close_timeout,
            )
            if remote is not None
            else None
        )
        self._ranks: Ranks | None = None
        if distributed:  # without a shared filesystem: each rank keeps its files (_spread)
            kind = Ranks if self.remote is None else SpreadRanks
            self._ranks = kind(
                self.directory, writer=writer, durable=durable, timeout=commit_timeout
            )
        if self.remote is not None:
            self.remote.ranks = self._ranks if isinstance(self._ranks, SpreadRanks) else None
            self.catalog.holding = self.remote.holding  # retention waits for an upload
        self._pipeline: Pipeline | None = None
        self._commits: DaemonThreadExecutor | None = None
        self._loads: DaemonThreadExecutor | None = None
        self._lock: _lock.DirectoryLock | None = None
        self._tag_bytes = _untrusted.MAX_TAG_BYTES
        self._notice: PreemptionNotice | None = None
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

        With ``distributed=True`` this is a collective. A failed start releases
        everything it took.
        """
        if self._running or self._closed:
            raise ClosedError("this checkpoint engine was already started; create a new one")
        try:
            if self.remote is not None:
                self.remote.spawn()  # it starts while the directory is scanned
            if self._ranks is not None:  # rank 0 alone may clean (see _lock)
                found = self._ranks.start()
            else:
                self._lock, found = _scan_alone(self.directory, self.writer is not None)
            if self.remote is not None:
                found = self.remote.join(self._start_timeout, found)
            self.catalog.found(found)
            self._tag_bytes = _untrusted.tag_limit(self.directory)
            self._commits = DaemonThreadExecutor("aoffload-commit")
            self._loads = DaemonThreadExecutor("aoffload-load")
            if self.writer is not None:
                _shm.remove_dead()  # what SIGKILLed trainers left in /dev/shm
                _shm.check_room(_latest_bytes(self.directory, found), self._max_pending)
                self.writer.start(self._start_timeout)
                self._pipeline = Pipeline(self.tags, self.writer, self._unloadable)
            if self._ranks is not None:
                self._ranks.watch(self.writer)
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
        """
        job.staged.result()
        if job.sealed is not False:
            if isinstance(job.sealed, BaseException):
                raise job.sealed
            return
        # The check is the plan's last use: drop it, so that the tag, alive until it is
        # published, does not keep the caller's tensors alive too.
        planned, job.plan = job.plan, None
        moved = None if planned is None else modified(planned)
        if moved is None:
            job.sealed = True
            if planned is not None and planned.unloadable is not None:
                warnings.warn(
                    f"{planned.unloadable}. CheckpointEngine(unloadable='error') makes this "
                    "an error, unloadable='ignore' silences it",
                    UserWarning,
                    stacklevel=3,
                )
            return
        key, before, after = moved
        error = CheckpointError(
            f"cannot save {job.name!r}: {key} was modified in place after stage() and before "
            f"`await staged` (its version counter moved from {before} to {after}); checkpoint "
            f"{job.open_tag.tag!r} is discarded. Do not modify staged tensors until the fence "
            "(`await staged`, or save()) has returned; a module in training mode updates its "
            "running statistics (BatchNorm's) in its forward pass: fence before it"
        )
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
        if self.writer is None and self._ranks is None:
            named = tag or ""
            path = self.directory / named
            return _done(CommitResult(named, path, (), 0, 0.0, 0.0, 0.0, metadata or {}))
        open_tag, started = self.tags.begin_commit(
            tag, empty_ok=self._ranks is not None, metadata=metadata
        )
        future = open_tag.commit
        if future is None:  # pragma: no cover - begin_commit always sets it
            raise RuntimeError("a commit without a future")
        if started:
            self.tags.own(future)
            if self._commits is None:
                raise ClosedError("the checkpoint engine is not running")
            if self.remote is not None:
                start_early = self.remote.follow(
                    open_tag, future, latest, self.tags.own, self.tags.commit_seen
                )
                if self.remote.early:  # each file's upload starts from the commit thread
                    self._commits.submit(start_early)
            self._commits.submit(self._run_commit, open_tag, time.perf_counter(), latest)
        return future

    def _run_commit(self, open_tag: OpenTag, started: float, latest: bool) -> None:
        """One commit, on the commit thread; resolves ``open_tag.commit``."""
        future = open_tag.commit
        if future is None:  # pragma: no cover - begin_commit always sets it
            return
        if self._ranks is not None:

            def resolve(result: CommitResult | None, error: BaseException | None) -> None:
                if error is None:
                    future.set_result(result)
                else:
                    future.set_exception(error)

            try:
                self._ranks.commit(open_tag, self.writer, self.catalog, started, latest, resolve)
            finally:
                self.tags.end_commit(open_tag, published=future.exception() is None)
            return
        try:
            result = commit_local(open_tag, self.writer, self.catalog, started, latest)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever awaits the commit
            self.tags.end_commit(open_tag, published=False)
            future.set_exception(exc)
        else:
            self.tags.end_commit(open_tag, published=True)
            future.set_result(result)

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

    # -- preemption ----------------------------------------------------------------------

    @property
    def notice(self) -> PreemptionNotice | None:
        """The preemption notice, once :meth:`preemption` made it."""
        return self._notice

    def preemption(self, signals: Iterable[int]) -> PreemptionNotice:
        """This engine's preemption notice, listening for ``signals`` (made on first call)."""
        self.check_running()
        if self._notice is not None:
            if self._notice.signals != signal_set(signals):
                raise InvalidStateError(
                    f"this engine's preemption notice listens for {self._notice.signals}; "
                    "it cannot listen for other signals"
                )
            return self._notice
        notice = PreemptionNotice(signals, self._ranks.rendezvous if self._ranks else None)
        notice.start()
        self._notice = notice
        return notice

    # -- load ----------------------------------------------------------------------------

    def load(
        self,
        name: str,
        tag: str | None,
        map_location: MapLocation,
        verify: bool,
        weights_only: bool = True,
    ) -> concurrent.futures.Future[Handoff[Any]]:
        """Load file ``name`` of committed ``tag`` on the load thread; the future of it,
        handed over (:class:`Handoff`) so that the load thread never frees the state."""
        if not self._running or self._loads is None:
            raise ClosedError("the checkpoint engine is not running")
        loader = in_writer(self.writer)
        call: Callable[[], Any]
        if self.remote is not None:
            latest, known = self.catalog.latest, self.catalog.tags
            call = functools.partial(
                load_either, self.remote, name, tag, latest, known, map_location, verify,
                loader, weights_only,
            )  # fmt: skip
        else:
            call = functools.partial(
                load_file, self.directory, name, tag, map_location, verify, loader, weights_only
            )
        return self._loads.submit(Handoff.of(call))

    def uploaded(self, tag: str | None) -> concurrent.futures.Future[Any]:
        """The future of ``tag``'s upload to the remote tier (default: the newest commit)."""
        self.check_running()
        if self.remote is None:
            raise InvalidStateError("this engine has no remote tier (CheckpointEngine(remote=...))")
        return self.remote.uploaded(None if tag is None else layout.validate_tag(tag))

    # -- close ---------------------------------------------------------------------------

    def failing(self, exc: BaseException) -> None:
        """``exc`` is leaving the code that uses this engine: the close that follows tells
        the other ranks (distributed) that this rank failed, naming ``exc``."""
        if self._failure is None:
            detail = f" ({first_line(exc)})" if str(exc).strip() else ""
            self._failure = f"{type(exc).__name__}{detail} left it"

    def close(self) -> None:
        """Finish the commits in flight, stop the threads and the writer, release everything.

        Blocks. Tags saved but never committed are discarded (logged at WARNING). Raises
        the failure of a commit nobody saw fail, once everything is released. A
        distributed rank that closes with work undone (a tag saved but not committed, an
        exception leaving the engine, commits still running) tells the others at once.
        """
        if self._closed:
            return
        self._closed, self._running = True, False
        if self._notice is not None:
            self._notice.close()
        open_tags = self.tags.close()
        late: set[concurrent.futures.Future[Any]] = set()
        try:
            commits = [t.commit for t in open_tags if t.commit is not None]
            _, late = concurrent.futures.wait(commits, timeout=self._close_timeout)
            if late:
                logger.warning(
                    "closing with %d commits still running after close_timeout=%s s",
                    len(late),
                    self._close_timeout,
                )
            if self._pipeline is not None:
                self._pipeline.close()  # no copy touches staging memory after this
            for open_tag in open_tags:
                if open_tag.commit is None and open_tag.files:
                    logger.warning(
                        "checkpoint %r was saved but never committed; discarded", open_tag.tag
                    )
        finally:
            self._release(open_tags, self._unfinished(open_tags, late))
        self.tags.raise_background()

    def _unfinished(
        self, open_tags: list[OpenTag], late: set[concurrent.futures.Future[Any]]
    ) -> str | None:
        """Why this rank leaves work undone (for the peers), or ``None``."""
        saved = [t.tag for t in open_tags if t.commit is None and t.files]
        if self._failure is not None:
            return self._failure
        if saved:
            return f"checkpoint(s) {saved} saved but never committed"
        if late:
            return f"{len(late)} commit(s) still running after close_timeout"
        return None

    def _release(self, open_tags: list[OpenTag], unfinished: str | None = None) -> None:
        try:
            if self.remote is not None:
                self.remote.close()  # the uploads in flight, bounded by upload_timeout
        finally:
            self._release_local(open_tags, unfinished)

    def _release_local(self, open_tags: list[OpenTag], unfinished: str | None) -> None:
        try:
            if self._ranks is not None:
                self._ranks.disarm(self.writer)  # an orderly close: this rank speaks itself
            if self.writer is not None:
                self.writer.stop()  # the writer drains what was sent first
                self.writer.release()
        finally:
            try:
                if self._ranks is not None:  # tell the peers; never wait on a dead one
                    dead = self.writer is not None and self.writer.death is not None
                    self._ranks.close(writer_died=dead, unfinished=unfinished)
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
                if self._lock is not None:
                    self._lock.release()  # last: nothing of this engine writes any more
