"""The staging copy: a pool of threads sized to the cores, copying chunks without the GIL.

A file is staged as a *stream*: its plan's pickle, its large ``bytes`` values and its
storages, one after the other, in the order the writer takes them
(:class:`StreamCopy`). The stream is copied chunk by chunk into the staging pool's chunks
(:mod:`.staging`); each chunk is one task of the :class:`CopyPool`, so the pool's threads
copy different chunks side by side. Host memory is copied with ``ctypes.memmove``, which
releases the GIL; a CUDA storage's part of a chunk is a device-to-host copy on a side
stream per device into the pinned segment, ordered after the events
:func:`stage_events` recorded on the caller's current streams when ``stage()`` was
called, and the copying thread waits for it (blocking on an event, without the GIL).
:func:`check_versions` compares each tensor's version counter with the one planned, once
the last chunk is copied.

Nothing here changes torch's thread count, which would change it for the trainer too.
The pool's threads run as background work (Linux's ``SCHED_BATCH``, through
:func:`~.._runtime.threads.background_policy`): the event loop and the training step
preempt them when they wake up, yet on a busy host they keep a normal thread's share.
"""

from __future__ import annotations

import bisect
import ctypes
import os
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..._errors import CheckpointError, ClosedError
from ..._runtime.threads import background_policy

if TYPE_CHECKING:
    from .plan import Plan
    from .staging import Chunk

__all__ = ["CHUNK", "CopyPool", "Events", "StreamCopy", "check_versions", "stage_events"]

CHUNK = 8 << 20
"""Bytes per ``memmove`` piece of a whole-state copy (the DCP stager's): small enough to
share a tensor among the threads."""

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


class StreamCopy:
    """The bytes of one planned file as one stream, copied into staging chunks.

    The stream is the plan's pickle, then its blobs, then its storages (the order of the
    :class:`~..writer.calls.TorchRecord` the writer takes): :attr:`nbytes` in all.
    :meth:`copy` copies any range of it; it may run on several threads at once.
    """

    def __init__(self, plan: Plan, events: Events) -> None:
        self._starts: list[int] = []
        self._sources: list[int | torch.Tensor] = []  # an address, or a CUDA storage
        self._keep: list[np.ndarray] = []  # the pickle's buffers, alive until copied
        self._events = events
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._lock = threading.Lock()
        at = 0
        for piece in (*plan.pickle, *(value for _, value in plan.blobs)):
            buffer = np.frombuffer(piece, dtype=np.uint8)
            if buffer.size:
                self._keep.append(buffer)
                self._starts.append(at)
                self._sources.append(buffer.ctypes.data)
                at += buffer.size
        for storage in plan.storages:  # a flat uint8 tensor over a whole storage
            if storage.numel():
                self._starts.append(at)
                self._sources.append(storage if storage.is_cuda else storage.data_ptr())
                at += storage.numel()
        self._ends = [*self._starts[1:], at]
        self.nbytes = at

    def copy(self, at: int, chunk: Chunk) -> int:
        """Copy the stream's bytes from ``at`` into ``chunk`` (as many as it holds or the
        stream has left); the count. Blocks, without the GIL for host memory."""
        nbytes = min(chunk.nbytes, self.nbytes - at)
        array = chunk.segment.array
        if array is None:
            raise ClosedError("the checkpoint engine's staging memory was released")
        base = array.data_ptr() + chunk.offset
        done: list[torch.cuda.Event] = []
        index = bisect.bisect_right(self._starts, at) - 1
        while nbytes and index < len(self._starts) and self._starts[index] < at + nbytes:
            start, end, source = self._starts[index], self._ends[index], self._sources[index]
            lo, hi = max(start, at), min(end, at + nbytes)
            if isinstance(source, int):
                ctypes.memmove(base + lo - at, source + lo - start, hi - lo)
            else:
                target = array[chunk.offset + lo - at : chunk.offset + hi - at]
                done.append(self._copy_cuda(chunk, target, source[lo - start : hi - start]))
            index += 1
        for event in done:
            event.synchronize()  # blocks this thread, without the GIL; no polling
        return nbytes

    def _copy_cuda(
        self, chunk: Chunk, target: torch.Tensor, source: torch.Tensor
    ) -> torch.cuda.Event:
        chunk.segment.pin()
        with self._lock:
            stream = self._streams.get(source.device)
            if stream is None:
                stream = torch.cuda.Stream(source.device)  # type: ignore[no-untyped-call]
                self._streams[source.device] = stream
                event = self._events.get(source.device.index or 0)
                if event is not None:
                    stream.wait_event(event)
        with torch.cuda.stream(stream):
            target.copy_(source, non_blocking=True)
        source.record_stream(stream)  # the allocator keeps it until the copy is done
        done: torch.cuda.Event = stream.record_event()
        return done

    def release(self) -> None:
        """Drop the references to the state's memory (the copy has ended)."""
        self._keep, self._sources = [], []


def check_versions(plan: Plan, name: str) -> None:
    """Raise :class:`CheckpointError` naming the first tensor of ``plan`` modified in place
    since its version counter was recorded (the copy threads, once the last chunk is in)."""
    moved = plan.modified()
    if moved is None:
        return
    key, before, after = moved
    raise CheckpointError(
        f"cannot save {name!r}: {key} was modified in place while it was being staged (its "
        f"version counter moved from {before} to {after}); the file is not written. Do not "
        "modify staged tensors until `await staged` (or save()) has returned"
    )


class CopyPool:
    """Daemon threads that run copy tasks: one per core this process may run on but one.

    The writer drains the chunks while they are copied, and it needs a core to do so: on a
    2-core machine two copy threads left it none and made the time to durable of 1 GiB
    about 1.3x that of one thread, whose copy was as fast (memory bandwidth, not cores,
    bounds a copy). A machine of one core gets one thread.
    """

    def __init__(self, size: int | None = None) -> None:
        self.size = size if size is not None else max(1, len(os.sched_getaffinity(0)) - 1)
        self._work: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._run, name=f"aoffload-copy-{i}", daemon=True)
            for i in range(self.size)
        ]
        for thread in self._threads:
            thread.start()

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
