"""The one exception hierarchy of aoffload.

Everything the library raises on purpose derives from :class:`AoffloadError`::

    AoffloadError
    ├── ClosedError                 used before start / after aclose()
    ├── WorkerError                 the worker process failed
    │   ├── WorkerStartupError      did not become ready (import error, timeout)
    │   ├── WorkerDiedError         exited or was killed; .exitcode, .pid
    │   └── RemoteError             an operation raised inside the worker
    ├── CheckpointError             a checkpoint could not be saved, committed or loaded
    │   ├── InvalidStateError       bad input to save() (also TypeError and ValueError)
    │   └── CorruptCheckpointError  manifest/checksum mismatch or missing file on load
    └── OptimizerError              bad input to the CPU optimizer (also ValueError)
"""

from __future__ import annotations

import signal

__all__ = [
    "AoffloadError",
    "CheckpointError",
    "ClosedError",
    "CorruptCheckpointError",
    "InvalidStateError",
    "OptimizerError",
    "RemoteError",
    "WorkerDiedError",
    "WorkerError",
    "WorkerStartupError",
    "first_line",
]


class AoffloadError(Exception):
    """Base class of every error aoffload raises on purpose."""


class ClosedError(AoffloadError):
    """Raised when a worker-backed object is used before it started or after ``aclose()``."""


class WorkerError(AoffloadError):
    """Raised when a worker process failed; see the subclasses for how."""


class WorkerStartupError(WorkerError):
    """Raised by ``start()`` when the worker did not become ready.

    The worker failed to import or construct its service (the message carries the
    worker's own traceback), exited before the READY handshake, or did not answer
    within ``start_timeout`` seconds.
    """


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its type's name if it has none), for messages
    that name another error in one line."""
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def describe_exit(exitcode: int | None) -> str:
    """Say how a process ended, from its exit code (negative: the signal that killed it)."""
    if exitcode is None:
        return "exit status unknown"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        hint = " (if nobody sent it, the kernel's OOM killer may have: see `dmesg`)"
        hint = hint if exitcode == -signal.SIGKILL else ""
        return f"killed by {name}{hint}"
    return f"exited with code {exitcode}"


class WorkerDiedError(WorkerError):
    """Raised by every pending and later operation once the worker process has died.

    It is raised within milliseconds of the death (the bridge notices the end of the
    worker's pipe), whatever the cause: SIGKILL, the OOM killer, a segfault, or an
    unexpected exit. ``exitcode`` is the process exit code (negative: the signal
    number) and ``pid`` the worker's process id.
    """

    def __init__(self, name: str, pid: int | None, exitcode: int | None) -> None:
        self.name = name
        self.pid = pid
        self.exitcode = exitcode
        super().__init__(
            f"the {name} worker (pid {pid}) died: {describe_exit(exitcode)}; "
            "every pending operation failed and the object must be closed and recreated"
        )

    def __reduce__(self) -> tuple[type[WorkerDiedError], tuple[str, int | None, int | None]]:
        return (type(self), (self.name, self.pid, self.exitcode))


class RemoteError(WorkerError):
    """Raised when an operation raised an exception inside the worker.

    ``remote_type`` is the qualified name of the remote exception type and
    ``remote_traceback`` its formatted traceback. The worker stays alive and keeps
    serving further requests.
    """

    def __init__(self, remote_type: str, message: str, remote_traceback: str) -> None:
        self.remote_type = remote_type
        self.remote_message = message
        self.remote_traceback = remote_traceback
        super().__init__(f"{remote_type}: {message}")

    def __reduce__(self) -> tuple[type[RemoteError], tuple[str, str, str]]:
        return (type(self), (self.remote_type, self.remote_message, self.remote_traceback))

    def __str__(self) -> str:
        return (
            f"{self.remote_type}: {self.remote_message}\n\n"
            f"Remote traceback:\n{self.remote_traceback}"
        )


class CheckpointError(AoffloadError):
    """Raised when a checkpoint could not be saved, committed or loaded."""


class InvalidStateError(CheckpointError, TypeError, ValueError):
    """Raised by ``save()`` for bad input; the message names the offending key and why.

    Examples: a tensor of an unsupported kind (sparse, quantized, meta), a value that
    cannot be pickled, or a file name that is empty, absolute or contains ``..``.
    """


class CorruptCheckpointError(CheckpointError):
    """Raised on load when a file is missing or does not match the manifest's size or checksum."""


class OptimizerError(AoffloadError, ValueError):
    """Raised by the CPU optimizer for bad input, before anything is sent to the worker.

    Examples: a non-float32, non-contiguous or CUDA tensor, a sub-group whose shape
    changed after it was registered, or an unknown parameter group id.
    """
