"""The bridge core: one worker process as every thread of the trainer sees it.

:class:`WorkerCore` is the one place that talks to a worker, and it needs no event loop.
Any thread may send a typed call (:meth:`WorkerCore.submit` returns a
:class:`concurrent.futures.Future`; :meth:`WorkerCore.submit_callback` runs a callback
instead), and a thread of the core delivers the outcome:

* the *reader* thread blocks in the reply pipe's reads for the worker's whole life. Each
  wake-up takes every reply already waiting, unpickles it and resolves its waiter on that
  thread; worker log records are re-emitted on the trainer's loggers. At EOF (the worker
  is gone: the parent closed its copy of the child's pipe end, so a death shows at once)
  it reaps the process, fails every pending and later call with
  :class:`~aoffload.WorkerDiedError` unless a close asked for the exit, and resolves
  :attr:`WorkerCore.exited`;
* the *sender* thread, started on first need, writes requests that pickle to more than
  64 KiB (a small write never blocks on the 1 MiB pipe, so it is written by the caller);
  anything sent while it has work queued goes behind it, so order is kept.

The asyncio API (:class:`~.bridge.Bridge`) is a face on this core, and so are the
synchronous DeepSpeed adapters and the checkpoint engine's threads, which use it directly.
:meth:`WorkerCore.stop` is the shutdown ladder: a ``Shutdown`` call (queued behind the work
already sent, so the worker drains), a bounded wait, then SIGKILL. There is no SIGTERM step:
workers ignore SIGTERM (it is the job's signal, see :data:`.serve.JOB_SIGNALS`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import pickle
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any, TypeVar

from .._errors import ClosedError, RemoteError, WorkerDiedError, WorkerStartupError, describe_exit
from .launcher import PRELOAD
from .process import WorkerProcess
from .protocol import Call, Failure, LogEvent, Ready, Reply, Request, Shutdown, StartupFailed
from .threads import DaemonThreadExecutor, mark_retrieved, running_future

__all__ = ["Callback", "WorkerCore"]

logger = logging.getLogger(__name__)

R = TypeVar("R")

Callback = Callable[[Any, BaseException | None], None]
"""``callback(value, None)`` on a reply, ``callback(None, error)`` on failure, death or close.
It runs on the core's reader thread (or on the thread whose call found the worker gone)."""

_Waiter = concurrent.futures.Future[Any] | Callback
_BATCH = 256  # replies read per wake-up, at most
_INLINE_WRITE = 1 << 16  # bytes: a bigger request is written on the sender thread


def _dumps(request: Request) -> bytes | memoryview:
    """``request`` pickled: plainly for a :attr:`Call.plain` call, else with multiprocessing's
    reducers (tensors in shared memory travel by handle)."""
    if request.call.plain:
        return pickle.dumps(request, pickle.HIGHEST_PROTOCOL)
    return ForkingPickler.dumps(request)


def _complete(waiter: _Waiter, value: object, error: BaseException | None) -> None:
    if not isinstance(waiter, concurrent.futures.Future):
        waiter(value, error)
    elif error is None:
        waiter.set_result(value)
    else:
        waiter.set_exception(error)


