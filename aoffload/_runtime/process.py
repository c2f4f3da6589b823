"""One spawned worker process and its two pipes: the transport under the bridge.

:class:`WorkerProcess` spawns the process with a *local* ``spawn`` context (the global
start method is never touched) and closes the parent's copies of the child's pipe ends
right after ``start()``, so the worker's death shows up as EOF at once. It owns two
threads:

* the *reader* (one :class:`DaemonThreadExecutor` per worker) spawns the process, then
  runs one ``loop.run_in_executor`` call for the worker's life: blocking
  ``Connection.recv_bytes()`` reads, each taking every reply already waiting (a batch)
  and unpickling it on that thread, handed to the loop with ``call_soon_threadsafe``.
  One wake-up of the loop serves a burst, and a large reply never stalls the loop. At
  EOF the same thread reaps the process. This needs nothing of the loop but
  ``run_in_executor`` and ``call_soon_threadsafe``: it runs on asyncio's selector and
  proactor loops and on uvloop alike;
* the *sender*, started on first need: requests are pickled and written on the loop
  while they are small, but one that pickles to more than 64 KiB is written there, and
  a call type marked ``large`` is pickled there too (anything sent meanwhile queues
  behind it, to keep the order).

Nothing polls, nothing sleeps. :meth:`WorkerProcess.stop` is the shutdown ladder:
a bounded wait, then terminate, then kill.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import fcntl
import logging
import multiprocessing
import pickle
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler

from .._errors import ClosedError
from .protocol import Incoming, Request
from .serve import worker_main
from .threads import DaemonThreadExecutor

__all__ = ["Batch", "Unreadable", "WorkerProcess"]

logger = logging.getLogger(__name__)

_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_PIPE_BYTES = 1 << 20
_BATCH = 256  # replies read per wake-up of the loop, at most
_INLINE_WRITE = 1 << 16  # bytes: a bigger request is written on the sender thread
_TERMINATE_GRACE = 5.0


class Unreadable:
    """A reply the trainer could not unpickle (the request it answered can never complete)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


Batch = list[Incoming | Unreadable]


def _read_batch(conn: Connection) -> Batch | None:
    """Block for one reply, then take every reply already waiting; ``None`` at EOF."""
    batch: Batch = []
    try:
        while True:
            data = conn.recv_bytes()
            try:
                batch.append(pickle.loads(data))
            except Exception as exc:  # noqa: BLE001 - handled on the loop (the worker is killed)
                batch.append(Unreadable(exc))
            if len(batch) >= _BATCH or not conn.poll(0):
                return batch
    except (EOFError, OSError):
        return batch or None  # replies read before the EOF first; the next read sees it again


