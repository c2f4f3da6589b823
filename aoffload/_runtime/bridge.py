"""The process bridge: the one place that spawns workers and talks to them.

A :class:`Bridge` owns one spawned worker process and everything around it:

* a *local* ``spawn`` context (the global start method is never touched) and two
  one-way pipes; the parent closes its copies of the child's ends right after
  ``start()``, so the worker's death shows up as EOF at once;
* one single-thread executor per worker (its *reader*) that spawns the process, then
  reads replies with blocking ``Connection.recv_bytes()`` calls wrapped in
  ``loop.run_in_executor``, and finally reaps the process once the pipe reports EOF.
  Each read takes every reply already waiting (a batch) and unpickles it on that
  thread, so one wake-up of the loop serves a burst and a large reply never stalls the
  loop. This needs nothing of the loop but ``run_in_executor``: it runs on asyncio's
  selector and proactor loops and on uvloop alike. Nothing polls, nothing sleeps;
* typed calls (:mod:`~aoffload._runtime.protocol`): ``call(WriteFile(...))`` returns a
  ``Future[FileRecord]``; a reply resolves it, a remote exception fails it with
  :class:`RemoteError`, the worker's death fails every pending and later call with
  :class:`WorkerDiedError`;
* requests are pickled and written on the loop while they are small; a ``large`` call
  (and anything queued behind it, to keep the order) is pickled and written on a
  second thread, the *sender*;
* the READY handshake under ``start_timeout`` and the shutdown ladder of
  :meth:`Bridge.aclose`: a :class:`Shutdown` call (queued behind the work already
  sent, so it drains), a bounded wait, then terminate, then kill.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import fcntl
import itertools
import logging
import multiprocessing
import pickle
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any, TypeVar

from .._errors import ClosedError, RemoteError, WorkerDiedError, WorkerStartupError, describe_exit
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
from .serve import worker_main
from .threads import DaemonThreadExecutor, mark_retrieved

__all__ = ["Bridge", "ReplyCallback"]

logger = logging.getLogger(__name__)

R = TypeVar("R")

ReplyCallback = Callable[[R | None, BaseException | None], None]
"""``callback(value, None)`` on a reply, ``callback(None, error)`` on failure, death or close."""

_Waiter = asyncio.Future[Any] | Callable[[Any, BaseException | None], None]

_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_PIPE_BYTES = 1 << 20
_BATCH = 256  # replies read per wake-up of the loop, at most
_TERMINATE_GRACE = 5.0


class _Unreadable:
    """A reply the trainer could not unpickle (the request it answered can never complete)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _read_batch(conn: Connection) -> list[Incoming | _Unreadable] | None:
    """Block for one reply, then take every reply already waiting; ``None`` at EOF."""
    batch: list[Incoming | _Unreadable] = []
    try:
        while True:
            data = conn.recv_bytes()
            try:
                batch.append(pickle.loads(data))
            except Exception as exc:  # noqa: BLE001 - handled on the loop (the worker is killed)
                batch.append(_Unreadable(exc))
            if len(batch) >= _BATCH or not conn.poll(0):
                return batch
    except (EOFError, OSError):
        return batch or None  # replies read before the EOF first; the next read sees it again


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
        self._target = target
        self._config = config
        self._start_timeout = start_timeout
        self._close_timeout = close_timeout
        self._ids = itertools.count()
        self._pending: dict[int, _Waiter] = {}
        self._death: WorkerDiedError | None = None
        self._serving = False
        self._pid: int | None = None
        self._exitcode: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future[int] | None = None
        self._exited: asyncio.Future[int | None] | None = None
        self._reader: DaemonThreadExecutor | None = None
        self._sender: DaemonThreadExecutor | None = None
        self._backlog = 0  # requests queued on the sender thread, not yet written
        self._process: multiprocessing.process.BaseProcess | None = None
        self._requests: Connection | None = None
        self._replies: Connection | None = None

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
    def outstanding(self) -> int:
        """Requests sent whose reply has not arrived yet (abandoned waits included)."""
        return len(self._pending)

    async def wait_exited(self) -> int | None:
        """Wait until the worker has exited and this bridge has seen it; its exit code.

        Once this returns, a worker that died while serving is reported by
        :meth:`check_running` (and every call) as :class:`WorkerDiedError`.
        """
        if self._exited is None:
            raise ClosedError(f"the {self.name} worker was never started")
        return await asyncio.shield(self._exited)

    # -- lifecycle -----------------------------------------------------------------------

    async def _open(self) -> None:
        """Spawn the worker and wait (at most ``start_timeout`` s) for its READY message."""
        loop = self._loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        self._exited = loop.create_future()
        ctx = multiprocessing.get_context("spawn")
        request_reader, request_writer = ctx.Pipe(duplex=False)
        reply_reader, reply_writer = ctx.Pipe(duplex=False)
        for end in (request_writer, reply_reader):
            try:
                fcntl.fcntl(end.fileno(), _F_SETPIPE_SZ, _PIPE_BYTES)
            except OSError:
                logger.debug("could not enlarge a pipe of the %s worker", self.name)
        self._requests, self._replies = request_writer, reply_reader
        self._process = ctx.Process(
            target=worker_main,
            args=(
                self._target,
                self._config,
                request_reader,
                reply_writer,
                logging.getLogger("aoffload").getEffectiveLevel(),
            ),
            name=f"aoffload-{self.name}",
            daemon=True,
        )
        self._reader = DaemonThreadExecutor(f"aoffload-{self.name}")
        try:
            await loop.run_in_executor(self._reader, self._process.start)
        finally:
            request_reader.close()
            reply_writer.close()
        self._pid = self._process.pid
        self._read_next()
        try:
            async with asyncio.timeout(self._start_timeout):
                await asyncio.shield(self._ready)
        except TimeoutError:
            raise WorkerStartupError(
                f"the {self.name} worker did not become ready within {self._start_timeout} s; "
                "raise start_timeout if the machine is slow, or check its log output"
            ) from None
        self._serving = True
        logger.debug("%s worker ready (pid %s)", self.name, self._pid)

    async def _close(self) -> None:
        """Shutdown (the worker drains what was sent), wait, terminate, kill; then release.

        Pending requests that the worker did not answer fail with :class:`ClosedError`.
        No process, thread or pipe is left behind.
        """
        process, exited = self._process, self._exited
        try:
            if process is not None and process.pid is not None and exited is not None:
                if self._serving and self._death is None:
                    self._post(Shutdown(), None)
                    await self._wait_exit(exited, process, graceful=True)
                else:
                    process.kill()
                    await self._wait_exit(exited, process, graceful=False)
        finally:
            if process is not None and exited is not None and not exited.done():
                process.kill()  # never leave the worker behind
            self._release()

    async def _wait_exit(
        self,
        exited: asyncio.Future[int | None],
        process: multiprocessing.process.BaseProcess,
        *,
        graceful: bool,
    ) -> None:
        ladder: tuple[tuple[Callable[[], None] | None, float], ...] = (
            (None, self._close_timeout),
            (process.terminate, _TERMINATE_GRACE),
            (process.kill, self._close_timeout),
        )
        if not graceful:
            ladder = ((None, self._close_timeout),)  # already killed by the caller
        for escalate, wait in ladder:
            if escalate is not None:
                logger.warning(
                    "the %s worker (pid %s) has not exited; sending %s",
                    self.name,
                    self._pid,
                    escalate.__name__,
                )
                escalate()
            try:
                async with asyncio.timeout(wait):
                    await asyncio.shield(exited)
                return
            except TimeoutError:
                continue
        logger.error("the %s worker (pid %s) outlived SIGKILL", self.name, self._pid)

    def _release(self) -> None:
        self._fail_pending(ClosedError(f"the {self.name} worker was closed before it replied"))
        process, exited = self._process, self._exited
        if process is not None and exited is not None and exited.done():
            with contextlib.suppress(ValueError):
                process.close()  # the two pipe fds multiprocessing keeps per process
        for conn in (self._requests, self._replies):
            if conn is not None:
                conn.close()
        # Once the exit was seen the reader thread is idle (it reaped the worker): join it.
        # Otherwise (the worker outlived SIGKILL) it may still block in a read: leave it.
        reaped = exited is not None and exited.done()
        for executor in (self._sender, self._reader):
            if executor is not None:
                executor.shutdown(wait=reaped)

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
        request = Request(request_id, call)
        if call.large or self._backlog:
            self._write_later(request)
            return
        try:
            self._write(request)
        except OSError:
            pass  # the pipe broke because the worker died: EOF fails the waiter at once
        except BaseException:
            self._pending.pop(request_id, None)
            raise

    def _write(self, request: Request) -> None:
        if self._requests is None:
            raise ClosedError(f"the {self.name} worker was never started")
        self._requests.send_bytes(ForkingPickler.dumps(request))

    def _write_later(self, request: Request) -> None:
        loop = self._loop
        if loop is None:
            raise ClosedError(f"the {self.name} worker was never started")
        if self._sender is None:
            self._sender = DaemonThreadExecutor(f"aoffload-{self.name}-sender")
        self._backlog += 1
        written = self._sender.submit(self._write, request)

        def done(future: concurrent.futures.Future[None]) -> None:
            loop.call_soon_threadsafe(self._written, request.id, future)

        written.add_done_callback(done)

    def _written(self, request_id: int, future: concurrent.futures.Future[None]) -> None:
        self._backlog -= 1
        error = future.exception()
        if error is None or isinstance(error, OSError):
            return  # written, or the worker died (EOF fails the waiter)
        waiter = self._pending.pop(request_id, None)
        if waiter is not None:
            self._complete(waiter, None, error)

    # -- reading replies: blocking reads on the reader thread ----------------------------

    def _read_next(self) -> None:
        loop, reader, replies = self._loop, self._reader, self._replies
        if loop is None or reader is None or replies is None:
            return
        batch = loop.run_in_executor(reader, _read_batch, replies)
        batch.add_done_callback(self._on_batch)

    def _on_batch(self, future: asyncio.Future[list[Incoming | _Unreadable] | None]) -> None:
        error = None if future.cancelled() else future.exception()
        if error is not None:
            logger.error("reading from the %s worker failed", self.name, exc_info=error)
        batch = None if future.cancelled() or error is not None else future.result()
        if batch is None:
            self._on_eof()
            return
        self._read_next()  # the next read blocks on the thread while this batch is handled
        for message in batch:
            if isinstance(message, LogEvent):
                logging.getLogger(message.name).log(
                    message.level, "[%s worker %s] %s", self.name, self._pid, message.message
                )
            elif isinstance(message, _Unreadable):
                logger.error(
                    "could not read a message from the %s worker; killing it, since the "
                    "request it answered can never complete",
                    self.name,
                    exc_info=message.error,
                )
                if self._process is not None:
                    self._process.kill()
            else:
                self._dispatch(message)

    def _on_eof(self) -> None:
        # The worker's end of the pipe is closed: it exited (or is exiting). Reaping it
        # blocks for the last moments of its exit, so that runs on the reader thread.
        process, loop, reader = self._process, self._loop, self._reader
        if process is None or loop is None or reader is None:
            return
        try:
            reaped = loop.run_in_executor(reader, process.join, self._close_timeout)
        except RuntimeError:  # the reader was shut down by a close: reap here, it is quick
            process.join(0)
            self._on_exit(process.exitcode)
            return
        reaped.add_done_callback(lambda _: self._on_exit(process.exitcode))

    # -- callbacks on the event loop -----------------------------------------------------

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
        if self._exited is not None and not self._exited.done():
            self._exited.set_result(exitcode)
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
