"""One worker process and its two pipes: the transport under the bridge core.

:class:`WorkerProcess` makes the two pipes and has the trainer's worker server
(:mod:`.launcher`, :mod:`.forkserver`) fork the worker with their far ends; it closes its
own copies of those ends at once, so the worker's death shows up as EOF on the reply pipe
right away. The worker never runs the trainer's ``__main__`` (no main guard is needed, and
scripts on stdin, ``python -c`` and notebooks work) and the global multiprocessing start
method is never touched. The first message on the request pipe is the worker's
:class:`~.serve.Boot`: the trainer's environment, working directory and ``sys.path`` as of
this start, then the service and its configuration.

It knows nothing of requests and replies (that is :mod:`.core`'s), and nothing here is
bound to an event loop. :meth:`WorkerProcess.wait` is called by one thread only (the core's
reader); :meth:`kill` by any. The shutdown ladder that uses it is the core's (it has no
SIGTERM step: a worker ignores the job's signals, see :data:`.serve.JOB_SIGNALS`). The worker
is the server's child, not the trainer's: its exit code comes from the server, and signals go
through a pidfd.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import pickle
import signal
from multiprocessing.connection import Connection, Pipe
from multiprocessing.reduction import ForkingPickler

from .._errors import WorkerStartupError
from .forked import ForkedWorker
from .inherit import StartState
from .launcher import PRELOAD, fork_worker
from .serve import Boot

__all__ = ["WorkerProcess"]

logger = logging.getLogger(__name__)

_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_PIPE_BYTES = 1 << 20


def _from_main(target: str, config: object) -> str | None:
    """What of the worker's start lives in ``__main__`` (which a worker never runs)."""
    if target.partition(":")[0] == "__main__":
        return f"its service {target}"
    if type(config).__module__ == "__main__":
        return f"its configuration's type {type(config).__qualname__}"
    return None


class WorkerProcess:
    """The process serving ``target`` with ``config``, and its two pipes."""

    def __init__(
        self, target: str, config: object, *, name: str, preload: tuple[str, ...] = PRELOAD
    ) -> None:
        self.name = name
        self._target = target
        self._config = config
        self._preload = preload
        self._child: ForkedWorker | None = None

    @property
    def pid(self) -> int | None:
        """The process id once known (the server's reply, or the worker's READY)."""
        return self._child.pid if self._child is not None else None

    @property
    def exitcode(self) -> int | None:
        """The exit code once reaped (negative: killed by that signal; ``None`` if unknown)."""
        return self._child.exitcode if self._child is not None else None

    def spawn(self, log_level: int) -> tuple[Connection, Connection]:
        """Start the process (a few ms; the first start of a process returns while its
        worker server still imports torch); its request writer and reply reader."""
        where = _from_main(self._target, self._config)
        if where is not None:
            raise WorkerStartupError(
                f"the {self.name} worker cannot start: {where} is defined in __main__, and "
                "workers never run the trainer's script; define it in an importable module"
            )
        boot = pickle.dumps(
            Boot(
                StartState.current(),
                self.name,
                self._target,
                bytes(ForkingPickler.dumps(self._config)),
                log_level,
            )
        )
        request_reader, request_writer = Pipe(duplex=False)
        reply_reader, reply_writer = Pipe(duplex=False)
        for end in (request_writer, reply_reader):
            try:
                fcntl.fcntl(end.fileno(), _F_SETPIPE_SZ, _PIPE_BYTES)
            except OSError:
                logger.debug("could not enlarge a pipe of the %s worker", self.name)
        fds = [request_reader.fileno(), reply_writer.fileno()]
        with contextlib.suppress(OSError):
            os.fstat(2)
            fds.append(2)  # the worker's stderr is the trainer's as of this start
        try:
            self._child = fork_worker(fds, self._preload)
        except BaseException:
            for end in (request_writer, reply_reader):
                end.close()
            raise
        finally:
            request_reader.close()
            reply_writer.close()
        # A broken pipe means the worker died already: EOF on the reply pipe reports it.
        with contextlib.suppress(OSError):
            request_writer.send_bytes(boot)
        return request_writer, reply_reader

    def learn_pid(self, pid: int) -> None:
        """The worker said its pid (READY may overtake the server's reply)."""
        if self._child is not None:
            self._child.learn_pid(pid)

    def wait(self, timeout: float | None) -> bool:
        """Block until the process has exited (at most ``timeout`` s); whether it has."""
        return self._child is None or self._child.wait(timeout)

    def kill(self) -> None:
        """SIGKILL the process if it runs."""
        if self._child is not None:
            self._child.send_signal(signal.SIGKILL)

    def release(self) -> None:
        """Drop the process's own fds once it was reaped."""
        if self._child is not None:
            self._child.release()
