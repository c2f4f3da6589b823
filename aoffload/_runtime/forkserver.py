"""The worker server: a preloaded interpreter that forks the trainer's workers on request.

:mod:`.launcher` starts it as ``python -c BOOTSTRAP FD TRAINER_PID`` (never through
multiprocessing, so nothing of the trainer's ``__main__`` is ever run): the bootstrap sets
``sys.path`` to the trainer's, imports torch and aoffload, and calls :func:`main`. From then
on the server does nothing but wait on three things:

* the control socket (``AF_UNIX``, ``SOCK_SEQPACKET``; the trainer holds the other end): a
  fork request carries a request id and, as ``SCM_RIGHTS``, the worker's two pipe ends and the
  trainer's stderr. The server forks, the child becomes the worker (:func:`.serve.run_worker`
  reads the rest of its start, its environment included, from its request pipe), and the
  server closes its copies of the child's fds at once, so the trainer sees the worker's death
  as EOF on the reply pipe, exactly as with a spawned child. The reply names the pid and
  carries a pidfd, through which the trainer signals the worker race-free;
* ``SIGCHLD``: the server reaps its children and sends each exit code (negative: the signal)
  to the trainer, which is not their parent and could not learn it otherwise;
* the trainer's pidfd, and EOF on the socket: the trainer is gone (or closed this server).
  The server forks nothing more, gives its workers ``GRACE`` seconds to see EOF on their
  request pipes and exit as they always do, SIGKILLs any that remain, reaps them and exits.

It never initialises CUDA (a fork after that breaks the child's CUDA), runs no torch code and
starts no thread. It ignores the job's signals (:data:`.serve.JOB_SIGNALS`), and so do the
workers it forks: Ctrl-C, torchrun's SIGTERM and a scheduler's signals reach the whole process
group, and the trainer decides when its workers stop. The server leaves when the trainer does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import signal
import socket
import struct
import sys
import threading
import time
import traceback
import warnings

from .serve import ignore_job_signals

__all__ = ["EXITED", "FAILED", "FORK", "FORKED", "GRACE", "HELLO", "main"]

logger = logging.getLogger(__name__)

HELLO = b"H"  # server -> trainer, once booted: pid, then the boot's monotonic timestamps
FORK = b"F"  # trainer -> server: request id; fds: requests, replies[, stderr]
FORKED = b"P"  # server -> trainer: request id, pid; fds: [pidfd]
FAILED = b"E"  # server -> trainer: request id, why the fork failed (utf-8)
EXITED = b"X"  # server -> trainer: pid, exit code (negative: killed by that signal)

GRACE = 5.0
"""Seconds the workers have to exit on their own once the trainer is gone, before SIGKILL."""

_ID = struct.Struct("<Q")
_FORKED = struct.Struct("<Qi")
_EXITED = struct.Struct("<ii")


def _set_name(name: str) -> None:
    # What ps, top and /proc/PID/comm show (15 characters at most); cosmetic.
    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as comm:
        comm.write(name[:15])


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):  # before Linux 5.3, or a sandbox without it
        return None


class _Server:
    """The server's loop and everything it holds (which a forked child closes first)."""

    def __init__(self, control: socket.socket, trainer: int | None) -> None:
        self._control = control
        self._trainer = trainer
        self._children: set[int] = set()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        signal.set_wakeup_fd(self._wake_w)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # the wakeup fd reports it
        self._selector = selectors.DefaultSelector()
        self._selector.register(control, selectors.EVENT_READ, "control")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "child")
        if trainer is not None:
            self._selector.register(trainer, selectors.EVENT_READ, "trainer")

    def serve(self) -> None:
        """Fork on request and report exits until the trainer is gone; then wind down."""
        while True:
            for key, _ in self._selector.select():
                if key.data == "child":
                    self._drain_wakeups()
                    self._reap()
                elif key.data == "trainer" or not self._take_request():
                    self._wind_down()
                    return

    def _send(self, message: bytes, fds: list[int] | None = None) -> None:
        with contextlib.suppress(OSError):  # the trainer is gone: the loop notices
            if fds:
                socket.send_fds(self._control, [message], fds)
            else:
                self._control.send(message)

    def _take_request(self) -> bool:
        try:
            data, fds, flags, _ = socket.recv_fds(self._control, 256, 4)
        except OSError:
            return False
        if not data:
            for fd in fds:
                os.close(fd)
            return False
        if data[:1] != FORK or len(fds) < 2 or flags & socket.MSG_CTRUNC:
            for fd in fds:
                os.close(fd)
            logger.error("the aoffload worker server got a malformed request %r", data[:16])
            return True
        (request_id,) = _ID.unpack_from(data, 1)
        self._fork(request_id, fds)
        return True

    def _fork(self, request_id: int, fds: list[int]) -> None:
        try:
            # Python 3.12+ warns of other threads: the one here is OpenBLAS's idle pool, which
            # its own at-fork handler stops before the fork.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
        except OSError as exc:
            for fd in fds:
                os.close(fd)
            self._send(FAILED + _ID.pack(request_id) + str(exc).encode())
            return
        if pid == 0:
            self._become_worker(fds)  # never returns
        for fd in fds:
            os.close(fd)
        self._children.add(pid)
        pidfd = _pidfd(pid)  # before any reap: the pid cannot have been reused
        try:
            self._send(
                FORKED + _FORKED.pack(request_id, pid), [pidfd] if pidfd is not None else None
            )
        finally:
            if pidfd is not None:
                os.close(pidfd)

    def _become_worker(self, fds: list[int]) -> None:
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            self._selector.close()
            self._control.close()
            for fd in (self._wake_r, self._wake_w, self._trainer):
                if fd is not None:
                    os.close(fd)
            requests, replies, *stderr = fds
            if stderr:
                os.dup2(stderr[0], 2)
                os.close(stderr[0])
            numpy_random = sys.modules.get("numpy.random")
            if numpy_random is not None:  # a spawned child draws a fresh legacy seed
                numpy_random.seed()
            from .serve import run_worker

            run_worker(requests, replies)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001 - the worker's end: reported on stderr and by exit code
            traceback.print_exc()
        finally:
            with contextlib.suppress(BaseException):
                sys.stderr.flush()
            os._exit(code)

    def _drain_wakeups(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 512):
                pass

    def _reap(self, *, report: bool = True) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self._children.discard(pid)
            if report:
                self._send(EXITED + _EXITED.pack(pid, os.waitstatus_to_exitcode(status)))

    def _wind_down(self) -> None:
        self._selector.unregister(self._control)
        if self._trainer is not None:
            self._selector.unregister(self._trainer)
        deadline = time.monotonic() + GRACE
        self._reap()
        while self._children and (left := deadline - time.monotonic()) > 0:
            if self._selector.select(left):
                self._drain_wakeups()
                self._reap()
        for pid in self._children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in list(self._children):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        self._control.close()


