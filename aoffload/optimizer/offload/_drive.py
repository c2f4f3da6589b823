"""Running a step's flow (:mod:`._step`) to its end: blocking, awaited, or left to a thread.

A flow yields what it waits for: :data:`~._step.OUTCOMES` (a step's outcome, or none in
flight) or a :class:`concurrent.futures.Future`. :func:`drive` blocks the calling thread on
each (``step()``, ``close()``); :func:`adrive` awaits each without blocking the loop
(``astep()``), and the loop wakes once per burst of outcomes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Generator
from typing import Any, TypeVar

from ..._runtime.threads import running_future, start_thread
from .._results import Outcomes
from .._waits import LoopWaits
from ._step import OUTCOMES

__all__ = ["adrive", "drive"]

T = TypeVar("T")

_Flow = Generator[Any, None, T]


def _block(outcomes: Outcomes, need: object) -> None:
    if need is OUTCOMES:
        outcomes.wait(outcomes.has_next)
    elif isinstance(need, concurrent.futures.Future):
        concurrent.futures.wait([need])


def drive(outcomes: Outcomes, flow: _Flow[T], need: object = None) -> T:
    """Run ``flow`` to its end on this thread, blocking for what it waits on; ``need``: what
    it waits on already (a flow taken over half-way)."""
    try:
        if need is None:
            need = next(flow)
        while True:
            _block(outcomes, need)
            need = flow.send(None)
    except StopIteration as stop:
        value: T = stop.value
        return value


def _later(outcomes: Outcomes, flow: _Flow[T], need: object) -> concurrent.futures.Future[T]:
    done: concurrent.futures.Future[T] = running_future()

    def finish() -> None:
        try:
            done.set_result(drive(outcomes, flow, need))
        except BaseException as exc:  # noqa: BLE001 - raised by whoever waits for it next
            done.set_exception(exc)

    # handed to a starter thread: the caller (astep() on an event loop) never waits for it to run
    start_thread(finish, name="aoffload-offload-adam-step", failed=done.set_exception)
    return done


async def adrive(
    waits: LoopWaits,
    outcomes: Outcomes,
    flow: _Flow[T],
    finished: Callable[[T], None],
    abandoned: Callable[[concurrent.futures.Future[T]], None],
) -> T:
    """Await ``flow`` to its end, never blocking the loop; ``finished(value)`` is told its
    value (also when the wait was cancelled).

    A first cancellation lets the flow finish, then raises :class:`asyncio.CancelledError`
    (the parameters must be updated before the next forward). A second abandons the wait:
    the flow finishes on a thread, whose future goes to ``abandoned`` before the error is
    raised.
    """
    need: object = None
    cancelled = False
    try:
        need = next(flow)
        while True:
            try:
                if need is OUTCOMES:
                    await waits.until(outcomes, outcomes.has_next)
                elif isinstance(need, concurrent.futures.Future):
                    await waits.done(need)
            except asyncio.CancelledError:
                if cancelled:
                    abandoned(_later(outcomes, flow, need))
                    raise
                cancelled = True  # finish the flow, then raise
                continue
            need = flow.send(None)
    except StopIteration as stop:
        value: T = stop.value
    finished(value)
    if cancelled:
        raise asyncio.CancelledError
    return value
