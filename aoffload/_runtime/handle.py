"""One handle, two faces: what every aoffload call that waits returns.

A :class:`Handle` stands for work that runs on aoffload's threads and processes whether
or not anybody waits for it (a staging copy, a commit, a load, an upload). An asyncio
trainer ``await``\\ s it; a synchronous trainer calls :meth:`Handle.result` from any
thread; :meth:`Handle.done` tells without waiting. Either way the caller gets the same
value or the same error, and a wait that is abandoned (a cancelled ``await``, a
``result(timeout)`` that ran out) abandons the wait only: the work goes on, and the
handle can be waited for again.

Awaiting never drives anything: the work's own thread completes a
:class:`concurrent.futures.Future`, and the event loop is woken once, by a
``call_soon_threadsafe`` from that thread. A handle that is already done is awaited
without suspending.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar, cast

from .threads import Handoff, running_future, start_thread

__all__ = ["Handle", "in_thread"]

_T = TypeVar("_T")

_EMPTY: Any = object()


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class Handle(Generic[_T]):
    """The outcome of a call that waits: ``await handle`` or ``handle.result(timeout)``.

    The work behind a handle has already started when the call returns, and it runs to
    its end whoever waits: a cancelled ``await`` or a :meth:`result` whose ``timeout``
    ran out abandons that wait only, and the handle can be waited for again. Waiting
    either way returns the same value or raises the same error; the error counts as
    seen once it has been raised to a caller (the engine does not raise it again from
    its next call).
    """

    __slots__ = ("_claim", "_future", "_lock", "_seen", "_then", "_value")

    def __init__(
        self,
        future: concurrent.futures.Future[Any],
        *,
        then: Callable[[Any], _T] | None = None,
        seen: Callable[[BaseException], None] | None = None,
        claim: Callable[[], None] | None = None,
    ) -> None:
        """Wrap ``future``, a future that nobody can cancel (:func:`running_future`).

        ``then(value)`` makes the caller's value from the future's, on the waiting thread;
        ``seen(error)`` is told when the future's error is raised to a caller; ``claim()``,
        when a callback takes charge of the outcome before it is known.
        """
        self._future = future
        self._then = then
        self._seen = seen
        self._claim = claim
        self._value: Any = _EMPTY
        self._lock = threading.Lock()

    @classmethod
    def of(cls, value: _T) -> Handle[_T]:
        """A handle that is already done, with ``value``."""
        future: concurrent.futures.Future[Any] = running_future()
        future.set_result(value)
        return cls(future)

    def done(self) -> bool:
        """Whether the work has ended (successfully or not); never waits."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> _T:
        """Block the calling thread until the work has ended; its value, or raise its error.

        Any thread may call it, more than once. ``timeout`` (seconds; ``None``: no limit)
        bounds this wait only: when it runs out, :class:`TimeoutError` is raised and the
        work goes on.
        """
        self._wait_here(timeout)
        return self._outcome()

    def _wait_here(self, timeout: float | None) -> None:
        if not self._future.done():
            done, _ = concurrent.futures.wait([self._future], timeout)
            if not done:
                raise TimeoutError(
                    f"{self!r} did not finish within {timeout} s; the work goes on "
                    "(call result() again, or await it)"
                )

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait as :meth:`result` does; the work's error, or ``None`` if it succeeded.

        The error is returned, not raised; it counts as seen all the same (the engine does
        not raise it again from its next call).
        """
        self._wait_here(timeout)
        error = self._future.exception(timeout=0)
        if error is not None and self._seen is not None:
            self._seen(error)
        return error

    def add_done_callback(self, fn: Callable[[Handle[_T]], object]) -> None:
        """Call ``fn(handle)`` once the work has ended, on the thread that ended it (at
        once, on this thread, if it already has).

        The callback takes charge of the outcome: a failure is its to report (it reads it
        with :meth:`exception`), and the engine does not raise it again from its next
        call. ``fn`` runs on aoffload's threads: it must be quick and must not wait for
        other work of the engine; an exception it raises is logged.
        """
        if self._claim is not None:
            self._claim()

        def done(future: concurrent.futures.Future[Any]) -> None:
            if self._claim is None and self._seen is not None:
                error = future.exception()
                if error is not None:
                    self._seen(error)
            fn(self)

        self._future.add_done_callback(done)

    def __await__(self) -> Generator[Any, None, _T]:
        if not self._future.done():
            yield from self._wait().__await__()
        return self._outcome()

    async def _wait(self) -> None:
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()

        def done(_: concurrent.futures.Future[Any]) -> None:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits on it
                loop.call_soon_threadsafe(_wake, waiter)

        self._future.add_done_callback(done)
        await waiter

    def _outcome(self) -> _T:
        try:
            value = self._future.result(timeout=0)
        except BaseException as exc:
            if self._seen is not None:
                self._seen(exc)
            raise
        return self._finish(value)

    def _finish(self, value: Any) -> _T:
        """The caller's value, on the waiting thread. A :class:`Handoff` (a loaded state)
        is taken once and kept here, so that the last reference is the caller's."""
        if isinstance(value, Handoff):
            with self._lock:
                if self._value is _EMPTY:
                    self._value = value.take()
                value = self._value
        return self._then(value) if self._then is not None else cast(_T, value)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {'done' if self.done() else 'running'}>"


def in_thread(fn: Callable[..., _T], *args: Any, name: str) -> Handle[_T]:
    """Run ``fn(*args)`` on a fresh daemon thread; the :class:`Handle` of its result.

    For a bounded blocking call made on behalf of a caller without an engine (a load
    from a directory). The result is handed over (:class:`Handoff`): it is freed where
    the caller drops it, never on the thread.
    """
    future: concurrent.futures.Future[Any] = running_future()

    def run() -> None:
        try:
            future.set_result(Handoff(fn(*args)))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the handle
            future.set_exception(exc)

    start_thread(run, name=name, failed=future.set_exception)  # never waits for it to run
    return Handle(future)