class WorkerCore:
    """The worker serving ``target`` (``"module:Service"``) with ``config``; thread-safe.

    ``spawn()`` starts it, :attr:`ready` resolves to its pid once its service is built
    (:meth:`start` does both and waits), ``submit``/``request`` talk to it, ``stop()``
    closes it and ``release()`` frees what is left. :attr:`exited` resolves to the exit
    code once the process is reaped.
    """

    def __init__(
        self,
        target: str,
        config: object,
        *,
        name: str,
        close_timeout: float,
        preload: tuple[str, ...] = PRELOAD,
    ) -> None:
        self.name = name
        self._process = WorkerProcess(target, config, name=name, preload=preload)
        self._close_timeout = close_timeout
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._ids = itertools.count()
        self._pending: dict[int, _Waiter] = {}
        self._requests: Connection | None = None
        self._replies: Connection | None = None
        self._sender: DaemonThreadExecutor | None = None
        self._backlog = 0
        self._spawned = False
        self._serving = False
        self._closing = False
        self._released = False
        self._death: WorkerDiedError | None = None
        self.ready: concurrent.futures.Future[int] = running_future()
        """Resolves to the worker's pid once its service is built; fails if it never is."""
        self.exited: concurrent.futures.Future[int | None] = running_future()
        """Resolves to the exit code once the process is reaped (after the death is set)."""
        self.ready.add_done_callback(mark_retrieved)

    # -- introspection -------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The worker's process id while it runs, else ``None``."""
        return self._process.pid if self._spawned and not self.exited.done() else None

    @property
    def exitcode(self) -> int | None:
        """The worker's exit code once it has exited (negative: killed by that signal)."""
        return self._process.exitcode

    @property
    def death(self) -> WorkerDiedError | None:
        """How the worker died while it was serving, or ``None``."""
        return self._death

    @property
    def outstanding(self) -> int:
        """Requests sent whose reply has not arrived yet (abandoned waits included)."""
        return len(self._pending)

    def check_running(self) -> None:
        """Raise why this worker cannot take calls: it died, or it is not running."""
        if self._death is not None:
            raise self._death
        if not self._serving or self._closing:
            state = "closed" if self._closing else "not started"
            raise ClosedError(f"the {self.name} worker is {state}")

    # -- lifecycle -----------------------------------------------------------------------

    def spawn(self) -> None:
        """Start the process and its reader thread (blocks for a few ms); see :attr:`ready`."""
        if self._spawned:
            raise ClosedError(f"the {self.name} worker was already started")
        level = logging.getLogger("aoffload").getEffectiveLevel()
        self._requests, self._replies = self._process.spawn(level)
        self._spawned = True
        threading.Thread(
            target=self._read, args=(self._replies,), name=f"aoffload-{self.name}", daemon=True
        ).start()

    def start(self, timeout: float) -> None:
        """Spawn and wait until the service is ready (at most ``timeout`` s); blocking.

        Raises :class:`WorkerStartupError`; a worker that did not start is stopped.
        """
        try:
            self.spawn()
            try:
                self.ready.result(timeout)
            except concurrent.futures.TimeoutError:
                raise self.startup_timeout(timeout) from None
        except BaseException:
            self.stop()
            self.release()
            raise

    def startup_timeout(self, timeout: float) -> WorkerStartupError:
        """The error of a worker that did not become ready within ``timeout`` s."""
        return WorkerStartupError(
            f"the {self.name} worker did not become ready within {timeout} s; raise "
            "start_timeout if the machine is slow, or check its log output"
        )

    def kill(self) -> None:
        """SIGKILL the worker (its death is reported like any other)."""
        self._process.kill()

    def stop(self) -> None:
        """Close the worker: drain and exit if it serves, else kill; blocks (the ladder).

        A serving worker gets a ``Shutdown`` call behind the work already sent, then
        ``close_timeout`` s to exit, then SIGKILL (workers ignore SIGTERM). Whatever happens,
        the process does not outlive this call unless it outlives SIGKILL.
        """
        if not self._spawned:
            return
        with self._lock:
            graceful = self._serving and self._death is None and not self._closing
            self._closing = True
        try:
            if graceful:
                self._post(Shutdown(), None)
            else:
                self._process.kill()
            for escalate in (False, True):
                if escalate:
                    logger.warning(
                        "the %s worker (pid %s) has not exited within close_timeout=%s s; "
                        "killing it",
                        self.name,
                        self._process.pid,
                        self._close_timeout,
                    )
                    self._process.kill()
                with contextlib.suppress(concurrent.futures.TimeoutError):
                    self.exited.result(self._close_timeout)
                    return
            logger.error("the %s worker (pid %s) outlived SIGKILL", self.name, self._process.pid)
        finally:
            if not self.exited.done():
                self._process.kill()

    def release(self) -> None:
        """Fail what is still pending with :class:`ClosedError`; close pipes and threads."""
        with self._lock:
            self._released = self._closing = True
            pending, self._pending = self._pending, {}
        error = ClosedError(f"the {self.name} worker was closed before it replied")
        for waiter in pending.values():
            _complete(waiter, None, error)
        reaped = self.exited.done()
        if self._sender is not None:
            self._sender.shutdown(wait=reaped)
        with self._send_lock:
            if self._requests is not None:
                self._requests.close()
                self._requests = None
        if reaped:  # the reader thread is done with the reply pipe
            if self._replies is not None:
                self._replies.close()
                self._replies = None
            self._process.release()

    # -- calls ---------------------------------------------------------------------------

    def submit(self, call: Call[R]) -> concurrent.futures.Future[R]:
        """Send ``call`` now; the future of its reply (fails with :class:`RemoteError`,
        :class:`WorkerDiedError` or :class:`ClosedError`). Never blocks; cancelling the
        future is a no-op."""
        future: concurrent.futures.Future[R] = running_future()
        self._post(call, future)
        return future

    def submit_callback(self, call: Call[R], callback: Callback) -> None:
        """Send ``call`` now; ``callback(value, error)`` runs on the reader thread when it ends."""
        self._post(call, callback)

    def request(self, call: Call[R], timeout: float | None = None) -> R:
        """Send ``call`` and block until its reply (for threads that may block)."""
        return self.submit(call).result(timeout)

    def _post(self, call: Call[Any], waiter: _Waiter | None) -> None:
        with self._lock:
            if type(call) is not Shutdown:
                self.check_running()
            request_id = next(self._ids)
            if waiter is not None:
                self._pending[request_id] = waiter
        try:
            self._send(Request(request_id, call))
        except BaseException:
            with self._lock:
                self._pending.pop(request_id, None)
            raise

    def _send(self, request: Request) -> None:
        with self._send_lock:
            if self._requests is None:
                raise ClosedError(f"the {self.name} worker is closed")
            message: Request | bytes | memoryview = request
            if not self._backlog:
                data = _dumps(request)
                if len(data) <= _INLINE_WRITE:
                    # A broken pipe means the worker died: EOF reports it to every waiter.
                    with contextlib.suppress(OSError):
                        self._requests.send_bytes(data)
                    return
                message = data
            if self._sender is None:
                self._sender = DaemonThreadExecutor(f"aoffload-{self.name}-sender")
            self._backlog += 1
            self._sender.submit(self._write_later, self._requests, message, request.id)

    def _write_later(
        self, requests: Connection, message: Request | bytes | memoryview, request_id: int
    ) -> None:
        # Not under the send lock: a big write blocks until the worker has read it, and
        # nothing else writes while the backlog is not empty.
        try:
            data = _dumps(message) if isinstance(message, Request) else message
            requests.send_bytes(data)
        except OSError:
            pass  # the worker died (EOF reports it), or the pipe was closed by release()
        except BaseException as exc:  # noqa: BLE001 - fails the call that could not be sent
            with self._lock:
                waiter = self._pending.pop(request_id, None)
            if waiter is not None:
                _complete(waiter, None, exc)
        finally:
            with self._send_lock:
                self._backlog -= 1

    # -- the reader thread ---------------------------------------------------------------

    def _read(self, replies: Connection) -> None:
        try:
            while True:
                try:
                    data = replies.recv_bytes()
                except (EOFError, OSError):
                    break
                self._receive(data)
                n = 1
                while n < _BATCH and replies.poll(0):
                    self._receive(replies.recv_bytes())
                    n += 1
        except (EOFError, OSError):
            pass
        except BaseException:  # pragma: no cover - a bug of ours; the worker is killed below
            logger.exception("reading from the %s worker failed", self.name)
            self._process.kill()
        finally:
            self._reaped()

    def _receive(self, data: bytes) -> None:
        try:
            message = pickle.loads(data)
        except Exception:
            logger.exception(
                "could not read a message from the %s worker; killing it, since the request "
                "it answered can never complete",
                self.name,
            )
            self._process.kill()
            return
        if isinstance(message, LogEvent):
            logging.getLogger(message.name).log(
                message.level, "[%s worker %s] %s", self.name, self._process.pid, message.message
            )
        elif isinstance(message, (Reply, Failure)):
            with self._lock:
                waiter = self._pending.pop(message.id, None)
            if waiter is None:
                return  # nobody waits (a Shutdown's reply)
            if isinstance(message, Reply):
                _complete(waiter, message.value, None)
            else:
                remote = RemoteError(message.remote_type, message.message, message.traceback)
                _complete(waiter, None, remote)
        elif isinstance(message, Ready):
            self._process.learn_pid(message.pid)
            with self._lock:
                self._serving = True
            if not self.ready.done():
                self.ready.set_result(message.pid)
            logger.debug("%s worker ready (pid %s)", self.name, message.pid)
        elif isinstance(message, StartupFailed):
            if not self.ready.done():
                self.ready.set_exception(
                    WorkerStartupError(
                        f"the {self.name} worker failed to start: {message.remote_type}: "
                        f"{message.message}\n\nWorker traceback:\n{message.traceback}"
                    )
                )
        else:
            logger.error("the %s worker sent an unknown message %r", self.name, message)

    def _reaped(self) -> None:
        # EOF: the worker exited or is exiting. Reaping waits for its last moments.
        if not self._process.wait(self._close_timeout):
            self._process.kill()
            self._process.wait(None)
        exitcode = self._process.exitcode
        pending: dict[int, _Waiter] = {}
        with self._lock:
            if not self.ready.done():
                self.ready.set_exception(
                    WorkerStartupError(
                        f"the {self.name} worker (pid {self._process.pid}) "
                        f"{describe_exit(exitcode)} before it was ready; see its output on "
                        "stderr"
                    )
                )
            elif self._serving and not self._closing:
                self._death = WorkerDiedError(self.name, self._process.pid, exitcode)
                pending, self._pending = self._pending, {}
        if self._death is not None:
            logger.error("%s", self._death)
            for waiter in pending.values():
                _complete(waiter, None, self._death)
        self.exited.set_result(exitcode)
