"""The one lifecycle of every worker-backed object.

:class:`AsyncResource` gives :class:`~aoffload._runtime.bridge.Bridge`,
:class:`~aoffload.CheckpointEngine` and :class:`~aoffload.CPUAdam` the same states
(:class:`State`), the same running check and the same idempotent close path::

    NEW --start()--> STARTING --> RUNNING --aclose()--> CLOSING --> CLOSED
                         \\--(start failed: cleaned up)----------------^

A subclass implements :meth:`AsyncResource._open` and :meth:`AsyncResource._close`;
``start()``/``aclose()``/``async with`` are written once, here. ``_close`` runs once,
whether ``_open`` finished or failed half-way, so it must cope with a partial start.
A second ``aclose()`` while the first runs waits for it. A cancelled ``aclose()``
stops waiting politely: ``_close`` must release everything in its ``finally`` blocks
(killing a worker that has not exited yet), so the object is CLOSED all the same.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from types import TracebackType
from typing import TypeVar

from .._errors import ClosedError

logger = logging.getLogger(__name__)

__all__ = ["AsyncResource", "State"]

_R = TypeVar("_R", bound="AsyncResource")


class State(enum.Enum):
    """Where a worker-backed object is in its lifecycle."""

    NEW = "new"
    STARTING = "starting"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"


class AsyncResource:
    """``async with`` for every worker-backed object: ``start()`` on entry, ``aclose()`` on exit."""

    _what = "this object"
    """How errors name the object ("the CheckpointEngine", "the cpu-adam worker")."""

    def __init__(self) -> None:
        self._state = State.NEW
        self._closing: asyncio.Future[None] | None = None

    @property
    def state(self) -> State:
        """Where the object is in its lifecycle."""
        return self._state

    async def _open(self) -> None:
        """Acquire everything (spawn the worker); called once by :meth:`start`."""
        raise NotImplementedError

    async def _close(self) -> None:
        """Release everything; called once by :meth:`aclose` or a failed :meth:`start`."""
        raise NotImplementedError

    async def start(self) -> None:
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
            raise ClosedError(f"{self._what} is still starting; await start() first")
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

    def check_running(self) -> None:
        """Raise :class:`~aoffload.ClosedError` unless the object is running."""
        if self._state is not State.RUNNING:
            raise ClosedError(
                f"{self._what} is {self._state.value}; use it inside `async with` "
                "(or after `await start()`) and before `aclose()`"
            )

    async def __aenter__(self: _R) -> _R:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
