"""The one lifecycle of every worker-backed object, in two flavours.

Every worker-backed object has the same states (:class:`State`), the same running check
and the same idempotent close path::

    NEW --start--> STARTING --> RUNNING --close--> CLOSING --> CLOSED
                       \\--(start failed: cleaned up)------------^

- :class:`Resource` has both faces: ``with obj:`` and ``start()`` / ``close()`` for a
  synchronous caller, ``async with obj:`` and ``astart()`` / ``aclose()`` for an asyncio
  one (:class:`~aoffload.CheckpointEngine`). A subclass implements the blocking
  :meth:`Resource._open` and :meth:`Resource._close`; the asyncio face runs them on a
  thread of their own, so the loop never blocks.
- :class:`AsyncResource` has the asyncio face alone (``async with``, ``astart()``,
  ``aclose()``), for objects whose use needs a loop anyway
  (:class:`~aoffload._runtime.bridge.Bridge`, :class:`~aoffload.CPUAdam`).

``_close`` runs once, whether ``_open`` finished or failed half-way, so it must cope with
a partial start. A second close while the first runs waits for it. A cancelled
``aclose()`` stops waiting politely: ``_close`` must release everything in its
``finally`` blocks (killing a worker that has not exited yet), so the object is CLOSED
all the same.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
from typing import TypeVar

from .._errors import ClosedError
from .threads import run_in_thread

logger = logging.getLogger(__name__)

__all__ = ["AsyncResource", "Resource", "State"]

_L = TypeVar("_L", bound="_Lifecycle")
_S = TypeVar("_S", bound="Resource")


class State(enum.Enum):
    """Where a worker-backed object is in its lifecycle."""

    NEW = "new"
    STARTING = "starting"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"


class _Lifecycle:
    """What both flavours share: the state, the running check, ``async with``."""

    _what = "this object"
    """How errors name the object ("this CheckpointEngine", "the cpu-adam worker")."""
    _use = "use it inside `async with` (or after `await astart()`) and before `aclose()`"
    """What :meth:`check_running` tells the caller to do."""
    _state: State

    @property
    def state(self) -> State:
        """Where the object is in its lifecycle."""
        return self._state

    def _failing(self, exc: BaseException) -> None:
        """``exc`` is leaving the block that uses this object (before the close runs)."""

    async def astart(self) -> None:
        """Start the object (spawn its worker and wait until it is ready)."""
        raise NotImplementedError

    async def aclose(self) -> None:
        """Stop the worker and release every resource. Idempotent."""
        raise NotImplementedError

    def check_running(self) -> None:
        """Raise :class:`~aoffload.ClosedError` unless the object is running."""
        if self._state is not State.RUNNING:
            raise ClosedError(f"{self._what} is {self._state.value}; {self._use}")

    async def __aenter__(self: _L) -> _L:
        await self.astart()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._leaving(exc_info)
        await self.aclose()

    def _leaving(self, exc_info: tuple[object, ...]) -> None:
        """A block that used the object is left; with an exception, tell :meth:`_failing`."""
        if isinstance(exc_info[1], BaseException):
            self._failing(exc_info[1])


class AsyncResource(_Lifecycle):
    """The asyncio face alone: ``async with`` (``astart()`` on entry, ``aclose()`` on exit)."""

    def __init__(self) -> None:
        self._state = State.NEW
        self._closing: asyncio.Future[None] | None = None

    async def _open(self) -> None:
        """Acquire everything (spawn the worker); called once by :meth:`start`."""
        raise NotImplementedError

    async def _close(self) -> None:
        """Release everything; called once by :meth:`aclose` or a failed :meth:`start`."""
        raise NotImplementedError

    async def astart(self) -> None:
        """Start the object (spawn its worker and wait until it is ready)."""
        if self._state is not State.NEW:
            raise ClosedError(f"{self._what} was already started; create a new one")
        self._state = State.STARTING
        try:
            await self._open()
        except BaseException as exc:
            try:
                await self._run_close()
            except Exception as cleanup:  # the start's own error is the one to raise
                logger.exception("%s: cleaning up after a failed start also failed", self._what)
                exc.add_note(f"cleaning up after it also failed: {cleanup!r} (logged)")
            raise
        if self._state is State.STARTING:
            self._state = State.RUNNING

    async def aclose(self) -> None:
        """Stop the worker and release every resource. Idempotent."""
        if self._state is State.NEW:
            self._state = State.CLOSED
            return
        if self._state is State.STARTING:
            raise ClosedError(f"{self._what} is still starting; await astart() first")
        await self._run_close()

    async def _run_close(self) -> None:
        if self._closing is not None:
            await asyncio.shield(self._closing)
            return
        self._state = State.CLOSING
        self._closing = asyncio.get_running_loop().create_future()
        try:
            await self._close()
        finally:
            self._state = State.CLOSED
            self._closing.set_result(None)


class Resource(_Lifecycle):
    """Both faces of one lifecycle: ``with`` / ``start()`` / ``close()`` for a synchronous
    caller, ``async with`` / ``astart()`` / ``aclose()`` for an asyncio one.

    A subclass implements the blocking :meth:`_open` and :meth:`_close` (any thread may
    run them) and may override :meth:`_failing`, told of an exception that leaves a
    ``with`` block before the close runs.
    """

    _use = "use it inside `with` or `async with` (or after start()) and before close()"

    def __init__(self) -> None:
        self._state = State.NEW
        self._lifecycle = threading.Lock()
        self._closed = threading.Event()
        self._settled = threading.Event()  # the start has ended, one way or the other

    def _open(self) -> None:
        """Acquire everything (blocking); called once by :meth:`start`."""
        raise NotImplementedError

    def _close(self) -> None:
        """Release everything (blocking); called once by :meth:`close` or a failed start."""
        raise NotImplementedError

    def start(self) -> None:
        """Start the object: spawn its worker and wait until it is ready (blocking).

        In asyncio code, use ``async with`` or ``await astart()`` instead: they run this
        on a thread of their own.
        """
        with self._lifecycle:
            if self._state is not State.NEW:
                raise ClosedError(f"{self._what} was already started; create a new one")
            self._state = State.STARTING
        try:
            self._open()
        except BaseException as exc:
            try:
                self._run_close()
            except Exception as cleanup:  # the start's own error is the one to raise
                logger.exception("%s: cleaning up after a failed start also failed", self._what)
                exc.add_note(f"cleaning up after it also failed: {cleanup!r} (logged)")
            raise
        else:
            with self._lifecycle:
                if self._state is State.STARTING:
                    self._state = State.RUNNING
        finally:
            self._settled.set()

    async def astart(self) -> None:
        """:meth:`start`, awaited: the start runs on a thread of its own.

        Cancelling the await abandons the wait; the start runs on, and the object is
        closed when it has ended.
        """
        try:
            await run_in_thread(self.start, name="aoffload-start")
        except asyncio.CancelledError:
            await asyncio.shield(run_in_thread(self._close_after_start, name="aoffload-close"))
            raise

    def _close_after_start(self) -> None:
        self._settled.wait()  # the start ends (or fails) on its thread
        self.close()

    def close(self) -> None:
        """Stop the worker and release every resource (blocking). Idempotent.

        A second call while the first runs waits for it to end.
        """
        with self._lifecycle:
            if self._state is State.NEW:
                self._state = State.CLOSED
                self._closed.set()
                return
            if self._state is State.STARTING:
                raise ClosedError(f"{self._what} is still starting; wait for start() first")
        self._run_close()

    async def aclose(self) -> None:
        """:meth:`close`, awaited: the close runs on a thread of its own. Idempotent.

        Cancelling the await abandons the wait only: the close runs to its end.
        """
        if self._state is State.CLOSED:
            return
        await run_in_thread(self.close, name="aoffload-close")

    def _run_close(self) -> None:
        with self._lifecycle:
            first = self._state not in (State.CLOSING, State.CLOSED)
            if first:
                self._state = State.CLOSING
        if not first:
            self._closed.wait()
            return
        try:
            self._close()
        finally:
            self._state = State.CLOSED
            self._closed.set()

    def __enter__(self: _S) -> _S:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._leaving(exc_info)
        self.close()
