"""Threads the library owns, and the few primitives every face of the library shares.

- :class:`DaemonThreadExecutor` runs calls in order on one daemon thread (the checkpoint
  engine's stage, commit and load work; the writer's I/O);
- :func:`running_future` makes a :class:`concurrent.futures.Future` that nobody can cancel,
  so that an ``asyncio.wrap_future`` of it, cancelled, abandons the wait only;
- :func:`run_in_thread` runs one blocking call on a fresh daemon thread for a coroutine
  (the bounded blocking steps of a start or a close), never on the loop's default executor;
- :func:`start_thread` starts a daemon thread without waiting until the new thread runs
  (``Thread.start()`` does wait: on a busy host, tens of milliseconds of an event loop's);
- :class:`Handoff` moves a result (a loaded state) from a thread to its awaiter, so that
  the thread never holds the last reference to it;
- :class:`LoopInbox` hands results produced on any thread to one event loop, waking it once
  for a burst;
- :func:`background_policy` makes the calling thread background work that still gets its
  fair share of a loaded host;
- :func:`mark_retrieved` marks a future's exception as seen.
"""

from __future__ import annotations

import _thread
import asyncio
import collections
import concurrent.futures
import ctypes
import errno
import logging
import os
import platform
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar, cast

__all__ = [
    "DaemonThreadExecutor",
    "Handoff",
    "LoopInbox",
    "background_policy",
    "mark_retrieved",
    "run_in_thread",
    "start_thread",
    "running_future",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


def background_policy() -> None:
    """Run the calling thread (and the threads it starts later) as background work.

    Linux's ``SCHED_BATCH``: the thread keeps the full weight of an ordinary thread, so on
    a host whose cores a data loader keeps busy it still gets its fair share (a trainer
    waiting for it at a fence or a commit is never starved, as it was under
    ``SCHED_IDLE``); but it never preempts anyone when it wakes up. On Linux 6.12 and
    later the thread also asks for a long time slice (:data:`BACKGROUND_SLICE_NS`): the
    scheduler (EEVDF) lets a waking thread with a shorter slice, the event loop's, preempt
    it at once, where otherwise the loop could wait for the next scheduler tick (4 ms at
    250 Hz) whenever the background threads hold every core. Its share of the CPU does not
    change. Linux keeps both per thread, and a thread inherits them from the thread that
    starts it. Elsewhere, nothing.
    """
    if sys.platform != "linux":
        return
    try:
        _set_fair_policy(os.SCHED_BATCH, BACKGROUND_SLICE_NS)
        return
    except OSError as exc:  # a kernel before 6.12 refuses the slice, or a sandbox the call
        logger.debug("sched_setattr on %s: %s", threading.current_thread().name, exc)
    try:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_BATCH, os.sched_param(0))
    except OSError:  # a sandbox that filters the call: the default policy is fine
        logger.debug("could not set SCHED_BATCH on %s", threading.current_thread().name)


BACKGROUND_SLICE_NS = 100_000_000
"""The time slice a background thread asks for: Linux's largest (100 ms)."""

_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}


class _SchedAttr(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_uint32),
        ("policy", ctypes.c_uint32),
        ("flags", ctypes.c_uint64),
        ("nice", ctypes.c_int32),
        ("priority", ctypes.c_uint32),
        ("runtime", ctypes.c_uint64),
        ("deadline", ctypes.c_uint64),
        ("period", ctypes.c_uint64),
    ]


def _set_fair_policy(policy: int, slice_ns: int) -> None:
    """``sched_setattr(2)`` on the calling thread: a fair ``policy`` with a custom slice.

    The thread's nice value is kept: sched_setattr sets it too, and raising it back would
    need a privilege. A kernel that predates custom slices (6.12) silently ignores
    ``sched_runtime`` for fair policies, which is harmless.
    """
    number = _SCHED_SETATTR.get(platform.machine())
    if number is None:
        raise OSError(errno.ENOSYS, f"no sched_setattr number known for {platform.machine()}")
    attr = _SchedAttr(
        size=ctypes.sizeof(_SchedAttr),
        policy=policy,
        nice=os.getpriority(os.PRIO_PROCESS, 0),  # Linux: the calling thread's
        runtime=slice_ns,
    )
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, 0, ctypes.byref(attr), 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))


