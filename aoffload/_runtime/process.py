"""One spawned worker process and its two pipes: the transport under the bridge core.

:class:`WorkerProcess` starts the process with a *local* ``spawn`` context (the global
start method is never touched) and closes the parent's copies of the child's pipe ends
right after the start, so the worker's death shows up as EOF on the reply pipe at once.
It knows nothing of requests and replies (that is :mod:`.core`'s), and nothing here is
bound to an event loop. :meth:`WorkerProcess.wait` is called by one thread only (the core's
reader, which reaps the process); :meth:`terminate` and :meth:`kill` by any. These are the
process's signals; the shutdown ladder that uses them is the core's.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import multiprocessing
from multiprocessing.connection import Connection

from .serve import worker_main

__all__ = ["WorkerProcess"]

logger = logging.getLogger(__name__)

_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_PIPE_BYTES = 1 << 20


class WorkerProcess:
    """The process serving ``target`` with ``config``, and its two pipes."""

    def __init__(self, target: str, config: object, *, name: str) -> None:
        self.name = name
        self._target = target
        self._config = config
        self._process: multiprocessing.process.BaseProcess | None = None
        self.pid: int | None = None
        """The process id once spawned."""
        self.exitcode: int | None = None
        """The exit code once reaped (negative: killed by that signal)."""

    def spawn(self, log_level: int) -> tuple[Connection, Connection]:
        """Start the process (blocks for a few ms); its request writer and reply reader."""
        ctx = multiprocessing.get_context("spawn")
        request_reader, request_writer = ctx.Pipe(duplex=False)
        reply_reader, reply_writer = ctx.Pipe(duplex=False)
        for end in (request_writer, reply_reader):
            try:
                fcntl.fcntl(end.fileno(), _F_SETPIPE_SZ, _PIPE_BYTES)
            except OSError:
                logger.debug("could not enlarge a pipe of the %s worker", self.name)
        self._process = ctx.Process(
            target=worker_main,
            args=(self._target, self._config, request_reader, reply_writer, log_level),
            name=f"aoffload-{self.name}",
            daemon=True,
        )
        try:
            self._process.start()
            self.pid = self._process.pid
        except BaseException:
            for end in (request_writer, reply_reader):
                end.close()
            raise
        finally:
            request_reader.close()
            reply_writer.close()
        return request_writer, reply_reader

    def wait(self, timeout: float | None) -> bool:
        """Block until the process has exited (at most ``timeout`` s); whether it has."""
        if self.exitcode is not None or self._process is None or self.pid is None:
            return True
        with contextlib.suppress(ValueError):  # closed meanwhile by another thread's release
            self._process.join(timeout)
            self.exitcode = self._process.exitcode
        return self.exitcode is not None

    def _signal(self, name: str) -> None:
        if self._process is not None and self.pid is not None and self.exitcode is None:
            with contextlib.suppress(ValueError):
                getattr(self._process, name)()

    def terminate(self) -> None:
        """SIGTERM the process if it runs."""
        self._signal("terminate")

    def kill(self) -> None:
        """SIGKILL the process if it runs."""
        self._signal("kill")

    def release(self) -> None:
        """Drop the process object's own fds once it was reaped."""
        if self._process is not None and self.exitcode is not None:
            with contextlib.suppress(ValueError):
                self._process.close()
