"""A forked worker as its trainer sees it: pid, pidfd, exit code.

The worker is the child of a worker server (:mod:`.forkserver`), not of the trainer: its pid
and a pidfd come in the server's reply, its exit code in the server's report once it has
reaped it (:mod:`.launcher`'s listener thread calls the ``on_*`` methods). Signals
go through the pidfd, so a pid reused after the reap is never hit. If the server dies, a
running worker becomes an orphan: its exit is still seen (the pidfd turns readable), its
exit code is lost (``None``).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time

__all__ = ["ForkedWorker"]


class ForkedWorker:
    """A worker as its trainer sees it: pid, pidfd, exit code; thread-safe.

    The pid arrives with the server's reply, or with the worker's READY (:meth:`learn_pid`),
    whichever comes first; a signal sent before either is delivered on arrival.
    :meth:`wait` is called by one thread only (the core's reader).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self.pid: int | None = None
        self.exitcode: int | None = None
        self._pidfd: int | None = None
        self._reaped = False
        self._orphaned = False
        self._pending: int | None = None  # a signal sent before the pid was known

    @property
    def reaped(self) -> bool:
        """Whether the worker is known to have exited."""
        return self._reaped

    def learn_pid(self, pid: int) -> None:
        """The worker said its pid (in its READY message)."""
        with self._lock:
            if self.pid is None:
                self.pid = pid
                self._deliver_pending()

    def send_signal(self, signum: int) -> None:
        """Signal the worker if it still runs (later, if its pid is not known yet)."""
        with self._lock:
            if self._reaped:
                return
            if self.pid is None:
                if self._pending != signal.SIGKILL:
                    self._pending = signum
                return
            self._signal(signum)

    def _signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, signum)
            elif self.pid is not None:
                os.kill(self.pid, signum)

    def _deliver_pending(self) -> None:
        if self._pending is not None:
            self._signal(self._pending)
            self._pending = None

    def wait(self, timeout: float | None) -> bool:
        """Block until the worker has exited (at most ``timeout`` s); whether it has."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            self._changed.wait_for(lambda: self._reaped or self._orphaned, timeout)
            if self._reaped or not self._orphaned:
                return self._reaped
            pidfd = self._pidfd
            if pidfd is None:  # no way to watch it: the EOF that brought us here will do
                self._reaped = True
                return True
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not select.select([pidfd], [], [], left)[0]:
            return False
        with self._lock:
            self._reaped = True
            self._close_pidfd()
        return True

    def release(self) -> None:
        """Close the pidfd (once the worker has exited; idempotent)."""
        with self._lock:
            if self._reaped:
                self._close_pidfd()

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    # -- the server's reports (its listener thread) ----------------------------------------

    def on_forked(self, pid: int, pidfd: int | None) -> None:
        """The server forked it: its pid, and a pidfd (``None`` where the kernel has none)."""
        with self._lock:
            self.pid, self._pidfd = pid, pidfd
            self._deliver_pending()

    def on_exited(self, exitcode: int | None) -> None:
        """The server reaped it (or never forked it: ``None``)."""
        with self._changed:
            self.exitcode, self._reaped = exitcode, True
            self._close_pidfd()
            self._changed.notify_all()

    def on_orphaned(self) -> None:
        """Its server died: from now on only its pidfd tells when it exits."""
        with self._changed:
            self._orphaned = True
            self._changed.notify_all()