def mark_retrieved(future: asyncio.Future[Any] | concurrent.futures.Future[Any]) -> None:
    """Mark a finished future's exception as seen; whoever awaits it later still gets it.

    Use it as a done-callback on futures the library may abandon, so asyncio never logs
    "exception was never retrieved" for an error that is reported some other way.
    """
    if not future.cancelled():
        future.exception()


def running_future() -> concurrent.futures.Future[Any]:
    """A :class:`concurrent.futures.Future` already marked running: ``cancel()`` is a no-op.

    ``asyncio.wrap_future`` cancels its source when the awaiting task is cancelled; the
    library's futures stand for work that goes on regardless (a copy, a commit), so a
    cancelled await must abandon the wait only.
    """
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    future.set_running_or_notify_cancel()
    return future


class DaemonThreadExecutor(concurrent.futures.Executor):
    """A single daemon thread running submitted calls in order.

    Unlike :class:`~concurrent.futures.ThreadPoolExecutor`, whose threads the
    interpreter joins at exit, a thread blocked here can never hang interpreter
    shutdown, even if a user forgot ``aclose()``. The futures it returns are already
    running (see :func:`running_future`): cancelling a wrapped await abandons the wait.
    """

    def __init__(self, name: str, *, setup: Callable[[], None] | None = None) -> None:
        self.name = name
        self._work: queue.SimpleQueue[
            tuple[concurrent.futures.Future[Any], Callable[[], Any]] | None
        ] = queue.SimpleQueue()
        self._shutdown = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, args=(setup,), name=name, daemon=True)
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        """The executor's thread."""
        return self._thread

    def submit(
        self, fn: Callable[..., _T], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[_T]:
        """Queue ``fn(*args, **kwargs)`` behind the calls already submitted."""
        future: concurrent.futures.Future[_T] = running_future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError(f"{self.name}: cannot schedule new work after shutdown")
            self._work.put((future, lambda: fn(*args, **kwargs)))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop after the calls already queued; ``wait`` joins the thread."""
        with self._lock:
            if not self._shutdown:
                self._shutdown = True
                self._work.put(None)
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def _run(self, setup: Callable[[], None] | None) -> None:
        if setup is not None:
            setup()
        while (item := self._work.get()) is not None:
            future, call = item
            del item
            try:
                future.set_result(call())
            except BaseException as exc:  # noqa: BLE001 - handed to whoever awaits the future
                future.set_exception(exc)
            # Hold nothing of the caller's while idle: a result (a loaded state) whose last
            # reference this daemon thread dropped during interpreter exit freed tensors
            # there, whose destructors take the GIL, which ends the thread mid-destructor
            # and aborts the process ("terminate called without an active exception").
            del future, call


class Handoff(Generic[_T]):
    """A result a thread hands to its awaiter by *moving* it: :meth:`take` empties it.

    A thread that completes a future keeps its own references (the future, the result on
    its stack) until ``set_result`` returns, and ``set_result`` wakes the event loop, which
    may run ahead meanwhile: take the result, let the user drop it. The thread's reference
    was then the last one, and the result was freed on that thread, holding the GIL: a
    64 MB ``bytes`` value's ``munmap`` stalled the loop for 3-5 ms during the *next* phase
    (73 of 200 small loads were freed on the load thread in one run). Wrapped in a
    ``Handoff``, the thread only ever holds the box, and the awaiter holds the value alone.
    """

    __slots__ = ("_value",)

    def __init__(self, value: _T) -> None:
        self._value: _T | None = value

    @classmethod
    def of(cls, fn: Callable[..., _T]) -> Callable[..., Handoff[_T]]:
        """``fn``, returning its result in a ``Handoff`` (for an executor's ``submit``)."""

        def call(*args: Any, **kwargs: Any) -> Handoff[_T]:
            return cls(fn(*args, **kwargs))

        return call

    def take(self) -> _T:
        """The value, once: the box lets go of it."""
        value, self._value = self._value, None
        return cast(_T, value)


class _Starter:
    """A daemon thread that starts threads for callers that must not wait for them.

    ``threading.Thread.start()`` returns only once the new thread runs; when every core is
    busy (a data loader's workers, another job) the kernel may leave it waiting for a CPU
    for tens of milliseconds, and a caller on an event loop's thread blocks the loop that
    long. :func:`start_thread` hands the start to this thread instead, which is itself
    started without that wait (``_thread.start_new_thread``) on first use, and again in a
    forked child (where it does not exist).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Start] = queue.SimpleQueue()
        self._pid = 0

    def start(self, request: _Start) -> None:
        with self._lock:
            if self._pid != os.getpid():  # first use, or a forked child: no starter yet
                self._queue = queue.SimpleQueue()
                self._pid = os.getpid()
                _thread.start_new_thread(self._run, (self._queue,))
            self._queue.put(request)

    @staticmethod
    def _run(requests: queue.SimpleQueue[_Start]) -> None:
        while True:
            target, args, name, failed = requests.get()
            try:
                threading.Thread(target=target, args=args, name=name, daemon=True).start()
            except Exception as exc:  # noqa: BLE001 - the caller's, through failed()
                failed(exc)


_Start = tuple[Callable[..., object], tuple[Any, ...], str, Callable[[BaseException], object]]
_STARTER = _Starter()


def start_thread(
    target: Callable[..., object],
    *args: Any,
    name: str,
    failed: Callable[[BaseException], object],
) -> None:
    """Start ``target(*args)`` on a new daemon thread named ``name``, without waiting for
    the thread to run (see :class:`_Starter`): safe on an event loop's thread. If the
    thread cannot start (``RuntimeError: can't start new thread``), ``failed(exc)`` is
    called instead, on the starter's thread."""
    _STARTER.start((target, args, name, failed))


async def run_in_thread(fn: Callable[..., _T], *args: Any, name: str) -> _T:
    """``await`` ``fn(*args)`` run on a fresh daemon thread (for bounded blocking steps).

    The result is handed over (:class:`Handoff`): it is freed where the caller drops it,
    never on the thread. Cancelling the await abandons the wait; the call runs to its end
    on its thread.
    """
    future: concurrent.futures.Future[Handoff[_T]] = running_future()

    def run() -> None:
        try:
            future.set_result(Handoff(fn(*args)))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever awaits the future
            future.set_exception(exc)

    start_thread(run, name=name, failed=future.set_exception)  # the loop never waits for it
    return (await asyncio.wrap_future(future)).take()


class LoopInbox:
    """Runs callbacks posted from any thread on one event loop, one wake-up per burst.

    :meth:`post` appends to a queue and wakes the loop only when the queue was empty, so a
    reader thread delivering fifty replies costs the loop one ``call_soon_threadsafe``.
    Posting after the loop was closed drops the callback (nobody is left to run it).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: collections.deque[tuple[Callable[..., object], tuple[Any, ...]]] = (
            collections.deque()
        )
        self._lock = threading.Lock()
        self._scheduled = False

    def post(self, callback: Callable[..., object], *args: Any) -> None:
        """Run ``callback(*args)`` on the loop, soon (from any thread, the loop's too)."""
        with self._lock:
            self._items.append((callback, args))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._run)
        except RuntimeError:  # the loop is closed: nobody listens any more
            with self._lock:
                self._items.clear()
                self._scheduled = False

    def flush(self) -> None:
        """Run what was posted so far, now (on the loop's thread only)."""
        self._run()

    def _run(self) -> None:
        with self._lock:
            items, self._items = self._items, collections.deque()
            self._scheduled = False
        for callback, args in items:
            try:
                callback(*args)
            except Exception as exc:  # noqa: BLE001 - reported as asyncio reports a callback's
                self.loop.call_exception_handler(
                    {"message": f"exception in {callback!r}", "exception": exc}
                )
