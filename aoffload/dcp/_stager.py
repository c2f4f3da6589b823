"""``Stager``: DCP's ``AsyncStager`` over aoffload's staging pipeline.

``stage(state_dict)`` runs on the caller's thread only what soundness needs (each
tensor's version counter, an event on each CUDA device's current stream: O(entries),
never O(bytes)) and returns a :class:`concurrent.futures.Future` at once. The stager's
own thread then lays the state's storages out in a shared-memory segment
(:mod:`._memory`), and the copy runs on a pool of threads sized to the cores in
GIL-free ``memmove`` chunks (CUDA storages: into the page-locked segment, on a side
stream per device, ordered after the work queued before ``stage()``). When the last
chunk is copied every version counter is compared with the one recorded (a tensor
modified in place meanwhile fails the future, naming its key) and the future resolves
to the staged state dict: the same structure, each tensor a view of staging memory
(a ``DTensor`` rewrapped around its staged local shard), every other value a deep copy.
DCP's ``staging_completion`` resolves with it: that is the fence.

The segment is reused by the next ``stage()`` once nothing of the previous staged state
is alive (DCP drops it when its save ends), as ``DefaultStager`` reuses its copy. Staged
tensors are views of one shared storage per segment, so DCP's PROCESS mode hands them to
its daemon as a descriptor, without a copy; aoffload's ``StorageWriter`` has its engine's
writer process map the same segment by name and write straight from it.
"""

from __future__ import annotations

import concurrent.futures
import copy
import ctypes
import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from .._errors import CheckpointError, ClosedError, InvalidStateError
from .._runtime.threads import DaemonThreadExecutor, running_future
from ..checkpoint.core.copy import CHUNK, CopyPool, Events, stage_events
from ..checkpoint.core.pickler import tensor_problem, version_of
from ..checkpoint.core.plan import key_of
from ._memory import Segment, aligned

__all__ = ["Stager"]

logger = logging.getLogger(__name__)

_Recorded = list[tuple[Any, torch.Tensor, tuple[int | None, ...]]]
"""(the value in the state, the tensor copied for it, their version counters at stage())."""
_IMMUTABLE = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device)


def _versions(value: torch.Tensor, local: torch.Tensor) -> tuple[int | None, ...]:
    """The version counters that an in-place change of ``value`` moves: a ``DTensor``'s
    own (an optimizer's step on it moves only that one) and its shard's."""
    if local is value:
        return (version_of(value),)
    return version_of(value), version_of(local)


def _record(state: object) -> _Recorded:
    """Every tensor of ``state``'s dicts, lists and tuples with its version counters (the
    caller's thread: O(entries)); a ``DTensor`` is copied as its local shard."""
    found: _Recorded = []
    seen: set[int] = set()
    stack = [state]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            if id(value) not in seen:
                seen.add(id(value))
                local = value._local_tensor if isinstance(value, DTensor) else value
                found.append((value, local, _versions(value, local)))
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    return found


def _problem(tensor: torch.Tensor) -> str | None:
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        return (
            f"tensor subclass {type(tensor).__qualname__} cannot be staged by aoffload.dcp."
            "Stager (plain tensors and DTensors only); stage it with DCP's DefaultStager"
        )
    if tensor.is_conj() or tensor.is_neg():
        return "tensors with a conjugate or negative bit cannot be staged (resolve_conj() it)"
    return tensor_problem(tensor)  # the layouts and devices the engine's stage() refuses


class _Layout:
    """Where each distinct storage of a state goes in staging memory."""

    def __init__(self) -> None:
        self.offsets: dict[int, int] = {}
        self.storages: list[tuple[torch.UntypedStorage, int]] = []
        self.nbytes = 0

    def place(self, tensor: torch.Tensor) -> int:
        """The offset of ``tensor``'s storage (placed once, whoever else views it)."""
        storage = tensor.untyped_storage()
        key = storage._cdata
        offset = self.offsets.get(key)
        if offset is None:
            offset = self.offsets[key] = self.nbytes
            self.storages.append((storage, offset))
            self.nbytes += aligned(storage.nbytes())
        return offset


class _Sources(Protocol):
    """What a :class:`_Copy` copies: sources (storages, or anything with their
    ``device``, ``data_ptr()`` and ``nbytes()``) and their offsets in the segment."""

    storages: list[tuple[Any, int]]


