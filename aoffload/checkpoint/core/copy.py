"""The staging copy: a pool of threads sized to the cores, copying in chunks without the GIL.

One copy job takes a :class:`~.plan.Plan` into its staging :class:`~.staging.Region`. The
first pool thread to take the job cuts it into pieces: the pickle's chunks, its large
``bytes`` values and each whole CPU storage in :data:`CHUNK`-byte ``memmove`` calls, which
release the GIL; the CUDA storages are one piece that queues their
device-to-host copies on a side stream per device into the pinned segment, ordered after
the events :func:`stage_events` recorded on the caller's current streams when ``stage()``
was called. Every thread of the pool then takes pieces until none is left; the last one
waits for the CUDA copies (blocking on their events, without the GIL), compares each
tensor's version counter with the one planned, and resolves the job's future.

Nothing here changes torch's thread count, which would change it for the trainer too.
The pool's threads run as background work (Linux's ``SCHED_BATCH``, through
:func:`~.._runtime.threads.background_policy`): the event loop and the training step
preempt them when they wake up, yet on a busy host they keep a normal thread's share.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import itertools
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..._errors import CheckpointError, ClosedError
from ..._runtime.threads import background_policy

if TYPE_CHECKING:
    from .plan import Plan
    from .staging import Region

__all__ = ["CHUNK", "CopyPool", "stage_events"]

CHUNK = 8 << 20
"""Bytes per ``memmove`` piece: small enough to share a tensor among the threads."""

Events = dict[int, "torch.cuda.Event"]


def stage_events() -> Events:
    """An event on each CUDA device's current stream (``{}`` before CUDA is initialised).

    Recorded when ``stage()`` is called, so the side-stream copy runs after the work the
    caller had queued by then. O(devices), never O(state).
    """
    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return {}
    return {
        device: torch.cuda.current_stream(device).record_event()
        for device in range(torch.cuda.device_count())
    }


def _pieces(target: int, source: int, nbytes: int) -> list[Callable[[], object]]:
    return [
        functools.partial(ctypes.memmove, target + at, source + at, min(CHUNK, nbytes - at))
        for at in range(0, nbytes, CHUNK)
    ]


class _Job:
    """One plan copied into one region by every thread of a pool."""

    def __init__(self, region: Region, plan: Plan, events: Events, name: str) -> None:
        self.future: concurrent.futures.Future[float] = concurrent.futures.Future()
        self._region, self._plan, self._events, self._name = region, plan, events, name
        self._pieces: list[Callable[[], object]] = []
        self._keep: list[np.ndarray] = []  # the pickle's buffers, alive until copied
        self._next = itertools.count()  # atomic under the GIL: each piece is taken once
        self._lock = threading.Lock()
        self._active = 0
        self._error: BaseException | None = None
        self._cuda_done: list[torch.cuda.Event] = []
        self._started = time.perf_counter()

    def start(self, pool: CopyPool) -> None:
        """Cut the job into pieces (off the loop: it grows with the state), then help."""
        try:
            self._prepare()
        except BaseException as exc:  # noqa: BLE001 - resolves the job's future
            self._error = exc
        helpers = max(0, min(pool.size, len(self._pieces)) - 1) if self._error is None else 0
        self._active = 1 + helpers  # nobody else runs this job yet
        for _ in range(helpers):
            pool.put(self.help)
        self.help()

    def help(self) -> None:
        """Copy pieces until none is left; the last thread out finishes the job."""
        pieces = self._pieces
        while self._error is None and (index := next(self._next)) < len(pieces):
            try:
                pieces[index]()
            except BaseException as exc:  # noqa: BLE001 - resolves the job's future
                self._error = exc
        with self._lock:
            self._active -= 1
            last = self._active == 0
        if last:
            self._finish()

    def _prepare(self) -> None:
        array = self._region.segment.array
        if array is None:
            raise ClosedError("the checkpoint engine's staging memory was released")
        base = array.data_ptr() + self._region.offset
        position = base
        for piece in self._plan.pickle:
            buffer = np.frombuffer(piece, dtype=np.uint8)
            self._keep.append(buffer)
            self._pieces += _pieces(position, buffer.ctypes.data, buffer.size)
            position += buffer.size
        for (_, value), offset in zip(self._plan.blobs, self._plan.blob_offsets, strict=True):
            buffer = np.frombuffer(value, dtype=np.uint8)
            self._keep.append(buffer)
            self._pieces += _pieces(base + offset, buffer.ctypes.data, buffer.size)
        cuda: list[tuple[torch.Tensor, torch.Tensor]] = []
        plan = self._plan
        for source, offset in zip(plan.storages, plan.storage_offsets, strict=True):
            nbytes = source.numel()  # a flat uint8 tensor over a whole storage
            if nbytes == 0:
                continue
            start = self._region.offset + offset
            if source.is_cuda:
                cuda.append((array[start : start + nbytes], source))
            else:
                self._pieces += _pieces(array.data_ptr() + start, source.data_ptr(), nbytes)
        if cuda:  # first, so that the device copies overlap the host ones
            self._pieces.insert(0, functools.partial(self._copy_cuda, cuda))

    def _copy_cuda(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._region.segment.pin()
        streams: dict[torch.device, torch.cuda.Stream] = {}
        for target, source in copies:
            stream = streams.get(source.device)
            if stream is None:
                stream = streams[source.device] = torch.cuda.Stream(source.device)  # type: ignore[no-untyped-call]
                event = self._events.get(source.device.index or 0)
                if event is not None:
                    stream.wait_event(event)
            with torch.cuda.stream(stream):
                target.copy_(source, non_blocking=True)
            source.record_stream(stream)  # the allocator keeps it until the copy is done
        self._cuda_done = [stream.record_event() for stream in streams.values()]

    def _finish(self) -> None:
        try:
            for done in self._cuda_done:
                done.synchronize()  # blocks this thread, without the GIL; no polling
            if self._error is not None:
                raise self._error
            self._check_versions()
        except BaseException as exc:  # noqa: BLE001 - handed to whoever awaits the future
            self.future.set_exception(exc)
        else:
            self.future.set_result(time.perf_counter() - self._started)
        finally:
            self._pieces, self._keep = [], []

    def _check_versions(self) -> None:
        moved = self._plan.modified()
        if moved is None:
            return
        key, before, after = moved
        raise CheckpointError(
            f"cannot save {self._name!r}: {key} was modified in place while it was being "
            f"staged (its version counter moved from {before} to {after}); nothing of this "
            "file was written. Do not modify staged tensors until `await staged` (or save()) "
            "has returned"
        )


class CopyPool:
    """Daemon threads, one per core this process may run on, that run copy jobs."""

    def __init__(self, size: int | None = None) -> None:
        self.size = size if size is not None else len(os.sched_getaffinity(0))
        self._work: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._run, name=f"aoffload-copy-{i}", daemon=True)
            for i in range(self.size)
        ]
        for thread in self._threads:
            thread.start()

    def copy(
        self, region: Region, plan: Plan, events: Events, name: str
    ) -> concurrent.futures.Future[float]:
        """Copy ``plan`` into ``region``; the future gives the seconds it took."""
        job = _Job(region, plan, events, name)
        self.put(functools.partial(job.start, self))
        return job.future

    def put(self, work: Callable[[], None]) -> None:
        """Queue ``work`` for the next free thread."""
        self._work.put(work)

    def shutdown(self) -> None:
        """Stop the threads once the queued work is done, and join them."""
        for _ in self._threads:
            self._work.put(None)
        for thread in self._threads:
            thread.join()

    def _run(self) -> None:
        background_policy()  # the copy takes idle cycles; the loop and the step come first
        while (work := self._work.get()) is not None:
            work()
            del work  # idle, it must not keep the last job's state (its tensors) alive
