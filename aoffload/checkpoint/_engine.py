"""Asynchronous, snapshot-consistent, crash-safe checkpoints: :class:`CheckpointEngine`.

``save()`` plans the state and copies every tensor into shared staging memory on the
engine's I/O thread, then returns; a spawned writer process (:mod:`._writer`) turns the
staged tensors into plain ``torch.save`` files while training goes on. ``commit()``
waits until every file of a tag is durable, then publishes it (:func:`._store.publish`,
one call on the I/O thread). See :mod:`._store` for the on-disk protocol.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._errors import ClosedError, InvalidStateError
from .._runtime.bridge import Bridge
from .._runtime.resource import AsyncResource
from .._runtime.threads import DaemonThreadExecutor, mark_retrieved
from . import _store
from ._commit import Catalog, CommitResult, commit_one
from ._distributed import Ranks
from ._plan import Plan, copy_into, plan
from ._staging import Segment, SlotPool
from ._writer import TARGET, FileRecord, MapSegment, TensorRecord, WriteFile, WriterConfig

__all__ = ["CheckpointEngine", "CommitResult"]

logger = logging.getLogger(__name__)


@dataclass
class _OpenTag:
    """A tag with files staged or being written, not yet published."""

    tag: str
    tmpdir: Path
    slot: Any
    writes: dict[str, asyncio.Future[FileRecord]] = field(default_factory=dict)
    staging: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    stage_seconds: float = 0.0
    commit: asyncio.Task[CommitResult] | None = None


class CheckpointEngine(AsyncResource):
    """Snapshot-consistent asynchronous checkpoints written by a spawned writer process.

    Use as ``async with CheckpointEngine(directory) as engine:``; see :meth:`save`,
    :meth:`commit` and :meth:`load`. ``keep_last`` keeps that many newest committed tags
    (``None``: all). ``max_pending`` bounds the checkpoints staged but not yet durable
    (each holds staging memory the size of its tensors). ``writer=False`` makes a
    replica that validates names and writes nothing. ``durable=False`` skips fsync
    (tests, scratch runs). Tags are ordered by commit: each manifest records a sequence
    number one above the highest found in ``directory``.

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
        self._slots = SlotPool(max_pending)
        self._save_lock = asyncio.Lock()
        self._open_tags: dict[str, _OpenTag] = {}
        self._catalog = Catalog(self._directory, durable=durable, keep_last=keep_last)
        self._last_commit: asyncio.Task[CommitResult] | None = None
        self._ranks = (
            Ranks(self._directory, writer=writer, durable=durable, timeout=commit_timeout)
            if distributed
            else None
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
        if self._writer:
            await self._run_io(lambda: self._directory.mkdir(parents=True, exist_ok=True))
        # -- distributed (issue #11): a collective start; only rank 0 may clean ----------
        if self._ranks is not None:
            found: _store.Scan = await self._ranks.start()
        else:
            found = await self._run_io(lambda: _store.scan(self._directory, clean=self._writer))
        # -- end distributed ---------------------------------------------------------------
        self._catalog.found(found)
        if self._bridge is not None:
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
            for tag in self._open_tags:
                logger.warning("checkpoint %r was saved but never committed; discarded", tag)
        finally:
            try:
                if self._bridge is not None:
                    await self._bridge.aclose()
            finally:
                # -- distributed (issue #11): tell peers, settle discarded writes ----------
                if self._ranks is not None:
                    await self._ranks.close(
                        writer_died=self._bridge is not None and self._bridge.dead
                    )
                # -- end distributed -----------------------------------------------------------
                await self._catalog.close()
                for open_tag in list(self._open_tags.values()):
                    await self._run_io(_store.remove_tree, open_tag.tmpdir)
                self._open_tags.clear()
                await self._run_io(self._slots.close)
                self._executor().shutdown(wait=True)  # idle: its last call just returned

    def _check_writer(self) -> None:
        """Raise why the engine cannot save or commit now (closed, or its writer died)."""
        self.check_running()
        if self._bridge is not None:
            self._bridge.check_running()

    # -- save ---------------------------------------------------------------------------

    async def save(self, state: object, name: str, *, tag: str) -> None:
        """Snapshot ``state`` as file ``name`` of checkpoint ``tag``; return once copied.

        ``state`` is any nesting of dict/list/tuple holding tensors and picklable values.
        When this returns, every tensor has been copied into staging memory: the caller
        may mutate or free it at once. The file is written in the background; write
        errors surface from :meth:`commit`. Waits while ``max_pending`` checkpoints are
        staged and not yet durable. Raises :class:`InvalidStateError` naming the key or
        file for bad input, :class:`WorkerDiedError` if the writer died.
        """
        self._check_writer()
        name, tag = _store.validate_name(name), _store.validate_tag(tag)
        if self._catalog.committed(tag):
            raise InvalidStateError(f"checkpoint {tag!r} is already committed; use a new tag")
        if self._bridge is None:
            return
        planned: Plan = await self._run_io(plan, state, name)
        async with self._save_lock:
            open_tag = self._open_tags.get(tag)
            created = open_tag is None
            if open_tag is None:
                slot = await self._slots.acquire(lambda: self._no_room(tag))
                tmpdir = self._directory / f"{_store.TMP_PREFIX}{tag}-{uuid.uuid4().hex[:8]}"
                open_tag = self._open_tags[tag] = _OpenTag(tag, tmpdir, slot)
                open_tag.idle.set()
            if open_tag.commit is not None:
                raise InvalidStateError(f"checkpoint {tag!r} is being committed; use a new tag")
            if name in open_tag.writes:
                raise InvalidStateError(f"file {name!r} was already saved in checkpoint {tag!r}")
            open_tag.staging += 1
            open_tag.idle.clear()
            try:
                await self._stage_and_send(self._bridge, open_tag, name, planned)
            except BaseException:
                if created and not open_tag.writes:
                    self._release(open_tag)  # nothing reached the writer: free the slot again
                raise
            finally:
                open_tag.staging -= 1
                if open_tag.staging == 0:
                    open_tag.idle.set()

    def _no_room(self, tag: str) -> str | None:
        if any(t.commit is not None for t in self._open_tags.values()):
            return None
        return (
            f"cannot stage checkpoint {tag!r}: max_pending={len(self._slots.slots)} "
            f"checkpoints {sorted(self._open_tags)} are staged and none is being "
            "committed; commit one first or raise max_pending"
        )

    async def _stage_and_send(
        self, bridge: Bridge, open_tag: _OpenTag, name: str, planned: Plan
    ) -> None:
        loop = asyncio.get_running_loop()
        # A new segment is reserved and populated page by page (~100 ms per 256 MiB): on
        # the I/O thread, never on the loop. The writer maps it as soon as it exists, even
        # if this save() was cancelled meanwhile, since later saves may use its space.
        allocation = loop.run_in_executor(self._executor(), open_tag.slot.allocate, planned.nbytes)

        def map_new_segment(done: asyncio.Future[tuple[Any, Segment | None]]) -> None:
            if not done.cancelled() and done.exception() is None:
                new_segment = done.result()[1]
                if new_segment is not None:
                    self._map(bridge, new_segment)

        allocation.add_done_callback(map_new_segment)
        region, _ = await asyncio.shield(allocation)
        copy = loop.run_in_executor(self._executor(), copy_into, region, planned)
        # Cancelling save() abandons the wait; the copy ends on the I/O thread, which
        # runs the next copy into this slot only after it.
        open_tag.stage_seconds += await asyncio.shield(copy)
        records = tuple(
            TensorRecord(
                region.offset + offset,
                tensor.numel() * tensor.element_size(),
                tensor.dtype,
                tuple(tensor.shape),
                tensor.requires_grad,
            )
            for tensor, offset in zip(planned.tensors, planned.offsets, strict=True)
        )
        message = WriteFile(
            str(open_tag.tmpdir / name),
            region.segment.path,
            region.offset,
            planned.skeleton_nbytes,
            records,
        )
        future = bridge.call(message)
        future.add_done_callback(mark_retrieved)  # commit() raises it
        open_tag.writes[name] = future

    def _map(self, bridge: Bridge, segment: Segment) -> None:
        def mapped(future: asyncio.Future[None]) -> None:
            segment.unlink()  # mapped in both processes (or the writer is gone): drop the name
            mark_retrieved(future)  # a failed map fails the write that needs it

        try:
            bridge.call(MapSegment(segment.path, segment.size)).add_done_callback(mapped)
        except BaseException:
            segment.unlink()
            raise

    def _release(self, open_tag: _OpenTag) -> None:
        self._open_tags.pop(open_tag.tag, None)
        self._slots.release(open_tag.slot)

    # -- commit -------------------------------------------------------------------------

    async def commit(self, tag: str | None = None, *, latest: bool = True) -> CommitResult:
        """Make checkpoint ``tag`` durable and publish it (and ``latest``); see :mod:`._store`.

        ``tag=None`` commits the single open tag; ``latest=False`` publishes the tag
        without moving ``latest``. Cancelling the awaiting task abandons the wait only:
        the commit goes on, and a later ``commit(tag)`` returns its result. Raises
        :class:`InvalidStateError` when nothing was saved under ``tag``,
        :class:`CheckpointError` naming the file when a write failed (the tag is
        discarded, ``latest`` unchanged), :class:`WorkerDiedError` if the writer died.
        With ``distributed=True`` every rank calls it with the same tags in the same
        order; a rank that saved nothing under ``tag`` takes part with no files, and a
        failure on any rank raises on every rank (:class:`CheckpointError` naming it).
        """
        self._check_writer()
        if self._bridge is None and self._ranks is None:
            resolved = _store.validate_tag(tag) if tag is not None else ""
            return CommitResult(resolved, self._directory / resolved, (), 0, 0.0, 0.0, 0.0)
        if tag is None:
            if len(self._open_tags) != 1:
                raise InvalidStateError(
                    f"commit() without a tag needs exactly one open checkpoint; open: "
                    f"{sorted(self._open_tags)}"
                )
            tag = next(iter(self._open_tags))
        tag = _store.validate_tag(tag)
        if tag in self._catalog.results:
            return self._catalog.results[tag]
        open_tag = self._open_tags.get(tag)
        if open_tag is None and self._ranks is not None:  # this rank has no files in it
            tmpdir = self._directory / f"{_store.TMP_PREFIX}{tag}-{uuid.uuid4().hex[:8]}"
            open_tag = self._open_tags[tag] = _OpenTag(tag, tmpdir, None)
            open_tag.idle.set()
        if open_tag is None:
            raise InvalidStateError(f"nothing was saved under tag {tag!r}; nothing to commit")
        if open_tag.commit is None:
            open_tag.commit = asyncio.create_task(self._commit(open_tag, self._last_commit, latest))
            open_tag.commit.add_done_callback(mark_retrieved)
            self._last_commit = open_tag.commit
        return await asyncio.shield(open_tag.commit)

    async def _commit(
        self, open_tag: _OpenTag, previous: asyncio.Task[CommitResult] | None, latest: bool
    ) -> CommitResult:
        started = time.perf_counter()
        if previous is not None and not previous.done():
            await asyncio.wait([previous])  # publish in commit order; its errors are its own
        await open_tag.idle.wait()
        if self._ranks is not None:  # distributed (issue #11): one commit across every rank
            return await self._ranks.commit(
                open_tag, self._bridge, self._catalog, self._run_io, started, latest, self._finish
            )
        return await commit_one(
            open_tag, self._bridge, self._catalog, self._run_io, started, latest, self._finish
        )

    def _finish(self, open_tag: _OpenTag) -> None:
        """Forget a tag whose commit ended (its writes settled), freeing its slot if any."""
        if open_tag.slot is None:
            self._open_tags.pop(open_tag.tag, None)
        else:
            self._release(open_tag)

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
        return await _store.load(self._directory, name, tag, map_location, verify, self._executor())
