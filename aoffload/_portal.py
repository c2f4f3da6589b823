"""A private event loop on a daemon thread, for synchronous callers of the async objects.

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
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from ._errors import ClosedError

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


def _new_loop() -> asyncio.AbstractEventLoop:
    # Same choice as aoffload.run: uvloop when installed, else asyncio's default loop.
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


class Portal:
    """An event loop running forever on a daemon thread until :meth:`close`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._loop = _new_loop()
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
