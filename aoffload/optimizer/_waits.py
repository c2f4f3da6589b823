"""How the optimizer's asyncio faces wait: on the core's outcomes and on its futures.

Nothing here drives work: the core's threads record outcomes and resolve futures whatever
the event loop does, and a wait only learns of it. A wait on the outcomes registers a
one-shot watcher (:meth:`~._results.Outcomes.watch`) whose firing posts to a
:class:`~aoffload._runtime.threads.LoopInbox`, so a burst of replies wakes the loop once,
and only when what the wait needs holds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable
from typing import Any, TypeVar

from .._errors import ClosedError, WorkerDiedError
from .._runtime.threads import LoopInbox, mark_retrieved
from ._results import Outcomes, Pending, Wait

__all__ = ["LoopWaits"]

T = TypeVar("T")


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _settle(source: concurrent.futures.Future[T], target: asyncio.Future[T]) -> None:
    if target.done():
        return  # the wait was cancelled: the outcome is dropped
    error = source.exception()
    if error is None:
        target.set_result(source.result())
    else:
        target.set_exception(error)
        if isinstance(error, (WorkerDiedError, ClosedError)):
            mark_retrieved(target)  # logged where it happened: an abandoned wait stays quiet


class LoopWaits:
    """The waits of one asyncio face on a core's outcomes and futures."""

    def __init__(self) -> None:
        self._inbox: LoopInbox | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver to ``loop`` (the one the face started on) with one inbox."""
        self._inbox = LoopInbox(loop)

    def _loop_inbox(self) -> LoopInbox:
        loop = asyncio.get_running_loop()
        if self._inbox is None or self._inbox.loop is not loop:
            return LoopInbox(loop)  # a wait on another loop than the one it started on
        return self._inbox

    async def until(self, outcomes: Outcomes, ready: Callable[[], bool]) -> None:
        """Wait until ``ready()`` (a predicate on ``outcomes``) holds; the thread whose change
        made it true wakes the loop."""
        inbox = self._loop_inbox()
        waiter: asyncio.Future[None] = inbox.loop.create_future()

        def fire() -> None:
            inbox.post(_wake, waiter)

        if not outcomes.watch(ready, fire):
            return
        try:
            await waiter
        finally:
            if waiter.cancelled():
                outcomes.unwatch(fire)

    async def next(self, outcomes: Outcomes, *, follow: bool) -> Pending | None:
        """The next finished step (:meth:`~._results.Outcomes.next`), awaited: a consumer
        that must wait registers its wake-up in the same critical section that found
        nothing."""
        pending = outcomes.next(follow=follow)
        while pending is Wait.WAIT:
            inbox = self._loop_inbox()
            waiter: asyncio.Future[None] = inbox.loop.create_future()
            fire = functools.partial(inbox.post, _wake, waiter)
            pending = outcomes.next(follow=follow, fire=fire)  # a race lost: no wait
            if pending is not Wait.WAIT:
                break
            try:
                await waiter
            finally:
                if waiter.cancelled():
                    outcomes.unwatch(fire)
            pending = outcomes.next(follow=follow)
        return pending

    async def result(self, future: concurrent.futures.Future[T]) -> T:
        """Await a core future's outcome; it reaches the loop through the inbox."""
        inbox = self._loop_inbox()
        waiter: asyncio.Future[T] = inbox.loop.create_future()
        future.add_done_callback(lambda done: inbox.post(_settle, done, waiter))
        return await waiter

    async def done(self, future: concurrent.futures.Future[Any]) -> None:
        """Wait until ``future`` is done, without taking its outcome (its owner reads it)."""
        if future.done():
            return
        inbox = self._loop_inbox()
        waiter: asyncio.Future[None] = inbox.loop.create_future()
        future.add_done_callback(lambda _: inbox.post(_wake, waiter))
        await waiter