class _Copy:
    """One state's storages copied into one segment by every thread of a pool."""

    def __init__(self, segment: Segment, placed: _Sources, events: Events) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._pieces: list[Callable[[], object]] = []
        self._next = itertools.count()  # atomic under the GIL: each piece is taken once
        self._lock = threading.Lock()
        self._active = 0
        self._cuda_done: list[torch.cuda.Event] = []
        cuda: list[tuple[torch.Tensor, torch.Tensor]] = []
        for storage, offset in placed.storages:
            nbytes = storage.nbytes()
            if nbytes == 0:
                continue
            if storage.device.type == "cuda":
                source = torch.empty((0,), dtype=torch.uint8, device=storage.device)
                cuda.append((segment.bytes(offset, nbytes), source.set_(storage)))
            else:
                target, source_address = segment.address + offset, storage.data_ptr()
                self._pieces += [
                    _memmove(target + at, source_address + at, min(CHUNK, nbytes - at))
                    for at in range(0, nbytes, CHUNK)
                ]
        if cuda:  # first, so that the device copies overlap the host ones
            self._pieces.insert(0, lambda: self._copy_cuda(segment, cuda, events))

    def run(self, pool: CopyPool) -> None:
        """Copy on ``pool`` (this thread waits for the end, without polling)."""
        helpers = max(1, min(pool.size, len(self._pieces)))
        self._active = helpers
        for _ in range(helpers):
            pool.put(self._help)
        self.done.wait()
        if self.error is not None:
            raise self.error

    def _help(self) -> None:
        pieces = self._pieces
        while self.error is None and (index := next(self._next)) < len(pieces):
            try:
                pieces[index]()
            except BaseException as exc:  # noqa: BLE001 - raised by run()
                self.error = exc
        with self._lock:
            self._active -= 1
            last = self._active == 0
        if last:
            try:
                for event in self._cuda_done:
                    event.synchronize()  # blocks this thread, without the GIL
            except BaseException as exc:  # noqa: BLE001 - raised by run()
                self.error = exc
            self._pieces = []
            self.done.set()

    def _copy_cuda(
        self, segment: Segment, copies: list[tuple[torch.Tensor, torch.Tensor]], events: Events
    ) -> None:
        segment.pin()
        streams: dict[torch.device, torch.cuda.Stream] = {}
        for target, source in copies:
            stream = streams.get(source.device)
            if stream is None:
                stream = streams[source.device] = torch.cuda.Stream(source.device)  # type: ignore[no-untyped-call]
                event = events.get(source.device.index or 0)
                if event is not None:
                    stream.wait_event(event)
            with torch.cuda.stream(stream):
                target.copy_(source, non_blocking=True)
            source.record_stream(stream)
        self._cuda_done = [stream.record_event() for stream in streams.values()]


_KEY_NOTE = "(a value aoffload.dcp.Stager deep-copies, as DefaultStager does)"


def _failed_key(state: object, exc: BaseException) -> str:
    """``state``'s key whose copy raised ``exc``, and why."""
    value = getattr(exc, "aoffload_value", None)
    key = key_of(state, value) if value is not None else None
    return f"{key or 'a value'}: {type(exc).__name__}: {exc}"


def _dtensor(local: torch.Tensor, like: DTensor) -> DTensor:
    """A DTensor of ``like``'s spec around the staged ``local`` shard.

    Not ``DTensor.from_local`` (it moves a CUDA mesh's shard back to the device), nor
    ``DTensor(local, spec)``, whose wrapper takes the shard's storage offset: torch then
    pickles a wrapper with a non-zero offset as a tensor with storage (its reduction tells
    them apart by ``data_ptr() == 0``), and DCP's PROCESS mode crashes sending it.
    """
    meta = like._spec.tensor_meta
    if meta is None:  # pragma: no cover - a DTensor always has it
        raise InvalidStateError("a DTensor without its tensor's metadata cannot be staged")
    wrapper: DTensor = torch.Tensor._make_wrapper_subclass(
        DTensor,
        meta.shape,
        strides=meta.stride,
        dtype=local.dtype,
        device=local.device,
        layout=local.layout,
        requires_grad=False,
    )
    wrapper._spec = like._spec
    wrapper._local_tensor = local
    return wrapper


def _memmove(target: int, source: int, nbytes: int) -> Callable[[], object]:
    return lambda: ctypes.memmove(target, source, nbytes)


