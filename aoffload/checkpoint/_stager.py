"""The save path of :class:`~._engine.CheckpointEngine`: ``stage()`` and the pipeline behind it.

``stage()`` validates on the loop (name, tag, the open tag's state), records an event on
each CUDA device's current stream, and starts one task per call, then returns a
:class:`Staged` handle. The task plans the state on the engine's I/O thread (the pickled
skeleton; each tensor's version counter), waits for a staging slot (``max_pending``),
reserves space in it, has :class:`~._copy.CopyPool` copy the tensors in, and hands the file
to the writer. No step that grows with the state runs on the loop.

A staging that fails leaves nothing for the writer. Its error is raised by ``await
staged``; if nobody awaited it, ``commit()`` of that tag raises it (the checkpoint would
lack the file). The engine's background commits (``commit_soon``) record their failure
here, to be raised from the engine's next call.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import uuid
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._errors import CheckpointError, InvalidStateError
from .._runtime.bridge import Bridge
from .._runtime.threads import mark_retrieved
from . import _store
from ._commit import CommitResult
from ._copy import CopyPool, Events, stage_events
from ._plan import Plan, plan
from ._staging import Segment, Slot, SlotPool
from ._writer import FileRecord, MapSegment, TensorRecord, WriteFile

__all__ = ["OpenTag", "Staged", "Stager"]


@dataclass
class OpenTag:
    """A tag with files staged or being written, not yet published."""

    tag: str
    tmpdir: Path
    slot: Slot | None = None
    writes: dict[str, asyncio.Future[FileRecord]] = field(default_factory=dict)
    staging: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    stage_seconds: float = 0.0
    commit: asyncio.Task[CommitResult] | None = None
    names: set[str] = field(default_factory=set)
    failures: dict[str, BaseException] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def raise_failures(self) -> None:
        """Raise the first staging failure nobody has seen (called by ``commit()``)."""
        if self.failures:
            name, exc = next(iter(self.failures.items()))
            self.failures.clear()
            raise CheckpointError(
                f"file {name!r} of checkpoint {self.tag!r} could not be staged ({exc}); "
                "the checkpoint is discarded"
            ) from exc


class Staged:
    """What :meth:`CheckpointEngine.stage` returns: one call's snapshot copy, in flight.

    ``await staged`` returns ``None`` once every tensor of the call is copied into staging
    memory; from then on the caller may mutate or free them. It raises what the staging
    raised (:class:`InvalidStateError` naming the key for bad input, :class:`CheckpointError`
    naming the key of a tensor mutated during its copy, :class:`WorkerDiedError`).
    Cancelling the await abandons the wait only. :meth:`done` tells without waiting.
    """

    __slots__ = ("_open_tag", "_task", "name", "tag")

    def __init__(
        self, task: asyncio.Future[None], open_tag: OpenTag | None, name: str, tag: str
    ) -> None:
        self._task, self._open_tag, self.name, self.tag = task, open_tag, name, tag

    def done(self) -> bool:
        """Whether the copy has ended (successfully or not)."""
        return self._task.done()

    def __await__(self) -> Generator[Any, None, None]:
        return self._wait().__await__()

    async def _wait(self) -> None:
        try:
            await asyncio.shield(self._task)
        finally:
            if self._task.done() and not self._task.cancelled() and self._open_tag is not None:
                failure = self._open_tag.failures.get(self.name)
                if failure is not None and failure is self._task.exception():
                    del self._open_tag.failures[self.name]  # seen here: commit() need not

    def __repr__(self) -> str:
        state = "done" if self.done() else "copying"
        return f"<Staged {self.tag}/{self.name} {state}>"


class Stager:
    """The open tags, their staging slots, the copy pool, and the staging tasks."""

    def __init__(self, directory: Path, max_pending: int) -> None:
        self.directory = directory
        self.open_tags: dict[str, OpenTag] = {}
        self.slots = SlotPool(max_pending)
        self._pool: CopyPool | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._copies: set[asyncio.Future[float]] = set()
        self._background: list[tuple[asyncio.Task[CommitResult], BaseException]] = []

    # -- staging ------------------------------------------------------------------------

    def start(self) -> None:
        """Start the copy threads (blocking: a thread's start waits until it runs)."""
        if self._pool is None:
            self._pool = CopyPool()

    def stage(
        self,
        bridge: Bridge,
        io: concurrent.futures.Executor,
        state: object,
        name: str,
        tag: str,
    ) -> Staged:
        """Reserve ``name`` in ``tag`` and start its staging task (on the loop, O(1))."""
        loop = asyncio.get_running_loop()
        open_tag = self.open_tags.get(tag)
        if open_tag is None:
            tmpdir = self.directory / f"{_store.TMP_PREFIX}{tag}-{uuid.uuid4().hex[:8]}"
            open_tag = self.open_tags[tag] = OpenTag(tag, tmpdir)
            open_tag.idle.set()
        if open_tag.commit is not None:
            raise InvalidStateError(f"checkpoint {tag!r} is being committed; use a new tag")
        if name in open_tag.names:
            raise InvalidStateError(f"file {name!r} was already saved in checkpoint {tag!r}")
        open_tag.names.add(name)
        open_tag.staging += 1
        open_tag.idle.clear()
        task = loop.create_task(self._run(bridge, io, open_tag, state, name, stage_events()))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(mark_retrieved)  # raised by `await staged` or commit()
        return Staged(task, open_tag, name, tag)

    async def _run(
        self,
        bridge: Bridge,
        io: concurrent.futures.Executor,
        open_tag: OpenTag,
        state: object,
        name: str,
        events: Events,
    ) -> None:
        try:
            loop = asyncio.get_running_loop()
            planned: Plan = await loop.run_in_executor(io, plan, state, name)
            del state
            async with open_tag.lock:
                if open_tag.slot is None:
                    open_tag.slot = await self.slots.acquire(lambda: self._no_room(open_tag.tag))
                # A new segment is reserved and populated on the I/O thread, never on the
                # loop. The writer maps it as soon as it exists, even if this staging was
                # cancelled meanwhile, since later files may use its space.
                allocation = loop.run_in_executor(io, open_tag.slot.allocate, planned.nbytes)
                allocation.add_done_callback(lambda done: self._map_new(bridge, done))
                region, _ = await asyncio.shield(allocation)
            if self._pool is None:
                raise InvalidStateError("the checkpoint engine is closing")
            copy = asyncio.wrap_future(self._pool.copy(region, planned, events, name))
            self._copies.add(copy)
            copy.add_done_callback(self._copies.discard)
            # Cancelling abandons the wait only; close() waits for the copy to end.
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
        except BaseException as exc:
            open_tag.names.discard(name)
            if not isinstance(exc, asyncio.CancelledError):
                open_tag.failures[name] = exc
            raise
        finally:
            open_tag.staging -= 1
            if open_tag.staging == 0:
                open_tag.idle.set()
                if not open_tag.writes and open_tag.commit is None:
                    self.release(open_tag)  # nothing reached the writer: free the slot again

    def _no_room(self, tag: str) -> str | None:
        if any(t.commit is not None for t in self.open_tags.values()):
            return None
        return (
            f"cannot stage checkpoint {tag!r}: max_pending={len(self.slots.slots)} "
            f"checkpoints {sorted(t for t in self.open_tags if t != tag)} are staged and "
            "none is being committed; commit one first (commit_soon() does it in the "
            "background) or raise max_pending"
        )

    def _map_new(self, bridge: Bridge, done: asyncio.Future[tuple[Any, Segment | None]]) -> None:
        if done.cancelled() or done.exception() is not None:
            return
        segment = done.result()[1]
        if segment is None:
            return

        def mapped(future: asyncio.Future[None]) -> None:
            segment.unlink()  # mapped in both processes (or the writer is gone): drop the name
            mark_retrieved(future)  # a failed map fails the write that needs it

        try:
            bridge.call(MapSegment(segment.path, segment.size)).add_done_callback(mapped)
        except BaseException:
            segment.unlink()
            raise

    def release(self, open_tag: OpenTag) -> None:
        """Forget ``open_tag`` and free its slot (idempotent)."""
        if self.open_tags.get(open_tag.tag) is open_tag:
            del self.open_tags[open_tag.tag]
        slot, open_tag.slot = open_tag.slot, None
        if slot is not None:
            self.slots.release(slot)

    async def drain(self) -> None:
        """Cancel the stagings still in flight and wait until no copy touches staging memory."""
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)
        if self._copies:
            await asyncio.wait(self._copies)

    def close(self) -> None:
        """Stop the copy threads (idle after :meth:`drain`) and unmap every slot (blocking)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown()
        self.slots.close()

    # -- background commits -------------------------------------------------------------

    def background(self, task: asyncio.Task[CommitResult]) -> None:
        """Own ``task``: its failure is raised from the engine's next call."""

        def done(task: asyncio.Task[CommitResult]) -> None:
            if not task.cancelled() and task.exception() is not None:
                self._background.append((task, task.exception()))  # type: ignore[arg-type]

        task.add_done_callback(done)

    def seen(self, task: asyncio.Task[CommitResult]) -> None:
        """``task``'s failure was raised to an awaiting ``commit()``: do not raise it again."""
        self._background = [(t, exc) for t, exc in self._background if t is not task]

    def raise_background(self) -> None:
        """Raise (once) the failure of a background commit, if one failed."""
        if self._background:
            _, exc = self._background.pop(0)
            raise exc
