"""Asynchronous, snapshot-consistent, crash-safe checkpoints: :class:`CheckpointEngine`.

``stage()`` returns at once while the state is planned on the engine's I/O thread and its
tensors are copied into shared staging memory by a pool of threads (:mod:`._stager`,
:mod:`._copy`); ``await engine.save()`` is ``await engine.stage()``. A spawned writer process
(:mod:`._writer`) turns the staged tensors into plain ``torch.save`` files while training
goes on. ``commit()`` waits until every file of a tag is durable, then publishes it
(:func:`._store.publish`, one call on the I/O thread); ``commit_soon()`` does it in the
background, owned by the engine. See :mod:`._store` for the on-disk protocol.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from pathlib import Path
from typing import Any

from .._errors import AoffloadError, ClosedError, InvalidStateError
from .._runtime.bridge import Bridge
from .._runtime.resource import AsyncResource
from .._runtime.threads import DaemonThreadExecutor
from . import _load, _lock, _store
from ._commit import Catalog, CommitResult
from ._committer import Committer
from ._distributed import Ranks
from ._stager import Staged, Stager
from ._writer import TARGET, WriterConfig

__all__ = ["CheckpointEngine", "CommitResult", "Staged"]

logger = logging.getLogger(__name__)


def _scan_alone(directory: Path, writer: bool) -> tuple[_lock.DirectoryLock | None, _store.Scan]:
    """Scan ``directory`` at the start of a single-process engine (blocks: the I/O thread).

    A writer creates the directory and takes the directory lock (see :mod:`._lock`), held
    shared while the engine lives; leftovers of dead runs are removed only by an engine
    alone in the directory. A replica only reads.
    """
    if not writer:
        return None, _store.scan(directory, clean=False)
    directory.mkdir(parents=True, exist_ok=True)
    return _lock.hold_shared(directory, lambda sole: _store.scan(directory, clean=sole))


class CheckpointEngine(AsyncResource):
    """Snapshot-consistent asynchronous checkpoints written by a spawned writer process.

    Use as ``async with CheckpointEngine(directory) as engine:``; see :meth:`stage`,
    :meth:`save`, :meth:`commit`, :meth:`commit_soon` and :meth:`load`. ``keep_last``
    keeps that many newest committed tags (``None``: all). ``max_pending`` bounds the
    checkpoints staged but not yet durable (each holds staging memory the size of its
    tensors). ``writer=False`` makes a replica that validates names and writes nothing.
    ``durable=False`` skips fsync (tests, scratch runs). Tags are ordered by commit: each
    manifest records a sequence number one above the highest found in ``directory``.

    ``distributed=True`` makes one checkpoint of every rank of a ``torch.distributed``
    job (see :mod:`._distributed`): ``start()`` and ``commit()`` are collectives, each
    rank saves its own files, and ``commit_timeout`` bounds the wait for a rank that
    never reports.
    """

    _what = "this CheckpointEngine"

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
    ) -> None:
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be None or an int >= 1, not {keep_last!r}")
        if not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending must be an int >= 1, not {max_pending!r}")
        super().__init__()
        self._directory = Path(directory)
        self._writer = writer
        self._close_timeout = close_timeout
        config = WriterConfig(durable=durable, direct_io=direct_io)
        self._bridge = (
            Bridge(
                TARGET,
                config,
                name="checkpoint-writer",
                start_timeout=start_timeout,
                close_timeout=close_timeout,
            )
            if writer
            else None
        )
        self._io: DaemonThreadExecutor | None = None
        self._lock: _lock.DirectoryLock | None = None
        self._stager = Stager(self._directory, max_pending)
        self._open_tags = self._stager.open_tags
        self._catalog = Catalog(self._directory, durable=durable, keep_last=keep_last)
        self._ranks = (
            Ranks(self._directory, writer=writer, durable=durable, timeout=commit_timeout)
            if distributed
            else None
        )
        self._commits = Committer(
            self._directory, self._stager, self._catalog, self._bridge, self._ranks, self._run_io
        )

    # -- introspection -----------------------------------------------------------------

    @property
    def directory(self) -> Path:
        """The checkpoint directory."""
        return self._directory

    @property
    def pid(self) -> int | None:
        """The writer's process id while it runs, else ``None`` (always for a replica)."""
        return self._bridge.pid if self._bridge is not None else None

    def latest(self) -> str | None:
        """The newest committed tag (what ``latest`` names), or ``None``."""
        return self._catalog.latest

    def tags(self) -> list[str]:
        """Committed tags, oldest first (by commit order), as of start and own commits."""
        return list(self._catalog.tags)

    # -- lifecycle ----------------------------------------------------------------------

    def _executor(self) -> DaemonThreadExecutor:
        if self._io is None:
            raise ClosedError(f"{self._what} was never started")
        return self._io

    async def _run_io(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor(), fn, *args)

    async def _open(self) -> None:
        """Scan the directory (cleaning a crash's leftovers) and start the writer."""
        self._io = DaemonThreadExecutor("aoffload-checkpoint-io")
        found: _store.Scan
        if self._ranks is not None:  # a collective start; rank 0 alone may clean (see _lock)
            found = await self._ranks.start()
        else:
            self._lock, found = await self._run_io(_scan_alone, self._directory, self._writer)
        self._catalog.found(found)
        if self._bridge is not None:
            await self._run_io(self._stager.start)
            await self._bridge.start()

    async def _close(self) -> None:
        """Finish commits in flight, stop the writer, release staging memory.

        Tags saved but never committed are discarded (logged at WARNING).
        """
        try:
            commits = [t.commit for t in self._open_tags.values() if t.commit is not None]
            if commits:
                _, late = await asyncio.wait(commits, timeout=self._close_timeout)
                for task in late:
                    task.cancel()
            await self._stager.drain()
            for tag in self._open_tags:
                logger.warning("checkpoint %r was saved but never committed; discarded", tag)
        finally:
            try:
                if self._bridge is not None:
                    await self._bridge.aclose()
            finally:
                if self._ranks is not None:  # tell the peers; settle discarded writes
                    await self._ranks.close(
                        writer_died=self._bridge is not None and self._bridge.dead
                    )
                await self._catalog.close()
                for open_tag in list(self._open_tags.values()):
                    await self._run_io(_store.remove_tree, open_tag.tmpdir)
                self._open_tags.clear()
                await self._run_io(self._stager.close)
                self._executor().shutdown(wait=True)  # idle: its last call just returned
                if self._lock is not None:
                    self._lock.release()  # last: nothing of this engine writes any more
        self._stager.raise_background()

    def _check_writer(self) -> None:
        """Raise why the engine cannot save or commit now (closed, or its writer died)."""
        self.check_running()
        if self._bridge is not None:
            self._bridge.check_running()

    # -- save ---------------------------------------------------------------------------

    def stage(self, state: object, name: str, *, tag: str) -> Staged:
        """Start snapshotting ``state`` as file ``name`` of checkpoint ``tag``; return at once.

        Not a coroutine: it validates ``name`` and ``tag`` and starts the copy off the event
        loop. ``await`` the returned :class:`Staged` before mutating any tensor of ``state``:
        until it resolves they are being copied (a tensor mutated in place meanwhile fails
        the staging with :class:`CheckpointError` naming its key; nothing torn is written).
        Several calls with one ``tag`` form one checkpoint. The file is written in the
        background; write errors surface from :meth:`commit`. While ``max_pending``
        checkpoints are staged and not yet durable, the copy waits for room; it fails
        (``CheckpointError``) when none of them is being committed. Raises
        :class:`InvalidStateError` for a bad name or tag here, and from ``await`` naming the
        key for bad input; :class:`WorkerDiedError` if the writer died; the failure of a
        :meth:`commit_soon` commit.
        """
        self._stager.raise_background()
        self._check_writer()
        name, tag = _store.validate_name(name), _store.validate_tag(tag)
        if self._catalog.committed(tag):
            raise InvalidStateError(f"checkpoint {tag!r} is already committed; use a new tag")
        if self._bridge is None:
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return Staged(done, None, name, tag)
        return self._stager.stage(self._bridge, self._executor(), state, name, tag)

    async def save(self, state: object, name: str, *, tag: str) -> None:
        """Snapshot ``state`` as file ``name`` of checkpoint ``tag``: ``await self.stage(...)``.

        When this returns, every tensor has been copied into staging memory: the caller
        may mutate or free it at once.
        """
        await self.stage(state, name, tag=tag)

    # -- commit -------------------------------------------------------------------------

    async def commit(self, tag: str | None = None, *, latest: bool = True) -> CommitResult:
        """Make checkpoint ``tag`` durable and publish it (and ``latest``); see :mod:`._store`.

        ``tag=None`` commits the single open tag; ``latest=False`` publishes the tag
        without moving ``latest``. It first waits for the tag's staging. Cancelling the
        awaiting task abandons the wait only: the commit goes on, and a later
        ``commit(tag)`` returns its result. Raises :class:`InvalidStateError` when nothing
        was saved under ``tag``, :class:`CheckpointError` naming the file when a staging
        or a write failed (the tag is discarded, ``latest`` unchanged),
        :class:`WorkerDiedError` if the writer died. With ``distributed=True`` every rank
        calls it with the same tags in the same order; a rank that saved nothing under
        ``tag`` takes part with no files, and a failure on any rank raises on every rank
        (:class:`CheckpointError` naming it).
        """
        self._stager.raise_background()
        self._check_writer()
        requested = self._commits.request(tag, latest)
        if isinstance(requested, CommitResult):
            return requested
        try:
            return await asyncio.shield(requested)
        except AoffloadError:
            self._stager.seen(requested)  # raised here: not again from the next call
            raise

    def commit_soon(self, tag: str | None = None) -> None:
        """Commit ``tag`` in the background; the engine owns the commit. Returns at once.

        Use it where the trainer does not await the commit: a later :meth:`stage` waits for
        room (``max_pending``) while it runs, its failure is raised from the engine's next
        :meth:`stage`, :meth:`save`, :meth:`commit` or ``aclose()``, and ``commit(tag)``
        returns its result. Raises what :meth:`commit` raises before it starts.
        """
        self._stager.raise_background()
        self._check_writer()
        requested = self._commits.request(tag, True)
        if not isinstance(requested, CommitResult):
            self._stager.background(requested)

    # -- load ---------------------------------------------------------------------------

    async def load(
        self,
        name: str,
        *,
        tag: str | None = None,
        map_location: _store.MapLocation = "cpu",
        verify: bool = True,
    ) -> Any:
        """Load file ``name`` of committed checkpoint ``tag`` (default: the newest).

        Verified against the manifest (``CorruptCheckpointError`` naming the file on a
        mismatch), loaded with ``weights_only=True`` off the event loop.
        """
        self.check_running()
        remote, executor = functools.partial(_load.in_writer, self._bridge), self._executor()
        return await _load.load(self._directory, name, tag, map_location, verify, executor, remote)