class Stager(AsyncStager):
    """DCP's ``AsyncStager``: ``stage()`` returns at once; the copy runs on aoffload's threads.

    ::

        stager = Stager()
        response = dcp.async_save(state_dict, storage_writer=..., async_stager=stager)
        train_step()                              # the copy overlaps it
        response.staging_completion.result()      # the fence: now modify the state
        ...
        stager.close()                            # after the last save

    The staged state lives in shared memory: DCP's PROCESS mode sends it to its daemon
    without a copy, and :class:`~aoffload.dcp.StorageWriter` writes it from there. A tensor
    modified in place between ``stage()`` and the end of its copy fails the staging (and
    DCP's save) with :class:`~aoffload.CheckpointError` naming its key; do not modify the
    state until ``staging_completion`` resolves. Works with any ``StorageWriter``, in
    ``THREAD`` and ``PROCESS`` modes. It pickles as a fresh stager (staging memory belongs
    to one process). Call :meth:`close` when done: it frees the staging memory.
    """

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: DaemonThreadExecutor | None = None
        self._pool: CopyPool | None = None
        self._segments: list[Segment] = []
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._closed = False

    def __reduce__(self) -> tuple[Any, ...]:
        return (Stager, ())

    def stage(self, state_dict: dict[str, Any]) -> concurrent.futures.Future[dict[str, Any]]:
        """Start staging ``state_dict``; the future of its staged copy (see the class)."""
        return self._stage(state_dict, _record(state_dict))

    def _stage(
        self, state_dict: dict[str, Any], recorded: _Recorded
    ) -> concurrent.futures.Future[dict[str, Any]]:
        """:meth:`stage`, with the state's tensors already recorded (:func:`_record`, on
        the caller's thread: ``engine.dcp`` walks the state once, for its size too)."""
        events = stage_events()
        future: concurrent.futures.Future[dict[str, Any]] = running_future()
        with self._lock:
            if self._closed:
                raise ClosedError("this Stager was closed; make a new one")
            if self._thread is None:
                self._thread = DaemonThreadExecutor("aoffload-dcp-stage")
                self._pool = CopyPool()
            self._pending.add(future)
            thread = self._thread
        future.add_done_callback(self._settled)
        thread.submit(self._run, state_dict, recorded, events, future)
        return future

    def _settled(self, future: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._pending.discard(future)

    # -- the stage thread ----------------------------------------------------------------

    def _run(
        self,
        state: dict[str, Any],
        recorded: _Recorded,
        events: Events,
        future: concurrent.futures.Future[dict[str, Any]],
    ) -> None:
        try:
            placed = _Layout()
            for value, local, _ in recorded:
                problem = _problem(local)
                if problem is not None:
                    key = key_of(state, value) or f"a tensor of shape {tuple(value.shape)}"
                    raise InvalidStateError(f"cannot stage {key}: {problem}")
                placed.place(local)
            segment = self._segment(placed.nbytes)
            try:
                staged = self._rebuild(state, segment, placed)
            except Exception as exc:
                raise InvalidStateError(f"cannot stage {_failed_key(state, exc)}") from exc
            if self._pool is None:
                raise ClosedError("this Stager was closed")
            _Copy(segment, placed, events).run(self._pool)
            for value, local, before in recorded:
                after = _versions(value, local)
                moved = [(b, a) for b, a in zip(before, after, strict=True) if b not in (None, a)]
                if moved:
                    key = key_of(state, value) or f"a tensor of shape {tuple(value.shape)}"
                    (was, now), *_ = moved
                    raise CheckpointError(
                        f"cannot stage {key}: it was modified in place while it was being "
                        f"staged (its version counter moved from {was} to {now}); "
                        "nothing of this state is saved. Do not modify the state until the "
                        "staging completes (DCP's `staging_completion`)"
                    )
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(exc)
            return
        future.set_result(staged)

    def _segment(self, nbytes: int) -> Segment:
        """A segment of at least ``nbytes`` that no staged state uses: a free one of this
        stager's (the smallest that fits), else a new one. The other free segments are
        released: one made while an earlier staged state was still alive goes at the next
        save, so the stager holds one copy of the state in the steady state."""
        free = [s for s in self._segments if not s.busy()]
        fits = [s for s in free if s.size >= nbytes]
        chosen = min(fits, key=lambda s: s.size) if fits else None
        for segment in free:
            if segment is not chosen:
                self._segments.remove(segment)
                segment.close()
        if chosen is None:
            chosen = Segment(nbytes)
            self._segments.append(chosen)
        return chosen

    def _rebuild(self, value: Any, segment: Segment, placed: _Layout) -> Any:
        """``value`` with each tensor replaced by its view of staging memory."""
        if isinstance(value, torch.Tensor):
            if isinstance(value, DTensor):
                return _dtensor(self._rebuild(value._local_tensor, segment, placed), value)
            base = placed.offsets[value.untyped_storage()._cdata]
            if value.numel() == 0:
                return torch.empty(value.shape, dtype=value.dtype)
            offset = base + int(value.storage_offset()) * value.element_size()
            return segment.tensor(offset, value.dtype, tuple(value.shape), value.stride())
        if isinstance(value, dict):
            items = [(k, self._rebuild(v, segment, placed)) for k, v in value.items()]
            return OrderedDict(items) if isinstance(value, OrderedDict) else dict(items)
        if isinstance(value, list):
            return [self._rebuild(v, segment, placed) for v in value]
        if isinstance(value, tuple):
            items = [self._rebuild(v, segment, placed) for v in value]
            return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
        if isinstance(value, _IMMUTABLE):
            return value
        try:
            return copy.deepcopy(value)
        except Exception as exc:
            exc.add_note(_KEY_NOTE)
            exc.aoffload_value = value  # type: ignore[attr-defined]
            raise

    # -- close ---------------------------------------------------------------------------

    def synchronize_staging(self) -> None:
        """Nothing: the fence is the future :meth:`stage` returned (DCP's
        ``staging_completion``)."""

    def close(self) -> None:
        """Wait for the stagings in flight, stop the threads and free the staging memory
        (once no staged state is alive). Idempotent; a closed stager stages no more."""
        with self._lock:
            self._closed = True
            pending = list(self._pending)
            thread, self._thread = self._thread, None
            pool, self._pool = self._pool, None
        concurrent.futures.wait(pending)
        if thread is not None:
            thread.shutdown(wait=True)
        if pool is not None:
            pool.shutdown()
        segments, self._segments = self._segments, []
        for segment in segments:
            segment.close()
