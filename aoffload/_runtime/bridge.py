"""The asyncio face of a worker: :class:`Bridge`, an :class:`~.resource.AsyncResource`
over a :class:`~.core.WorkerCore`.

The core does the work on its own threads and needs no loop; the bridge only hands its
outcomes to the event loop it started on, through one :class:`~.threads.LoopInbox`, so a
burst of replies wakes the loop once. ``call(WriteRecords(...))`` returns an
``asyncio.Future[FileRecord]`` that a reply resolves, a remote exception fails with
:class:`RemoteError` and the worker's death fails with :class:`WorkerDiedError` within
milliseconds. Cancelling an await abandons that wait only. The start waits for the READY
handshake under ``start_timeout``; the close is the core's shutdown ladder, run on a
thread of its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from .._errors import ClosedError, WorkerDiedError
from .core import WorkerCore
from .protocol import Call
from .resource import AsyncResource, State
from .threads import LoopInbox, mark_retrieved, run_in_thread

__all__ = ["Bridge", "ReplyCallback"]

logger = logging.getLogger(__name__)

R = TypeVar("R")

ReplyCallback = Callable[[R | None, BaseException | None], None]
"""``callback(value, None)`` on a reply, ``callback(None, error)`` on failure, death or close;
it runs on the event loop."""


def _settle(future: asyncio.Future[Any], value: object, error: BaseException | None) -> None:
    if future.done():
        return  # the waiter was cancelled: the reply is dropped
    if error is None:
        future.set_result(value)
    else:
        future.set_exception(error)
        if isinstance(error, (WorkerDiedError, ClosedError)):
            mark_retrieved(future)  # logged where it happened: an abandoned wait stays quiet


class Bridge(AsyncResource):
    """One spawned worker process serving ``target`` (``"module:Service"``) with ``config``.

    ``Service(config)`` runs in the worker (:class:`~aoffload._runtime.serve.Service`).
    Use as ``async with Bridge(...) as bridge: await bridge.request(SomeCall(...))``.
    :attr:`core` is the thread-safe core, for work that runs off the loop.
    """

    def __init__(
        self,
        target: str,
        config: object = None,
        *,
        name: str,
        start_timeout: float = 60.0,
        close_timeout: float = 30.0,
    ) -> None:
        super().__init__()
        self.name = name
        self._what = f"the {name} worker"
        self.core = WorkerCore(target, config, name=name, close_timeout=close_timeout)
        self._start_timeout = start_timeout
        self._inbox: LoopInbox | None = None

    # -- introspection -------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The worker's process id while it runs, else ``None``."""
        running = self._state in (State.RUNNING, State.CLOSING)
        return self.core.pid if running and self.core.death is None else None

    @property
    def exitcode(self) -> int | None:
        """The worker's exit code once it has exited (negative: killed by that signal)."""
        return self.core.exitcode

    @property
    def dead(self) -> bool:
        """Whether the worker died while it was serving (not closed by :meth:`aclose`)."""
        return self.core.death is not None

    @property
    def death(self) -> Exception | None:
        """How the worker died while it was serving, or ``None``."""
        return self.core.death

    @property
    def outstanding(self) -> int:
        """Requests sent whose reply has not arrived yet (abandoned waits included)."""
        return self.core.outstanding

    async def wait_exited(self) -> int | None:
        """Wait until the worker has exited and this bridge has seen it; its exit code.

        Once this returns, a worker that died while serving is reported by
        :meth:`check_running` (and every call) as :class:`WorkerDiedError`.
        """
        if self._state is State.NEW:
            raise ClosedError(f"the {self.name} worker was never started")
        return await asyncio.wrap_future(self.core.exited)

    # -- lifecycle -----------------------------------------------------------------------

    async def _open(self) -> None:
        """Spawn the worker and wait (at most ``start_timeout`` s) for its READY message."""
        self._inbox = LoopInbox(asyncio.get_running_loop())
        await run_in_thread(self.core.spawn, name=f"aoffload-{self.name}-spawn")
        try:
            async with asyncio.timeout(self._start_timeout):
                await asyncio.wrap_future(self.core.ready)
        except TimeoutError:
            raise self.core.startup_timeout(self._start_timeout) from None

    async def _close(self) -> None:
        """The core's ladder (drain, then kill) on a thread; then release."""
        try:
            await run_in_thread(self.core.stop, name=f"aoffload-{self.name}-stop")
        finally:
            if not self.core.exited.done():
                self.core.kill()  # cancelled: never leave the worker behind
            self.core.release()
            if self._inbox is not None:
                self._inbox.flush()  # every pending call has failed when aclose() returns

    # -- requests ------------------------------------------------------------------------

    def check_running(self) -> None:
        """Raise the reason this bridge cannot take requests, if any."""
        if self.core.death is not None:
            raise self.core.death
        super().check_running()

    def _loop_inbox(self) -> LoopInbox:
        self.check_running()
        if self._inbox is None:
            raise ClosedError(f"the {self.name} worker was never started")
        return self._inbox

    def call(self, call: Call[R]) -> asyncio.Future[R]:
        """Send ``call`` now and return the future of its reply (non-blocking).

        The future fails with :class:`RemoteError` if the call raised in the worker and
        with :class:`WorkerDiedError` if the worker dies first.
        """
        inbox = self._loop_inbox()
        future: asyncio.Future[R] = inbox.loop.create_future()
        self.core.submit_callback(
            call, lambda value, error: inbox.post(_settle, future, value, error)
        )
        return future

    def call_with_callback(self, call: Call[R], callback: ReplyCallback[R]) -> None:
        """Send ``call`` now; ``callback`` runs on the event loop when it completes.

        The lighter form of :meth:`call` for per-step traffic: no future. It receives
        ``(value, None)``, or ``(None, error)`` with the :class:`RemoteError`,
        :class:`WorkerDiedError` or :class:`ClosedError` a future would have raised.
        """
        inbox = self._loop_inbox()
        self.core.submit_callback(call, lambda value, error: inbox.post(callback, value, error))

    async def request(self, call: Call[R]) -> R:
        """Send ``call`` and await its reply. Cancelling abandons this wait only."""
        return await self.call(call)
