"""What a worker inherits from the trainer, in two parts: fixed at a server's start, or per start.

Workers are forked by a preloaded worker server (:mod:`.forkserver`), not spawned by the
trainer, so what a spawned child would have inherited at its start must be carried over:

* :class:`ServerKey` is what an interpreter has consumed by the time it has imported torch,
  or cannot change back once forked: the environment variables read at import or load time
  (``OMP_NUM_THREADS``, ``LD_*``, ``PYTHON*``, ...), the CPU affinity (OpenMP and OpenBLAS
  size their thread pools from it when they load), the scheduling policy and nice value
  (an unprivileged process cannot raise them back), the resource limits, the cgroup and the
  executable. A server serves only starts whose key equals the one it was started with; any
  other start gets a fresh server (:mod:`.launcher`), never a wrong worker.
* :class:`StartState` is what each start carries and the forked worker applies before it
  imports or unpickles anything: the whole ``os.environ``, the working directory, ``sys.path``,
  ``sys.argv``, the umask and multiprocessing's authentication key, as of that start.

Both are read on the thread that starts the worker, as a spawned child inherits the
attributes of the thread that forks it. Linux only (``/proc``).
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import resource
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["IMPORT_TIME_PREFIXES", "ServerKey", "StartState", "read_umask"]

IMPORT_TIME_PREFIXES = (
    "LD_",  # the dynamic loader: read once, at exec
    "PYTHON",  # the interpreter: at start-up
    "LC_",
    "LANG",
    "OMP_",  # OpenMP (libgomp/libiomp): at library load
    "KMP_",
    "GOMP_",
    "MKL_",
    "OPENBLAS_",
    "GOTO",
    "BLIS_",
    "VECLIB_",
    "NUMEXPR_",
    "MALLOC_",
    "GLIBC_TUNABLES",
    "TORCH_",
    "PYTORCH_",
    "DNNL_",
    "ONEDNN_",
    "CUDA_",
    "NVIDIA_",
)
"""Variables whose value a preloaded interpreter may already have used (a change starts a
fresh server); every other variable is simply set in the worker at its start."""


def _limits() -> tuple[tuple[int, int, int], ...]:
    names = sorted(name for name in dir(resource) if name.startswith("RLIMIT_"))
    limits = []
    for name in names:
        which = getattr(resource, name)
        try:
            soft, hard = resource.getrlimit(which)
        except (OSError, ValueError):
            continue
        limits.append((which, soft, hard))
    return tuple(limits)


def _cgroup() -> str:
    try:
        return Path("/proc/self/cgroup").read_text()
    except OSError:
        return ""


@dataclass(frozen=True, slots=True)
class ServerKey:
    """What a worker server fixed at its start; equal keys serve each other's starts."""

    executable: str
    environ: tuple[tuple[str, str], ...]
    affinity: frozenset[int]
    policy: int
    priority: int
    nice: int
    limits: tuple[tuple[int, int, int], ...]
    cgroup: str
    preload: tuple[str, ...] = ("torch",)
    """What the server imports first (its workers then have it for free): torch, for all
    but the workers that never need it (a checkpoint engine's writer)."""

    @classmethod
    def current(cls, executable: str, preload: tuple[str, ...] = ("torch",)) -> ServerKey:
        """The key of a start from the calling thread, now, of a server importing
        ``preload``."""
        environ = tuple(
            sorted(
                (name, value)
                for name, value in os.environ.items()
                if name.startswith(IMPORT_TIME_PREFIXES)
            )
        )
        return cls(
            executable=executable,
            environ=environ,
            affinity=frozenset(os.sched_getaffinity(0)),
            policy=os.sched_getscheduler(0),
            priority=os.sched_getparam(0).sched_priority,
            nice=os.getpriority(os.PRIO_PROCESS, 0),  # Linux: the calling thread's
            limits=_limits(),
            cgroup=_cgroup(),
            preload=preload,
        )

    def differences(self, other: ServerKey) -> list[str]:
        """What differs from ``other``, in words (for the log line of a fresh server)."""
        names = []
        if self.executable != other.executable:
            names.append("executable")
        mine, theirs = dict(self.environ), dict(other.environ)
        names += sorted(
            name for name in mine.keys() | theirs.keys() if mine.get(name) != theirs.get(name)
        )
        for field in ("affinity", "policy", "priority", "nice", "limits", "cgroup", "preload"):
            if getattr(self, field) != getattr(other, field):
                names.append(field)
        return names


def read_umask() -> int | None:
    """This process's umask, read without changing it (``/proc``, Linux 4.7+), or ``None``."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass(frozen=True, slots=True)
class StartState:
    """What one start carries to its worker, applied there before anything is imported."""

    environ: dict[str, str]
    cwd: str | None
    path: list[str]
    argv: list[str]
    umask: int | None
    authkey: bytes  # multiprocessing's: torch's shared-tensor handshakes check it

    @classmethod
    def current(cls) -> StartState:
        """The trainer's state now."""
        try:
            cwd: str | None = os.getcwd()
        except OSError:  # removed meanwhile: the worker keeps the server's
            cwd = None
        return cls(
            environ=dict(os.environ),
            cwd=cwd,
            path=list(sys.path),
            argv=list(sys.argv),
            umask=read_umask(),
            authkey=bytes(multiprocessing.current_process().authkey),
        )

    def apply(self) -> None:
        """Make this (forked) process's state the trainer's, as of the start."""
        os.environ.clear()
        os.environ.update(self.environ)
        if self.cwd is not None:
            with contextlib.suppress(OSError):  # removed meanwhile: the server's stays
                os.chdir(self.cwd)
        if self.umask is not None:
            os.umask(self.umask)
        sys.path[:] = self.path
        sys.argv[:] = self.argv
        multiprocessing.current_process().authkey = self.authkey
        importlib.invalidate_caches()
        tempfile.tempdir = None  # recomputed from TMPDIR on first use