class WorkerProcess:
    """The process serving ``target`` with ``config``, its pipes and its two threads."""

    def __init__(self, target: str, config: object, *, name: str, close_timeout: float) -> None:
        self.name = name
        self._target = target
        self._config = config
        self._close_timeout = close_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._requests: Connection | None = None
        self._replies: Connection | None = None
        self._reader: DaemonThreadExecutor | None = None
        self._sender: DaemonThreadExecutor | None = None
        self._backlog = 0  # requests queued on the sender thread, not yet written
        self.exited: asyncio.Future[int | None] | None = None
        """Resolves to the exit code once the process is reaped."""

    @property
    def pid(self) -> int | None:
        """The process id once spawned."""
        return None if self._process is None else self._process.pid

    async def spawn(self) -> None:
        """Start the process (on the reader thread: spawning blocks for a while)."""
        loop = self._loop = asyncio.get_running_loop()
        self.exited = loop.create_future()
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

    # -- reading -------------------------------------------------------------------------

    def read(self, on_batch: Callable[[Batch], None]) -> None:
        """Deliver every batch of replies to ``on_batch`` on the loop, until EOF, then reap.

        One ``run_in_executor`` call on the reader thread blocks in the pipe's reads for
        the worker's whole life and hands each batch to the loop with
        ``call_soon_threadsafe``: a reply costs the loop one wake-up, not an executor
        round trip per read. Batches arrive in order, and the reap comes after the last.
        """
        loop, reader, replies = self._loop, self._reader, self._replies
        if loop is None or reader is None or replies is None:
            raise ClosedError(f"the {self.name} worker was never spawned")

        def pump() -> None:
            while (batch := _read_batch(replies)) is not None:
                try:
                    loop.call_soon_threadsafe(on_batch, batch)
                except RuntimeError:  # the loop was closed without aclose(): nobody listens
                    return

        def finished(future: asyncio.Future[None]) -> None:
            error = None if future.cancelled() else future.exception()
            if error is not None:
                logger.error("reading from the %s worker failed", self.name, exc_info=error)
            self._reap()

        loop.run_in_executor(reader, pump).add_done_callback(finished)

    def _reap(self) -> None:
        # The worker's end of the pipe is closed: it exited (or is exiting). Reaping it
        # blocks for the last moments of its exit, so that runs on the reader thread.
        process, loop, reader = self._process, self._loop, self._reader
        if process is None or loop is None or reader is None:
            return
        try:
            reaped = loop.run_in_executor(reader, process.join, self._close_timeout)
        except RuntimeError:  # the reader was shut down by a close: reap here, it is quick
            process.join(0)
            self._exited(process.exitcode)
            return
        reaped.add_done_callback(lambda _: self._exited(process.exitcode))

    def _exited(self, exitcode: int | None) -> None:
        if self.exited is not None and not self.exited.done():
            self.exited.set_result(exitcode)

    # -- writing -------------------------------------------------------------------------

    def send(
        self, request: Request, *, large: bool, failed: Callable[[BaseException], None]
    ) -> None:
        """Write ``request``: on the loop if it is small, else on the sender thread.

        A ``large`` call is pickled on the sender thread too; any other request is pickled
        here, and written here only if it is at most 64 KiB (a write that big never
        blocks on the 1 MiB pipe). Everything sent while the sender has work queued goes
        behind it, so order is kept. An error other than a broken pipe (the worker died:
        EOF reports it) goes to ``failed``, on the loop, or is raised here.
        """
        if large or self._backlog:
            self._send_later(request, failed)
            return
        data = ForkingPickler.dumps(request)
        if len(data) > _INLINE_WRITE:
            self._send_later(data, failed)
            return
        # A broken pipe means the worker died: EOF fails the waiter at once.
        with contextlib.suppress(OSError):
            self._write(data)

    def _write(self, message: Request | bytes | memoryview) -> None:
        if self._requests is None:
            raise ClosedError(f"the {self.name} worker was never spawned")
        if isinstance(message, Request):
            message = ForkingPickler.dumps(message)
        self._requests.send_bytes(message)

    def _send_later(
        self, message: Request | bytes | memoryview, failed: Callable[[BaseException], None]
    ) -> None:
        loop = self._loop
        if loop is None:
            raise ClosedError(f"the {self.name} worker was never spawned")
        if self._sender is None:
            self._sender = DaemonThreadExecutor(f"aoffload-{self.name}-sender")
        self._backlog += 1
        written = self._sender.submit(self._write, message)

        def on_loop(future: concurrent.futures.Future[None]) -> None:
            self._backlog -= 1
            error = future.exception()
            if error is not None and not isinstance(error, OSError):
                failed(error)

        written.add_done_callback(lambda future: loop.call_soon_threadsafe(on_loop, future))

    # -- stopping ------------------------------------------------------------------------

    def kill(self) -> None:
        """SIGKILL the process if it was spawned."""
        if self._process is not None and self._process.pid is not None:
            self._process.kill()

    async def stop(self, *, graceful: bool) -> None:
        """Wait for the exit (asked for already, or ``graceful=False``: kill now), escalating.

        Graceful: wait ``close_timeout``, then terminate and wait, then kill and wait.
        Whatever happens (cancellation too), the process is killed if it has not exited.
        """
        process, exited = self._process, self.exited
        if process is None or process.pid is None or exited is None:
            return
        ladder: tuple[tuple[Callable[[], None] | None, float], ...] = (
            (None, self._close_timeout),
            (process.terminate, _TERMINATE_GRACE),
            (process.kill, self._close_timeout),
        )
        if not graceful:
            process.kill()
            ladder = ((None, self._close_timeout),)
        try:
            for escalate, wait in ladder:
                if escalate is not None:
                    logger.warning(
                        "the %s worker (pid %s) has not exited; sending %s",
                        self.name,
                        process.pid,
                        escalate.__name__,
                    )
                    escalate()
                try:
                    async with asyncio.timeout(wait):
                        await asyncio.shield(exited)
                    return
                except TimeoutError:
                    continue
            logger.error("the %s worker (pid %s) outlived SIGKILL", self.name, process.pid)
        finally:
            if not exited.done():
                process.kill()  # never leave the worker behind

    def release(self) -> None:
        """Close the pipes and stop the threads (joined when the process was reaped)."""
        process, exited = self._process, self.exited
        reaped = exited is not None and exited.done()
        if process is not None and reaped:
            with contextlib.suppress(ValueError):
                process.close()  # the two pipe fds multiprocessing keeps per process
        for conn in (self._requests, self._replies):
            if conn is not None:
                conn.close()
        # Once the exit was seen the reader thread is idle (it reaped the worker): join it.
        # Otherwise (the worker outlived SIGKILL) it may still block in a read: leave it.
        for executor in (self._sender, self._reader):
            if executor is not None:
                executor.shutdown(wait=reaped)
