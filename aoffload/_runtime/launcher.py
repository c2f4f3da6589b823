"""The trainer's side of its worker servers: who starts them, and what each forked worker is.

A trainer process starts one worker server (:mod:`.forkserver`) on its first worker start and
keeps it for its whole life, as multiprocessing keeps its resource tracker: the server has
imported torch once, so every later start is a fork. :func:`fork_worker` is the one entry
point. It picks the server whose :class:`~.inherit.ServerKey` equals the calling thread's
(starting a fresh one when none does: an import-time variable, the affinity or the nice value
changed since), sends it the worker's pipe ends and returns a
:class:`~.forked.ForkedWorker` at once.

Each server has a listener thread that receives, in order: the HELLO of a booted server, each
worker's pid (with a pidfd), fork failures, and each worker's exit code (the server is the
workers' parent and reaps them). When a server dies, its workers that never forked fail
at once (their pipe ends died with it: EOF), and those that run become orphans whose exit is
still seen (through the pidfd) but whose exit code is lost; the next start uses a fresh server.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import multiprocessing.spawn
import multiprocessing.util
import os
import socket
import struct
import subprocess
import sys
import threading
import time

from .._errors import WorkerStartupError, describe_exit
from . import forkserver
from .forked import ForkedWorker
from .inherit import ServerKey

__all__ = ["PRELOAD", "WorkerServer", "fork_worker", "servers"]

logger = logging.getLogger(__name__)

PRELOAD = ("torch",)
"""What a server imports first, each timed (aoffload itself, and all it imports, follow),
unless a start asks for a server without it (:func:`fork_worker`'s ``preload``)."""

_MAX_SERVERS = 3  # servers of other keys are closed (once idle) beyond this many
_ID = struct.Struct("<Q")
_FORKED = struct.Struct("<Qi")
_EXITED = struct.Struct("<ii")
# OpenMP threads that spin less before they sleep (libgomp's default is 300,000 spins, unless
# the trainer's environment chose a wait policy or a spin count), set before torch loads the
# OpenMP runtime: a CPU Adam worker's threads spinning between parallel regions took the cores
# the trainer's backward shares with them (a paced OffloadAdam step on 2 cores: 129 ms with the
# default, 33-40 ms with 50,000; fully passive threads slowed CPUAdam's own steps instead).
_BOOTSTRAP = (
    "import os, sys, time\n"
    "if not {{'OMP_WAIT_POLICY', 'GOMP_SPINCOUNT'}} & os.environ.keys():\n"
    "    os.environ['GOMP_SPINCOUNT'] = '50000'\n"
    "sys.path[:] = {path!r}; t = [time.monotonic()]\n"
    "for name in {preload!r}: __import__(name); t.append(time.monotonic())\n"
    "from aoffload._runtime.forkserver import main; t.append(time.monotonic()); main(t)"
)


class WorkerServer:
    """One worker server process of this trainer, and the thread that listens to it."""

    def __init__(self, key: ServerKey) -> None:
        self.key = key
        self.pid: int | None = None
        self.boot: tuple[float, ...] = ()
        """Monotonic time of the server's start, after each of :data:`PRELOAD`, after aoffload
        and when it was ready, once its HELLO has arrived."""
        self.dead = False
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._forking: dict[int, ForkedWorker] = {}
        self._children: dict[int, ForkedWorker] = {}
        self._retired = False
        self._socket: socket.socket | None = None
        self._sending = 0
        self._spawned_at = 0.0

    @property
    def fileno(self) -> int | None:
        """The control socket's fd (the leak census leaves it out), or ``None``."""
        return self._socket.fileno() if self._socket is not None else None

    @property
    def busy(self) -> bool:
        """Whether it has workers that run, or forks in flight."""
        return bool(self._forking or self._children)

    def start(self) -> None:
        """Start the server process (it boots, importing torch, while starts queue up)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        path = [os.fspath(entry) for entry in sys.path if isinstance(entry, (str, os.PathLike))]
        code = _BOOTSTRAP.format(path=path, preload=self.key.preload)
        flags = subprocess._args_from_interpreter_flags()  # type: ignore[attr-defined]
        args = [self.key.executable, *flags, "-c", code, str(theirs.fileno()), str(os.getpid())]
        try:
            self._spawned_at = time.monotonic()
            self.pid = multiprocessing.util.spawnv_passfds(
                os.fsencode(self.key.executable), args, [theirs.fileno()]
            )
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        self._socket = mine
        threading.Thread(
            target=self._listen, args=(mine,), name=f"aoffload-server-{self.pid}", daemon=True
        ).start()

    def fork(self) -> tuple[int, ForkedWorker]:
        """A new worker's request id and handle (before :meth:`send`)."""
        child = ForkedWorker()
        with self._lock:
            if self.dead or self._socket is None:
                raise ConnectionError("the worker server is gone")
            request_id = next(self._ids)
            self._forking[request_id] = child
        return request_id, child

    def send(self, request_id: int, fds: list[int]) -> None:
        """Ask for the fork of request ``request_id`` with the worker's ``fds``."""
        with self._lock:
            sock = None if self.dead else self._socket
            if sock is None:
                self._forking.pop(request_id, None)
                raise ConnectionError("the worker server is gone")
            self._sending += 1  # the socket stays open until this send is done
        try:
            socket.send_fds(sock, [forkserver.FORK + _ID.pack(request_id)], fds)
        except OSError:
            with self._lock:
                self._forking.pop(request_id, None)
            raise
        finally:
            with self._lock:
                self._sending -= 1
                last = self.dead and not self._sending
            if last:
                sock.close()

    def retire(self) -> None:
        """Close the server now if it is idle, else once its last worker has exited."""
        with self._lock:
            self._retired = True
            idle = not self.busy
        if idle:
            self._shut()

    def _shut(self) -> None:
        if self._socket is not None:
            with contextlib.suppress(OSError):
                self._socket.shutdown(socket.SHUT_RDWR)  # wakes the listener: EOF

    # -- the listener thread -----------------------------------------------------------------

    def _listen(self, sock: socket.socket) -> None:
        try:
            while True:
                data, fds, _, _ = socket.recv_fds(sock, 4096, 1)
                if not data:
                    break
                self._handle(data, fds)
        except OSError:
            pass
        finally:
            self._lost(sock)

    def _handle(self, data: bytes, fds: list[int]) -> None:
        for fd in fds:
            os.set_inheritable(fd, False)
        kind = data[:1]
        if kind == forkserver.FORKED:
            request_id, pid = _FORKED.unpack_from(data, 1)
            with self._lock:
                child = self._forking.pop(request_id)
                self._children[pid] = child
            child.on_forked(pid, fds[0] if fds else None)
        elif kind == forkserver.EXITED:
            pid, exitcode = _EXITED.unpack_from(data, 1)
            with self._lock:
                child = self._children.pop(pid)
                done = self._retired and not self.busy
            child.on_exited(exitcode)
            if done:
                self._shut()
        elif kind == forkserver.FAILED:
            (request_id,) = _ID.unpack_from(data, 1)
            with self._lock:
                child = self._forking.pop(request_id)
            logger.error("the worker server could not fork: %s", data[9:].decode(errors="replace"))
            child.on_exited(None)  # its pipe ends were closed: the worker's EOF follows
        elif kind == forkserver.HELLO:
            count = (len(data) - 5) // 8
            _, *stamps = struct.unpack_from(f"<i{count}d", data, 1)
            self.boot = (self._spawned_at, *stamps)
            logger.debug(
                "worker server %s ready in %.2f s (interpreter %.2f s, then %s)",
                self.pid,
                stamps[-1] - self._spawned_at,
                stamps[0] - self._spawned_at,
                ", ".join(
                    f"{name} {later - earlier:.2f} s"
                    for name, earlier, later in zip(
                        [*self.key.preload, "aoffload", "hello"],
                        stamps,
                        stamps[1:],
                        strict=False,
                    )
                ),
            )
        else:
            for fd in fds:
                os.close(fd)
            logger.error("the worker server sent an unknown message %r", data[:16])

    def _lost(self, sock: socket.socket) -> None:
        with self._lock:
            self.dead = True
            forking, self._forking = self._forking, {}
            children, self._children = self._children, {}
            retired = self._retired
            idle = not self._sending
        if idle:  # else the last send in flight closes it (a close under it could reuse the fd)
            sock.close()
        _forget(self)
        exitcode = None
        if self.pid is not None:
            with contextlib.suppress(ChildProcessError):  # someone else's os.wait() reaped it
                exitcode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        if not retired or children:
            logger.warning(
                "the aoffload worker server (pid %s) %s; %d running workers lose their exit "
                "status, the next start uses a fresh server",
                self.pid,
                describe_exit(exitcode),
                len(children),
            )
        for child in forking.values():
            child.on_exited(None)
        for child in children.values():
            child.on_orphaned()


# -- the servers of this process -------------------------------------------------------------

_lock = threading.Lock()
_servers: collections.OrderedDict[ServerKey, WorkerServer] = collections.OrderedDict()


def servers() -> list[WorkerServer]:
    """The live worker servers of this process (for the leak census)."""
    with _lock:
        return list(_servers.values())


def _forget(server: WorkerServer) -> None:
    with _lock:
        if _servers.get(server.key) is server:
            del _servers[server.key]


def _after_fork_in_child() -> None:
    # A forked trainer (a DataLoader worker, say) must not talk to its parent's servers;
    # its copies of their sockets are closed, and a start there gets a server of its own.
    global _lock
    _lock = threading.Lock()
    for server in _servers.values():
        if server._socket is not None:
            server._socket.close()
            server._socket = None
        server.dead = True
    _servers.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _executable() -> str:
    executable = multiprocessing.spawn.get_executable()  # sys.executable unless set_executable()
    if not executable or not os.access(executable, os.X_OK):
        raise WorkerStartupError(
            f"aoffload starts its workers with the Python interpreter {executable!r}, which is "
            "not an executable file here (an embedded interpreter?); name one with "
            "multiprocessing.set_executable()"
        )
    return os.fsdecode(executable)


def _server_for(key: ServerKey) -> WorkerServer:
    with _lock:
        server = _servers.get(key)
        if server is not None and not server.dead:
            _servers.move_to_end(key)
            return server
        if _servers:
            newest = next(reversed(_servers))
            logger.info(
                "starting a fresh aoffload worker server: %s changed since the last one started",
                ", ".join(key.differences(newest)) or "the server died",
            )
        server = WorkerServer(key)
        server.start()
        _servers[key] = server
        retired = []
        while len(_servers) > _MAX_SERVERS:
            retired.append(_servers.popitem(last=False)[1])
    for old in retired:
        old.retire()
    return server


def _ask(server: WorkerServer, fds: list[int]) -> ForkedWorker:
    request_id, child = server.fork()
    server.send(request_id, fds)
    return child


def fork_worker(fds: list[int], preload: tuple[str, ...] = PRELOAD) -> ForkedWorker:
    """Have a worker forked with ``fds`` (its request reader, reply writer, stderr), by a
    server that imported ``preload`` first (``()``: a worker that needs no torch gets a
    server, and a process, without it).

    Returns at once (the first start of a process returns while its server still boots).
    Raises :class:`WorkerStartupError` if no server can be started or reached.
    """
    key = ServerKey.current(_executable(), preload)
    server = _server_for(key)
    try:
        return _ask(server, fds)
    except OSError:  # it died since it was chosen: once more, with a fresh one
        _forget(server)
    server = _server_for(key)
    try:
        return _ask(server, fds)
    except OSError as exc:
        _forget(server)
        raise WorkerStartupError(f"could not reach the aoffload worker server: {exc}") from exc
