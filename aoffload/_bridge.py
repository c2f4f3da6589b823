"""The process bridge: the one place that spawns workers and talks to them.

A :class:`Bridge` owns one spawned worker process and everything around it:

* a *local* ``spawn`` context (the global start method is never touched) and two
  one-way pipes; the parent closes its copies of the child's ends right after
  ``start()``, so the worker's death shows up as EOF at once;
* replies read on the event loop itself: the reply pipe is non-blocking and watched
  with ``loop.add_reader``, so a reply costs one wake-up of the loop and no thread
  hand-off. Nothing polls, nothing sleeps. (A reader thread blocked in ``recv()``
  handing replies over with ``call_soon_threadsafe`` cost the trainer 2-4x more CPU
  per reply, which the optimizer's per-step results made the dominant overhead.)
* one single-thread executor per worker for the calls that do block: spawning the
  process (``run_in_executor``) and reaping it once its pipe reports EOF;
* request-id -> future routing: a reply resolves its future, a remote exception fails
  it with :class:`RemoteError`, the worker's death fails every pending and later
  request with :class:`WorkerDiedError`;
* the READY handshake under ``start_timeout`` and the shutdown ladder of
  :meth:`Bridge.aclose`: a SHUTDOWN request (queued behind the work already sent, so
  it drains), a bounded wait, then terminate, then kill.

Requests are written from the event loop thread: they are small (tensors travel
through shared memory, never through the pipe), and both pipes are enlarged so a
burst of requests never blocks the loop, and a loop busy elsewhere for a while never
blocks the worker's replies.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import fcntl
import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import struct
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any, TypeVar

from ._compat import timeout
from ._errors import (
    ClosedError,
    RemoteError,
    WorkerDiedError,
    WorkerStartupError,
    describe_exit,
)
from ._protocol import Control, Failure, Incoming, LogEvent, Ready, Reply, Request, StartupFailed
from ._worker import worker_main

__all__ = ["AsyncResource", "Bridge", "DaemonThreadExecutor", "ReplyCallback", "WorkerState"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

ReplyCallback = Callable[[Any, BaseException | None], None]
"""``callback(value, None)`` on a reply, ``callback(None, error)`` on failure, death or close."""
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_PIPE_BYTES = 1 << 20
_READ_CHUNK = 1 << 16
_TERMINATE_GRACE = 5.0
_SIZE = struct.Struct("!i")  # multiprocessing.Connection's frame header
_LONG_SIZE = struct.Struct("!Q")  # follows a -1 header for frames over 2 GiB


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
        if self._shutdown:
            raise RuntimeError("cannot schedule new work after shutdown")
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()
        self._work.put((future, lambda: fn(*args, **kwargs)))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
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


class _Frames:
    """Splits the byte stream of a :class:`~multiprocessing.connection.Connection` into frames.

    Fed whatever a non-blocking ``read()`` returned; returns the complete frame bodies
    (each one pickled message) and keeps a partial frame for the next feed.
    """

    def __init__(self) -> None:
        self._partial = bytearray()
        self.wanted = 0  # bytes still missing from the partial frame, when known

    def feed(self, chunk: bytes) -> list[bytes | memoryview]:
        if not self._partial:
            bodies, used = self._split(memoryview(chunk), copy=False)
            self._partial += chunk[used:]
            return bodies
        self._partial += chunk
        with memoryview(self._partial) as data:
            bodies, used = self._split(data, copy=True)
        del self._partial[:used]
        return bodies

    def _split(self, data: memoryview, *, copy: bool) -> tuple[list[bytes | memoryview], int]:
        bodies: list[bytes | memoryview] = []
        position, end = 0, len(data)
        self.wanted = 0
        while end - position >= _SIZE.size:
            (size,) = _SIZE.unpack_from(data, position)
            header = _SIZE.size
            if size == -1:
                if end - position < header + _LONG_SIZE.size:
                    break
                (size,) = _LONG_SIZE.unpack_from(data, position + header)
                header += _LONG_SIZE.size
            if end - position < header + size:
                self.wanted = header + size - (end - position)
                break
            body = data[position + header : position + header + size]
            bodies.append(bytes(body) if copy else body)
            position += header + size
        return bodies, position


_H = TypeVar("_H", bound="AsyncResource")


class AsyncResource:
    """``async with`` for every worker-backed object: ``start()`` on entry, ``aclose()`` on exit."""

    async def start(self) -> None:
        """Acquire the resource (spawn the worker)."""
        raise NotImplementedError

    async def aclose(self) -> None:
        """Release the resource; idempotent."""
        raise NotImplementedError

    async def __aenter__(self: _H) -> _H:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


class WorkerState(enum.Enum):
    """Lifecycle of a :class:`Bridge`."""

    NEW = "new"
    STARTING = "starting"
    RUNNING = "running"
    CLOSING = "closing"
    DEAD = "dead"
    CLOSED = "closed"


class Bridge(AsyncResource):
    """One spawned worker process serving ``target`` (``"module:factory"``) with ``config``.

    ``factory(config)`` runs in the worker and returns a :class:`~aoffload._worker.Service`.
    Use as ``async with Bridge(...) as bridge: await bridge.request(op, payload)``.
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
        self.name = name
        self._target = target
        self._config = config
        self._start_timeout = start_timeout
        self._close_timeout = close_timeout
        self._state = WorkerState.NEW
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future[Any] | ReplyCallback] = {}
        self._death: WorkerDiedError | None = None
        self._pid: int | None = None
        self._exitcode: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future[int] | None = None
        self._exited: asyncio.Future[int | None] | None = None
        self._executor: DaemonThreadExecutor | None = None
        self._reader: asyncio.Future[None] | None = None  # done once the pipe hit EOF, exit seen
        self._watched: int | None = None  # the reply fd while the loop watches it
        self._frames = _Frames()
        self._process: multiprocessing.process.BaseProcess | None = None
        self._requests: Connection | None = None
        self._replies: Connection | None = None

    # -- introspection -------------------------------------------------------------------

    @property
    def state(self) -> WorkerState:
        """Where the bridge is in its lifecycle."""
        return self._state

    @property
    def pid(self) -> int | None:
        """The worker's process id while it runs, else ``None``."""
        return self._pid if self._state in (WorkerState.RUNNING, WorkerState.CLOSING) else None

    @property
    def exitcode(self) -> int | None:
        """The worker's exit code once it has exited (negative: killed by that signal)."""
        return self._exitcode

    @property
    def outstanding(self) -> int:
        """Requests sent whose reply has not arrived yet (abandoned waits included)."""
        return len(self._pending)

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Spawn the worker and wait (at most ``start_timeout`` s) for its READY message."""
        if self._state is not WorkerState.NEW:
            raise ClosedError(f"the {self.name} worker was already started; create a new object")
        self._state = WorkerState.STARTING
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
        self._executor = DaemonThreadExecutor(f"aoffload-{self.name}")
        try:
            try:
                await loop.run_in_executor(self._executor, self._process.start)
            finally:
                request_reader.close()
                reply_writer.close()
            self._pid = self._process.pid
            self._reader = loop.create_future()
            self._watch(loop, reply_reader)
            async with timeout(self._start_timeout):
                await asyncio.shield(self._ready)
        except BaseException as exc:
            await self._abort_start()
            if isinstance(exc, asyncio.TimeoutError):
                raise WorkerStartupError(
                    f"the {self.name} worker did not become ready within {self._start_timeout} s; "
                    "raise start_timeout if the machine is slow, or check its log output"
                ) from None
            raise
        self._state = WorkerState.RUNNING
        logger.debug("%s worker ready (pid %s)", self.name, self._pid)

    async def _abort_start(self) -> None:
        self._state = WorkerState.CLOSING
        process, exited = self._process, self._exited
        try:
            if process is not None and process.pid is not None and exited is not None:
                process.kill()
                await self._wait_exit(exited, process, graceful=False)
            await self._join_reader()
        finally:
            self._finish()

    async def aclose(self) -> None:
        """Stop the worker: SHUTDOWN (it drains what was sent), wait, terminate, kill.

        Idempotent. Pending requests that the worker did not answer fail with
        :class:`ClosedError`. No process, thread or pipe is left behind.
        """
        if self._state in (WorkerState.NEW, WorkerState.CLOSED):
            self._state = WorkerState.CLOSED
            return
        if self._state is WorkerState.STARTING:
            raise ClosedError(f"the {self.name} worker is still starting; await start() first")
        if self._state is WorkerState.RUNNING:
            self._state = WorkerState.CLOSING
            with contextlib.suppress(OSError):  # already dead: the reader reports the exit
                self._send(Request(next(self._ids), Control.SHUTDOWN))
        exited, process = self._exited, self._process
        try:
            if exited is not None and process is not None:
                await self._wait_exit(exited, process, graceful=True)
            await self._join_reader()
        finally:
            if exited is not None and process is not None and not exited.done():
                process.kill()  # cancelled mid-ladder: never leave the worker behind
            self._finish()

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
                async with timeout(wait):
                    await asyncio.shield(exited)
                return
            except asyncio.TimeoutError:
                continue
        logger.error("the %s worker (pid %s) outlived SIGKILL", self.name, self._pid)

    async def _join_reader(self) -> None:
        reader = self._reader
        if reader is None or self._executor is None:
            return
        try:
            async with timeout(self._close_timeout):
                await asyncio.shield(reader)
        except asyncio.TimeoutError:
            logger.error("the %s worker's pipe never reported its exit; leaving it", self.name)
            return
        # The worker is reaped: the thread only has to take its stop item, microseconds.
        self._executor.shutdown(wait=True)

    def _finish(self) -> None:
        self._state = WorkerState.CLOSED
        self._unwatch()
        self._fail_pending(ClosedError(f"the {self.name} worker was closed before it replied"))
        process, exited = self._process, self._exited
        if process is not None and exited is not None and exited.done():
            # Closes the two pipe fds multiprocessing keeps per process until GC.
            with contextlib.suppress(ValueError):
                process.close()
        elif process is not None and process.pid is not None and self._executor is not None:
            # Closed before its exit was seen (a cancelled close): reap it off the loop,
            # on the thread that is about to stop, so no zombie is left behind.
            with contextlib.suppress(RuntimeError):
                self._executor.submit(process.join, self._close_timeout)
        for conn in (self._requests, self._replies):
            if conn is not None:
                conn.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False)

    # -- requests ------------------------------------------------------------------------

    def check(self) -> None:
        """Raise the reason this bridge cannot take requests, if any."""
        if self._death is not None:
            raise self._death
        if self._state is not WorkerState.RUNNING:
            raise ClosedError(
                f"the {self.name} worker is {self._state.value}; use the object inside "
                "`async with` (or after `await start()`) and before `aclose()`"
            )

    def send(self, op: enum.Enum, payload: object = None) -> asyncio.Future[Any]:
        """Send a request now and return the future of its reply (non-blocking).

        The future fails with :class:`RemoteError` if the operation raised in the worker
        and with :class:`WorkerDiedError` if the worker dies first.
        """
        self.check()
        if self._loop is None:
            raise ClosedError(f"the {self.name} worker was never started")
        future: asyncio.Future[Any] = self._loop.create_future()
        self._post(op, payload, future)
        return future

    def send_callback(self, op: enum.Enum, payload: object, callback: ReplyCallback) -> None:
        """Send a request now; ``callback`` runs on the event loop when it completes.

        The lighter form of :meth:`send` for per-step traffic: no future, and the
        callback runs in the loop iteration that reads the reply. It receives
        ``(value, None)``, or ``(None, error)`` with the :class:`RemoteError`,
        :class:`WorkerDiedError` or :class:`ClosedError` a future would have raised.
        """
        self.check()
        self._post(op, payload, callback)

    def _post(
        self, op: enum.Enum, payload: object, waiter: asyncio.Future[Any] | ReplyCallback
    ) -> None:
        request_id = next(self._ids)
        self._pending[request_id] = waiter
        try:
            self._send(Request(request_id, op, payload))
        except OSError:
            pass  # the pipe broke because the worker died: EOF fails the waiter at once
        except BaseException:
            del self._pending[request_id]
            raise

    async def request(self, op: enum.Enum, payload: object = None) -> Any:
        """Send a request and await its reply. Cancelling abandons this wait only."""
        return await self.send(op, payload)

    def _send(self, message: Request) -> None:
        if self._requests is None:
            raise ClosedError(f"the {self.name} worker was never started")
        self._requests.send(message)

    # -- reading replies on the event loop -----------------------------------------------

    def _watch(self, loop: asyncio.AbstractEventLoop, replies: Connection) -> None:
        fd = replies.fileno()
        os.set_blocking(fd, False)
        loop.add_reader(fd, self._on_readable)
        self._watched = fd

    def _unwatch(self) -> None:
        if self._watched is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._watched)
        self._watched = None

    def _on_readable(self) -> None:
        fd = self._watched
        if fd is None:
            return
        want = max(_READ_CHUNK, self._frames.wanted)
        try:
            chunk = os.read(fd, want)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._on_eof()
            return
        for body in self._frames.feed(chunk):
            self._receive(body)

    def _receive(self, body: bytes | memoryview) -> None:
        try:
            message: Incoming = pickle.loads(body)
        except Exception:  # a reply the trainer cannot unpickle
            logger.exception(
                "could not read a message from the %s worker; killing it, since "
                "the request it answered can never complete",
                self.name,
            )
            if self._process is not None:
                self._process.kill()
            return
        if isinstance(message, LogEvent):
            logging.getLogger(message.name).log(
                message.level, "[%s worker %s] %s", self.name, self._pid, message.message
            )
            return
        self._dispatch(message)

    def _on_eof(self) -> None:
        # The worker's end of the pipe is closed: it exited (or is exiting). Reaping it
        # blocks for the last moments of its exit, so that runs on the executor.
        self._unwatch()
        process, loop, executor = self._process, self._loop, self._executor
        if process is None or loop is None or executor is None:
            return
        reaped = loop.run_in_executor(executor, process.join, self._close_timeout)
        reaped.add_done_callback(lambda _: self._reaped(process))

    def _reaped(self, process: multiprocessing.process.BaseProcess) -> None:
        self._on_exit(process.exitcode)
        if self._reader is not None and not self._reader.done():
            self._reader.set_result(None)

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
        if isinstance(waiter, asyncio.Future):
            if waiter.done():
                return  # the waiter was cancelled: the reply is dropped
            if isinstance(message, Reply):
                waiter.set_result(message.value)
            else:
                waiter.set_exception(
                    RemoteError(message.remote_type, message.message, message.traceback)
                )
        elif isinstance(message, Reply):
            waiter(message.value, None)
        else:
            waiter(None, RemoteError(message.remote_type, message.message, message.traceback))

    def _on_exit(self, exitcode: int | None) -> None:
        self._exitcode = exitcode
        if self._exited is not None and not self._exited.done():
            self._exited.set_result(exitcode)
        if self._state is WorkerState.CLOSING:
            return
        death = WorkerDiedError(self.name, self._pid, exitcode)
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(
                WorkerStartupError(
                    f"the {self.name} worker (pid {self._pid}) {describe_exit(exitcode)} before it "
                    "was ready; see its output on stderr. A script that starts workers needs the "
                    "`if __name__ == '__main__':` guard that the spawn start method requires"
                )
            )
            return
        if self._state in (WorkerState.CLOSED, WorkerState.DEAD):
            return
        self._state = WorkerState.DEAD
        self._death = death
        logger.error("%s", death)
        self._fail_pending(death)

    def _fail_pending(self, error: Exception) -> None:
        pending, self._pending = self._pending, {}
        for waiter in pending.values():
            if not isinstance(waiter, asyncio.Future):
                waiter(None, error)
            elif not waiter.done():
                waiter.set_exception(error)
                # The bridge logged why; a future nobody awaits must not log it again at GC.
                waiter.exception()
