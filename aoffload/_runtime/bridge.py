"""The process bridge: the one place that spawns workers and talks to them.

A :class:`Bridge` owns one worker (:class:`~.process.WorkerProcess`: the spawned
process, its pipes, the reader thread that reads replies through
``loop.run_in_executor`` and the sender thread for large requests) and everything the
trainer sees of it:

* typed calls (:mod:`~aoffload._runtime.protocol`): ``call(WriteFile(...))`` returns a
  ``Future[FileRecord]``; a reply resolves it, a remote exception fails it with
  :class:`RemoteError`, the worker's death fails every pending and later call with
  :class:`WorkerDiedError` within milliseconds (EOF on the reply pipe);
* the READY handshake under ``start_timeout``, and the close of
  :class:`~.resource.AsyncResource`: a :class:`Shutdown` call (queued behind the work
  already sent, so it drains), then the process's shutdown ladder (wait, terminate,
  kill). Pending calls the worker did not answer fail with :class:`ClosedError`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from .._errors import ClosedError, RemoteError, WorkerDiedError, WorkerStartupError, describe_exit
from .process import Batch, Unreadable, WorkerProcess
from .protocol import (
    Call,
    Failure,
    Incoming,
    LogEvent,
    Ready,
    Reply,
    Request,
    Shutdown,
    StartupFailed,
)
from .resource import AsyncResource, State
from .threads import mark_retrieved

__all__ = ["Bridge", "ReplyCallback"]

logger = logging.getLogger(__name__)

R = TypeVar("R")

ReplyCallback = Callable[[R | None, BaseException | None], None]
"""``callback(value, None)`` on a reply, ``callback(None, error)`` on failure, death or close."""

_Waiter = asyncio.Future[Any] | Callable[[Any, BaseException | None], None]


class Bridge(AsyncResource):
    """One spawned worker process serving ``target`` (``"module:factory"``) with ``config``.

    ``factory(config)`` runs in the worker and returns a :class:`~aoffload._runtime.serve.Service`.
    Use as ``async with Bridge(...) as bridge: await bridge.request(SomeCall(...))``.
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
        self._worker = WorkerProcess(target, config, name=name, close_timeout=close_timeout)
        self._start_timeout = start_timeout
        self._ids = itertools.count()
        self._pending: dict[int, _Waiter] = {}
        self._death: WorkerDiedError | None = None
        self._serving = False
        self._pid: int | None = None
        self._exitcode: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future[int] | None = None

    # -- introspection -------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The worker's process id while it runs, else ``None``."""
        alive = self._state in (State.RUNNING, State.CLOSING) and self._death is None
        return self._pid if alive else None

    @property
    def exitcode(self) -> int | None:
        """The worker's exit code once it has exited (negative: killed by that signal)."""
        return self._exitcode

    @property
    def dead(self) -> bool:
        """Whether the worker died while it was serving (not closed by :meth:`aclose`)."""
        return self._death is not None

    @property
    def death(self) -> WorkerDiedError | None:
        """How the worker died while it was serving, or ``None``."""
        return self._death

    @property
    def outstanding(self) -> int:
        """Requests sent whose reply has not arrived yet (abandoned waits included)."""
        return len(self._pending)

    async def wait_exited(self) -> int | None:
        """Wait until the worker has exited and this bridge has seen it; its exit code.

        Once this returns, a worker that died while serving is reported by
        :meth:`check_running` (and every call) as :class:`WorkerDiedError`.
        """
        exited = self._worker.exited
        if exited is None:
            raise ClosedError(f"the {self.name} worker was never started")
        # The bridge's own callback on `exited` was added first, so it has run by now.
        return await asyncio.shield(exited)

    # -- lifecycle -----------------------------------------------------------------------

    async def _open(self) -> None:
        """Spawn the worker and wait (at most ``start_timeout`` s) for its READY message."""
        loop = self._loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        await self._worker.spawn()
        self._pid = self._worker.pid
        if self._worker.exited is not None:
            self._worker.exited.add_done_callback(lambda done: self._on_exit(done.result()))
        self._worker.read(self._on_batch)
        try:
            async with asyncio.timeout(self._start_timeout):
                await asyncio.shield(self._ready)
        except TimeoutError:
            self._ready.cancel()  # the close kills the worker: its exit is no news
            raise WorkerStartupError(
                f"the {self.name} worker did not become ready within {self._start_timeout} s; "
                "raise start_timeout if the machine is slow, or check its log output"
            ) from None
        self._serving = True
        logger.debug("%s worker ready (pid %s)", self.name, self._pid)

    async def _close(self) -> None:
        """Shutdown (the worker drains what was sent), then the ladder; then release."""
        try:
            graceful = self._serving and self._death is None
            if graceful:
                self._post(Shutdown(), None)
            await self._worker.stop(graceful=graceful)
        finally:
            self._fail_pending(ClosedError(f"the {self.name} worker was closed before it replied"))
            self._worker.release()

    # -- requests ------------------------------------------------------------------------

    def check_running(self) -> None:
        """Raise the reason this bridge cannot take requests, if any."""
        if self._death is not None:
            raise self._death
        super().check_running()

    def call(self, call: Call[R]) -> asyncio.Future[R]:
        """Send ``call`` now and return the future of its reply (non-blocking).

        The future fails with :class:`RemoteError` if the call raised in the worker and
        with :class:`WorkerDiedError` if the worker dies first.
        """
        self.check_running()
        if self._loop is None:
            raise ClosedError(f"the {self.name} worker was never started")
        future: asyncio.Future[R] = self._loop.create_future()
        self._post(call, future)
        return future

    def call_with_callback(self, call: Call[R], callback: ReplyCallback[R]) -> None:
        """Send ``call`` now; ``callback`` runs on the event loop when it completes.

        The lighter form of :meth:`call` for per-step traffic: no future. It receives
        ``(value, None)``, or ``(None, error)`` with the :class:`RemoteError`,
        :class:`WorkerDiedError` or :class:`ClosedError` a future would have raised.
        """
        self.check_running()
        self._post(call, callback)

    async def request(self, call: Call[R]) -> R:
        """Send ``call`` and await its reply. Cancelling abandons this wait only."""
        return await self.call(call)

    def _post(self, call: Call[Any], waiter: _Waiter | None) -> None:
        request_id = next(self._ids)
        if waiter is not None:
            self._pending[request_id] = waiter

        def failed(error: BaseException) -> None:  # a large request could not be written
            failed_waiter = self._pending.pop(request_id, None)
            if failed_waiter is not None:
                self._complete(failed_waiter, None, error)

        try:
            self._worker.send(Request(request_id, call), large=call.large, failed=failed)
        except BaseException:
            self._pending.pop(request_id, None)
            raise

    # -- callbacks on the event loop -----------------------------------------------------

    def _on_batch(self, batch: Batch) -> None:
        for message in batch:
            if isinstance(message, LogEvent):
                logging.getLogger(message.name).log(
                    message.level, "[%s worker %s] %s", self.name, self._pid, message.message
                )
            elif isinstance(message, Unreadable):
                logger.error(
                    "could not read a message from the %s worker; killing it, since the "
                    "request it answered can never complete",
                    self.name,
                    exc_info=message.error,
                )
                self._worker.kill()
            else:
                self._dispatch(message)

    def _dispatch(self, message: Incoming) -> None:
        if isinstance(message, Ready):
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(message.pid)
            return
        if isinstance(message, StartupFailed):
            if self._ready is not None and not self._ready.done():
                self._ready.set_exception(
                    WorkerStartupError(
                        f"the {self.name} worker failed to start: {message.remote_type}: "
                        f"{message.message}\n\nWorker traceback:\n{message.traceback}"
                    )
                )
            return
        if not isinstance(message, (Reply, Failure)):
            logger.error("the %s worker sent an unknown message %r", self.name, message)
            return
        waiter = self._pending.pop(message.id, None)
        if waiter is None:
            return
        if isinstance(message, Reply):
            self._complete(waiter, message.value, None)
        else:
            error = RemoteError(message.remote_type, message.message, message.traceback)
            self._complete(waiter, None, error)

    @staticmethod
    def _complete(waiter: _Waiter, value: object, error: BaseException | None) -> None:
        if not isinstance(waiter, asyncio.Future):
            waiter(value, error)
        elif waiter.done():
            return  # the waiter was cancelled: the reply is dropped
        elif error is None:
            waiter.set_result(value)
        else:
            waiter.set_exception(error)

    def _on_exit(self, exitcode: int | None) -> None:
        self._exitcode = exitcode
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(
                WorkerStartupError(
                    f"the {self.name} worker (pid {self._pid}) {describe_exit(exitcode)} before it "
                    "was ready; see its output on stderr. A script that starts workers needs the "
                    "`if __name__ == '__main__':` guard that the spawn start method requires"
                )
            )
            return
        if self._state is not State.RUNNING or self._death is not None:
            return  # closing: the close reports what is left
        self._death = WorkerDiedError(self.name, self._pid, exitcode)
        logger.error("%s", self._death)
        self._fail_pending(self._death)

    def _fail_pending(self, error: Exception) -> None:
        pending, self._pending = self._pending, {}
        for waiter in pending.values():
            self._complete(waiter, None, error)
            if isinstance(waiter, asyncio.Future):
                mark_retrieved(waiter)  # the bridge logged why; a future nobody awaits stays quiet
