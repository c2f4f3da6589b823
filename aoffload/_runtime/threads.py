"""Threads the library owns: per-worker executors, and the portal of the sync adapters.

:class:`DaemonThreadExecutor` runs calls in order on one daemon thread (each worker has
its own, and so do the checkpoint engine's I/O and copy work). :func:`mark_retrieved`
is the one place that marks a future's exception as seen.

A portal is a private event loop on a daemon thread, for synchronous callers of the async objects.

DeepSpeed calls its checkpoint engine and its SuperOffload optimizer from plain synchronous
code. :class:`Portal` owns one event loop running on its own thread; the sync methods of the
adapters submit coroutines to it with :func:`asyncio.run_coroutine_threadsafe` and either wait
for the result (:meth:`Portal.call`) or keep the :class:`concurrent.futures.Future`
(:meth:`Portal.submit`). Exceptions come back unchanged in the caller's thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import sys
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from .._errors import ClosedError
from .loops import new_event_loop

__all__ = ["DaemonThreadExecutor", "Portal", "lower_priority", "mark_retrieved"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


def lower_priority() -> None:
    """Run the calling thread (and threads it starts later) as background work.

    Linux's ``SCHED_IDLE`` policy: any other thread that wakes up, the trainer's event
    loop first, takes the core at once, and the background thread (a staging copy, the
    checkpoint writer) runs on the cycles nobody else wants. Linux keeps the policy per
    thread, and threads inherit it from the thread that starts them, so nothing else in
    the process changes; elsewhere this does nothing.
    Lowering a thread's policy needs no privilege.
    """
    if sys.platform == "linux":
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))


def mark_retrieved(future: asyncio.Future[Any] | concurrent.futures.Future[Any]) -> None:
    """Mark a finished future's exception as seen; whoever awaits it later still gets it.

    Use it as a done-callback on futures the library may abandon, so asyncio never logs
    "exception was never retrieved" for an error that is reported some other way.
    """
    if not future.cancelled():
        future.exception()


class DaemonThreadExecutor(concurrent.futures.Executor):
    """A single daemon thread running submitted calls in order.

    Unlike :class:`~concurrent.futures.ThreadPoolExecutor`, whose threads the
    interpreter joins at exit, a thread blocked in ``recv()`` here can never hang
    interpreter shutdown, even if a user forgot ``aclose()``.
    """

    def __init__(self, name: str) -> None:
        self._work: queue.SimpleQueue[
            tuple[concurrent.futures.Future[Any], Callable[[], Any]] | None
        ] = queue.SimpleQueue()
        self._shutdown = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(
        self, fn: Callable[..., _T], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[_T]:
        """Queue ``fn(*args, **kwargs)`` behind the calls already submitted."""
        if self._shutdown:
            raise RuntimeError("cannot schedule new work after shutdown")
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()
        self._work.put((future, lambda: fn(*args, **kwargs)))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop after the calls already queued; ``wait`` joins the thread."""
        if not self._shutdown:
            self._shutdown = True
            self._work.put(None)
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            future, call = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as exc:  # noqa: BLE001 - handed to whoever awaits the future
                future.set_exception(exc)


class Portal:
    """An event loop running forever on a daemon thread until :meth:`close`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._loop = new_event_loop()
        self._closed = False
        self._lock = threading.Lock()
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(started,), name=f"aoffload-portal-{name}", daemon=True
        )
        self._thread.start()
        started.wait()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The portal's event loop (use it only from coroutines running on it)."""
        return self._loop

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(started.set)
        try:
            self._loop.run_forever()
        finally:
            try:
                tasks = asyncio.all_tasks(self._loop)
                for task in tasks:
                    task.cancel()
                if tasks:
                    self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
                self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            finally:
                asyncio.set_event_loop(None)
                self._loop.close()

    def _check(self) -> None:
        if self._closed:
            raise ClosedError(f"the {self.name} portal is closed")
        if threading.current_thread() is self._thread:
            raise RuntimeError(f"a blocking call into the {self.name} portal from its own loop")

    def submit(self, coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        """Schedule ``coro`` on the portal's loop and return its future at once."""
        try:
            self._check()
        except BaseException:
            coro.close()
            raise
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Run ``coro`` on the portal's loop and wait for it; its exception is re-raised here."""
        future = self.submit(coro)
        try:
            return future.result()
        except BaseException:
            # KeyboardInterrupt in the waiting thread: abandon the coroutine, not the portal.
            future.cancel()
            raise

    def call_soon(self, callback: Callable[[], object]) -> None:
        """Run ``callback`` on the portal's loop without waiting for it."""
        self._check()
        self._loop.call_soon_threadsafe(callback)

    def close(self) -> None:
        """Stop the loop (cancelling what still runs on it) and join the thread; idempotent."""
        if threading.current_thread() is self._thread:
            raise RuntimeError(f"the {self.name} portal cannot be closed from its own loop")
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        logger.debug("the %s portal is closed", self.name)
