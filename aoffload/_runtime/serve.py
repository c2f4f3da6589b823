"""The worker side of the bridge: handshake, serve loop, errors sent back as objects.

:func:`run_worker` is where a worker begins, in a child the worker server
(:mod:`.forkserver`) has just forked. The first message on its request pipe is a
:class:`Boot`: the trainer's state as of the start (environment, working directory,
``sys.path``, ...), which it applies first, then the service to build. It imports the
service named by a ``"module:ServiceClass"`` string and unpickles its configuration
*inside* its own error handling, so a failure reaches the trainer as
:class:`~aoffload.WorkerStartupError` with the worker's traceback instead of a bare exit
code.

A :class:`Service` dispatches each request on its type: a subclass lists its handlers
in :meth:`Service.handlers`, one per :class:`~aoffload._runtime.protocol.Call` type.

A worker ignores the signals a job's processes get from outside (:data:`JOB_SIGNALS`): Ctrl-C
and ``kill -TERM -PGID`` reach the whole process group, torchrun forwards SIGTERM to it,
SLURM signals every process of a step. The trainer decides when its workers stop, so a final
checkpoint started on such a signal still lands; a worker leaves on its trainer's Shutdown,
at EOF on its request pipe (the trainer is gone), or on SIGKILL. A trainer gone while a reply
was on its way is that same orderly end: the worker leaves quietly, without a traceback.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import importlib
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, ClassVar

from .inherit import StartState
from .protocol import Call, Failure, LogEvent, Ready, Reply, Request, Shutdown, StartupFailed

__all__ = [
    "JOB_SIGNALS",
    "Boot",
    "Handler",
    "Service",
    "ignore_job_signals",
    "run_worker",
    "target",
]

JOB_SIGNALS = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
"""What a terminal, a launcher (torchrun: SIGTERM, SIGINT, SIGHUP, SIGQUIT) or a scheduler
(SLURM's ``--signal``, USR1 or USR2) sends every process of a job; a worker ignores them."""


_GONE = (BrokenPipeError, ConnectionResetError)
"""What writing to the reply pipe raises once the trainer has closed its end (it is gone)."""


def ignore_job_signals() -> None:
    """Ignore :data:`JOB_SIGNALS` in this process (a worker, or the server that forks them)."""
    for signum in JOB_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


Handler = Callable[[Any], object]
"""Runs one request of the type it is registered for and returns its (picklable) result,
or a :class:`concurrent.futures.Future` of it: the reply is then sent when it resolves, from
the thread that resolves it (replies may overtake each other)."""


class Service:
    """What a worker process serves, built in the worker as ``ServiceClass(config)``.

    A bridge names it by ``"module:ServiceClass"`` (see :func:`target`); the worker checks
    that ``config`` is a :attr:`config_type` before it builds the service.
    """

    config_type: ClassVar[type] = object
    """The type of the configuration the constructor takes."""

    def __init__(self, config: object) -> None:
        """Build the service from its configuration."""

    def handlers(self) -> Mapping[type[Call[Any]], Handler]:
        """The handler of each request type this service answers."""
        raise NotImplementedError

    def quiesce(self) -> None:
        """Block until every reply the service owes (a future a handler returned) is sent;
        called before the reply to a Shutdown."""

    def close(self) -> None:
        """Release the service's resources; called once, on shutdown."""


def target(service: type[Service]) -> str:
    """The ``"module:ServiceClass"`` name a bridge spawns ``service`` by."""
    return f"{service.__module__}:{service.__qualname__}"


class _Sender:
    """Serialises every write to the reply pipe (replies and forwarded log records)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, message: object) -> None:
        with self._lock:
            self._conn.send(message)


class _ForwardingHandler(logging.Handler):
    """Sends the worker's log records to the trainer, which re-emits them."""

    def __init__(self, sender: _Sender) -> None:
        super().__init__()
        self._sender = sender

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._sender.send(LogEvent(record.name, record.levelno, self.format(record)))
        except _GONE:
            pass  # the trainer is gone: nobody is left to read it
        except (OSError, ValueError):
            self.handleError(record)


def _failure_fields(exc: BaseException) -> tuple[str, str, str]:
    kind = type(exc)
    return (
        f"{kind.__module__}.{kind.__qualname__}",
        str(exc),
        "".join(traceback.format_exception(exc)),
    )


def _own_stdio() -> None:
    # The trainer's stdout may be a protocol of its own (JSON lines, a progress bar):
    # anything the worker prints goes to stderr instead, and it never reads stdin.
    sys.stdout.flush()
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    # Inherited from the server already; said again for a worker started some other way.
    ignore_job_signals()


@dataclass(frozen=True, slots=True)
class Boot:
    """Trainer -> worker, first on the request pipe: how this worker starts."""

    state: StartState
    name: str
    target: str
    config: bytes  # pickled; unpickled once ``state`` is applied (``sys.path`` first)
    log_level: int


def _set_name(name: str) -> None:
    # What ps and top show (15 characters); cosmetic.
    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as comm:
        comm.write(name[:15])


def run_worker(requests_fd: int, replies_fd: int) -> None:
    """A forked worker's life: read its :class:`Boot`, take on the trainer's state as of the
    start, build the service, say READY, serve until Shutdown or the trainer's end.

    Once the service is closed and its last reply sent, the worker leaves with
    ``os._exit``: it owns nothing more, and the interpreter's teardown of torch's modules
    would keep every ``aclose()`` waiting for about 0.7 s. An exception still ends it the
    usual way, with its traceback on stderr and a non-zero exit code.
    """
    requests = Connection(requests_fd, writable=False)
    replies = Connection(replies_fd, readable=False)
    try:
        boot: Boot = pickle.loads(requests.recv_bytes())
    except EOFError:
        os._exit(0)  # the trainer is gone before it said what to serve
    boot.state.apply()
    multiprocessing.current_process().name = f"aoffload-{boot.name}"
    _set_name(f"aoffload-{boot.name}")
    _main(boot.target, boot.config, requests, replies, boot.log_level)
    sys.stderr.flush()
    os._exit(0)


def _main(
    target: str, payload: bytes, requests: Connection, replies: Connection, log_level: int
) -> None:
    _own_stdio()
    sender = _Sender(replies)
    handler = _ForwardingHandler(sender)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(log_level)
    try:
        module_name, _, attr = target.partition(":")
        kind: type[Service] = getattr(importlib.import_module(module_name), attr)
        config = pickle.loads(payload)
        if not isinstance(config, kind.config_type):
            raise TypeError(
                f"{kind.__qualname__} needs a {kind.config_type.__qualname__}, "
                f"not {type(config).__qualname__}"
            )
        service = kind(config)
        handlers = dict(service.handlers())
    except BaseException as exc:  # noqa: BLE001 - reported to the trainer, then the worker exits
        _send(sender, StartupFailed(*_failure_fields(exc)))
        return
    if not _send(sender, Ready(os.getpid())):
        service.close()
        return
    try:
        _serve(service, handlers, requests, sender)
    finally:
        service.close()


def _send(sender: _Sender, message: object) -> bool:
    """Send ``message``; ``False`` if the trainer is gone."""
    try:
        sender.send(message)
    except _GONE:
        return False
    return True


def _serve(
    service: Service,
    handlers: dict[type[Call[Any]], Handler],
    requests: Connection,
    sender: _Sender,
) -> None:
    while True:
        try:
            request: Request = requests.recv()
        except EOFError:
            return  # the trainer is gone: nobody is left to serve
        call = request.call
        if type(call) is Shutdown:
            service.quiesce()
            _send(sender, Reply(request.id))
            return
        result: object = None
        error: BaseException | None = None
        try:
            handle = handlers.get(type(call))
            if handle is None:
                raise TypeError(f"this worker serves no {type(call).__qualname__} requests")
            result = handle(call)
        except Exception as exc:  # noqa: BLE001 - sent back as RemoteError; the worker goes on
            error = exc
        if isinstance(result, concurrent.futures.Future):
            result.add_done_callback(functools.partial(_reply_later, sender, request.id))
        elif not _reply(sender, request.id, result, error):
            return  # the trainer is gone while its reply was on its way


def _reply(sender: _Sender, request_id: int, result: object, error: BaseException | None) -> bool:
    """Send the reply to a request (a failure if ``error``); ``False`` if the trainer is gone."""
    reply = (
        Reply(request_id, result) if error is None else Failure(request_id, *_failure_fields(error))
    )
    try:
        return _send(sender, reply)
    except Exception as exc:  # noqa: BLE001 - an unpicklable result fails that request only
        return _send(sender, Failure(request_id, *_failure_fields(exc)))


def _reply_later(sender: _Sender, request_id: int, done: concurrent.futures.Future[Any]) -> None:
    error = done.exception()
    _reply(sender, request_id, None if error is not None else done.result(), error)
