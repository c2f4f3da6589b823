"""``engine.dcp``: an engine's face for DCP state dicts, in both styles.

Names follow ``torch.distributed.checkpoint``: ``async_save`` / ``save`` / ``load`` of a
``state_dict`` under a ``checkpoint_id`` (the tag). Each returns at once with
:class:`~aoffload.Handle` s: a synchronous trainer calls ``.result()``, an asyncio one
awaits them. A save is what DCP's ``async_save`` does in ``THREAD`` mode with this
engine's :class:`~aoffload.dcp.Stager` and a :class:`~aoffload.dcp.StorageWriter` bound to
the engine, on one long-lived thread of the face's (``async_save`` makes a thread per call,
which costs the caller a millisecond or more on a busy host); a load runs ``dcp.load`` with
a :class:`~aoffload.dcp.StorageReader` on a thread of its own, so DCP's planners reshard
into the state dict in place. With several ranks
DCP's collectives run on a gloo group of the face's own (made on first use, a collective),
never on the trainer's: a training step's collectives on the default group cannot
interleave with them.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.stateful import Stateful

from .._errors import CheckpointError
from .._runtime.handle import Handle, in_thread
from .._runtime.threads import DaemonThreadExecutor, running_future
from ..checkpoint.core.copy import stage_events
from ..checkpoint.format import layout
from ._reader import StorageReader
from ._service import Service
from ._stager import Stager, _record
from ._waves import WaveMemory, Waves, state_bytes
from ._writer import StorageWriter

if TYPE_CHECKING:
    from .. import CheckpointEngine
    from ..checkpoint.core.result import CommitResult

__all__ = ["AsyncSave", "DcpFace"]


@dataclass(frozen=True, slots=True)
class AsyncSave:
    """What ``engine.dcp.async_save`` returns, as DCP's ``AsyncSaveResponse``:
    ``staging_completion`` is the fence (the state may change once it resolves);
    ``upload_completion`` resolves to the tag's :class:`~aoffload.CommitResult` once it is
    published (durable on every rank, ``latest`` moved)."""

    staging_completion: Handle[None]
    upload_completion: Handle[CommitResult]


def unwrapped(exc: CheckpointException) -> BaseException:
    """The failure of the lowest failed rank out of DCP's ``CheckpointException``."""
    if not exc.failures:
        return exc
    rank = min(exc.failures)
    failure = exc.failures[rank]
    error = failure[0] if isinstance(failure, tuple) else failure
    return error if isinstance(error, BaseException) else exc