def _detach_stdio() -> None:
    # The server reads nothing and prints nothing: stdin is /dev/null (so are its
    # workers'), stdout goes to stderr. The job's signals are for the trainer, which closes
    # its workers; the workers inherit the ignoring.
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    ignore_job_signals()


def _refusal() -> str | None:
    """Why this interpreter cannot fork workers safely, or ``None``."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "importing torch and aoffload initialised CUDA; a forked worker could not use it"
    if threading.active_count() != 1:
        names = [thread.name for thread in threading.enumerate()]
        return f"importing torch and aoffload started Python threads {names}"
    return None


def main(timestamps: list[float]) -> None:
    """Serve the trainer named by ``sys.argv`` (``-c`` bootstrap's arguments: FD TRAINER_PID).

    ``timestamps`` are the bootstrap's ``time.monotonic()`` readings: start, then one after
    each preloaded import; they go back to the trainer in the HELLO message.
    """
    control = socket.socket(fileno=int(sys.argv[1]))
    trainer_pid = int(sys.argv[2])
    _detach_stdio()
    _set_name("aoffload-server")
    if os.getppid() != trainer_pid:
        return  # the trainer is already gone
    refusal = _refusal()
    if refusal is not None:
        logger.error("aoffload worker server: %s", refusal)  # on stderr (no handler here)
        sys.exit(3)
    os.chdir("/")  # hold no mount busy; each worker moves to the trainer's directory
    server = _Server(control, _pidfd(trainer_pid))
    stamps = struct.pack(f"<i{len(timestamps) + 1}d", os.getpid(), *timestamps, time.monotonic())
    server._send(HELLO + stamps)
    server.serve()
    sys.stderr.flush()
    os._exit(0)  # nothing to tear down; torch's module teardown would only take time