class DcpFace:
    """``engine.dcp``: DCP state dicts saved and loaded through one engine (see the module)."""

    def __init__(self, engine: CheckpointEngine) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._service: Service | None = None
        self._stager: Stager | None = None
        self._group: Any = None
        self._thread: DaemonThreadExecutor | None = None
        self._waves: WaveMemory | None = None
        self._closed = False

    @property
    def service(self) -> Service:
        """The DCP route's calls into this engine (what ``StorageWriter`` uses)."""
        with self._lock:
            if self._closed:
                raise CheckpointError("the checkpoint engine is closed")
            if self._service is None:
                self._service = Service(self._engine._core)
            return self._service

    def _parts(self) -> tuple[Stager, Any, bool]:
        """This face's stager, DCP's process group and whether DCP runs without one."""
        self._engine.check_running()
        with self._lock:
            if self._stager is None:
                self._stager = Stager()
            stager = self._stager
        alone = not self._engine._core.coordinator.together
        if alone:
            return stager, None, True
        with self._lock:
            if self._group is None:
                self._group = dist.new_group(backend="gloo")  # every rank makes it alike
            return stager, self._group, False

    # -- save -------------------------------------------------------------------------------

    def async_save(
        self,
        state_dict: dict[str, Any],
        *,
        checkpoint_id: str,
        planner: SavePlanner | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> AsyncSave:
        """Save ``state_dict`` as checkpoint ``checkpoint_id``; returns once the copy started.

        What ``dcp.async_save(..., async_stager=Stager(), storage_writer=StorageWriter(...))``
        does in ``THREAD`` mode, without its per-call thread: this engine's :class:`Stager`
        copies the state (``Stateful`` values as their ``state_dict()``, taken here), then
        DCP's ``save`` runs on the face's thread, one save after the other. Wait for
        ``staging_completion`` before you modify the state (a tensor modified in place before
        its copy ended fails the save, naming it), and for ``upload_completion`` for the
        :class:`CommitResult`. ``metadata`` (JSON values) is stored in the manifest. Every rank
        calls it with the same ``checkpoint_id``; a failure on any rank raises on every rank.
        """
        stager, group, alone = self._parts()
        tag = layout.validate_tag(checkpoint_id)
        state = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}
        writer = StorageWriter(self._engine.directory, tag, engine=self._engine, metadata=metadata)
        recorded = _record(state)
        room = self._engine._core.staging_room  # the cap less the writer's buffers
        if state_bytes(recorded) > room:  # streamed through the cap, in waves
            with self._lock:
                if self._waves is None:
                    self._waves = WaveMemory(room)
                memory = self._waves
            waves = Waves(memory, state, recorded, stage_events())
            writer.waves = waves
            staged: concurrent.futures.Future[dict[str, Any]] = running_future()
            staged.set_result(state)
            fence: concurrent.futures.Future[None] = waves.fence
        else:
            staged = stager._stage(state, recorded)
            fence = _chained(staged, None)
        published: concurrent.futures.Future[CommitResult] = running_future()
        with self._lock:
            if self._thread is None:
                self._thread = DaemonThreadExecutor("aoffload-dcp-save")
            thread = self._thread
        # handed over in a box that the save empties: whatever holds the job meanwhile (the
        # thread's last call) must not hold the staged state and its staging memory
        job = functools.partial(self._save, [staged], writer, planner, group, alone, published)
        thread.submit(job)
        return AsyncSave(Handle(fence), Handle(published))

    def _save(
        self,
        box: list[concurrent.futures.Future[dict[str, Any]]],
        writer: StorageWriter,
        planner: SavePlanner | None,
        group: Any,
        alone: bool,
        published: concurrent.futures.Future[CommitResult],
    ) -> None:
        """One save, on the face's thread: DCP's ``save`` of the staged state, then this
        rank's commit of the tag (ended on rank 0, ending on the others)."""
        try:
            try:
                staged = box.pop()
                if staged.exception() is not None:
                    # the other ranks are entering DCP's save: take part, and refuse there,
                    # so that every rank fails with this error instead of waiting for this one
                    writer.refuse = staged.exception()
                state = {} if writer.refuse is not None else staged.result()
                del staged
                with warnings.catch_warnings():  # alone, DCP says so at every call
                    warnings.filterwarnings("ignore", "torch.distributed is disabled")
                    dcp_save(state, storage_writer=writer, planner=planner,
                             process_group=group, no_dist=alone)  # fmt: skip
                del state  # the staging memory is free for the next save from here
            except CheckpointException as exc:
                raise unwrapped(exc) from exc
            if writer.waves is not None:
                writer.waves.settle(None)
            commit = self._engine.commit(writer.tag)
            published.set_result(commit.result())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            if writer.waves is not None:
                writer.waves.settle(exc)
            published.set_exception(exc)

    def save(
        self,
        state_dict: dict[str, Any],
        *,
        checkpoint_id: str,
        planner: SavePlanner | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> Handle[CommitResult]:
        """:meth:`async_save`, waited for as one: the handle resolves once the checkpoint is
        published (the state may change from then on; its copy ended long before)."""
        return self.async_save(
            state_dict, checkpoint_id=checkpoint_id, planner=planner, metadata=metadata
        ).upload_completion

    # -- load -------------------------------------------------------------------------------

    def load(
        self,
        state_dict: dict[str, Any],
        *,
        checkpoint_id: str | None = None,
        planner: LoadPlanner | None = None,
        weights_only: bool = True,
    ) -> Handle[None]:
        """Load checkpoint ``checkpoint_id`` (default: ``latest``, as rank 0 sees it) into
        ``state_dict`` in place, resharded to its layout, verified (see
        :class:`~aoffload.dcp.StorageReader`). Every rank calls it."""
        _, group, alone = self._parts()

        def load() -> None:
            tag = checkpoint_id
            if tag is None:
                tag = self._engine.latest()
                if not alone:
                    chosen = [tag]
                    dist.broadcast_object_list(chosen, src=0, group=group)
                    tag = chosen[0]
                if tag is None:
                    raise CheckpointError(f"{self._engine.directory} holds no checkpoint yet")
            reader = StorageReader(self._engine.directory, tag, weights_only=weights_only)
            try:
                with warnings.catch_warnings():  # alone, DCP says so at every call
                    warnings.filterwarnings("ignore", "torch.distributed is disabled")
                    dcp_load(state_dict, storage_reader=reader, planner=planner,
                             process_group=group, no_dist=alone)  # fmt: skip
            except CheckpointException as exc:
                raise unwrapped(exc) from exc

        return in_thread(load, name="aoffload-dcp-load")

    # -- close ------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the stager, close the door (the engine closes next). Idempotent."""
        with self._lock:
            self._closed = True
            stager, self._stager = self._stager, None
            thread, self._thread = self._thread, None
            waves, self._waves = self._waves, None
            service = self._service
        try:
            if thread is not None:
                thread.shutdown(wait=True)  # the saves asked for end (the engine still runs)
            if stager is not None:
                stager.close()
            if waves is not None:
                waves.close()
        finally:
            if service is not None:
                service.close()


def _chained(source: concurrent.futures.Future[Any], value: Any) -> concurrent.futures.Future[Any]:
    """A future resolved with ``value`` when ``source`` succeeds, or with its error.

    The callback is handed ``source``; it must not hold it (``source`` holds the callback:
    a cycle would keep the staged state, and its staging memory, until a collection)."""
    future: concurrent.futures.Future[Any] = running_future()

    def done(ended: concurrent.futures.Future[Any]) -> None:
        error = ended.exception()
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    source.add_done_callback(done)
    return future
