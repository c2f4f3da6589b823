"""Host memory of a process tree: its PSS, read from ``/proc/PID/smaps_rollup``.

PSS (proportional set size) charges each page to the processes that map it in equal
parts, so the sum over a trainer and every process it started counts a page they share
(a shared-memory staging segment mapped by the trainer and by its writer) once, where
RSS would count it in each. Linux only.

:class:`PssSampler` samples the trees of some root processes on a thread of the process
that creates it, so a benchmark measures its ranks from outside: the sampling costs the
measured processes no GIL and no thread of theirs. Each sample is stamped with
``time.monotonic()``, which every process on the host shares, so a rank can report the
window of each save in the same clock and :meth:`PssSampler.peak` finds the peak inside it.

What PSS does not count: pages of a shared-memory file that no process maps at the moment
(a segment created and unmapped), and the page cache of files written (reclaimable).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PssSample", "PssSampler", "descendants", "paused", "process_pss", "tree_pss"]

_PROC = "/proc"


def process_pss(pid: int) -> int:
    """The PSS of process ``pid`` in bytes; 0 when it is gone (or not readable)."""
    try:
        with open(f"{_PROC}/{pid}/smaps_rollup", "rb") as rollup:
            for line in rollup:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return 0
    return 0


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        tasks = os.listdir(f"{_PROC}/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return found
    for task in tasks:
        name = f"{_PROC}/{pid}/task/{task}/children"
        with contextlib.suppress(FileNotFoundError, ProcessLookupError), open(name, "rb") as f:
            found.extend(int(child) for child in f.read().split())
    return found


def _children_by_scan() -> dict[int, list[int]]:
    """parent -> children, from every ``/proc/PID/stat`` (kernels without ``children``)."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir(_PROC):
        if not entry.isdigit():
            continue
        name = f"{_PROC}/{entry}/stat"
        with contextlib.suppress(FileNotFoundError, ProcessLookupError), open(name, "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
            tree.setdefault(int(fields[1]), []).append(int(entry))
    return tree


_HAVE_CHILDREN = os.path.exists(f"{_PROC}/self/task/{os.getpid()}/children")


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (children, their children, ...)."""
    tree = None if _HAVE_CHILDREN else _children_by_scan()
    found, pending = [], [pid]
    while pending:
        current = pending.pop()
        found.append(current)
        pending.extend(_children(current) if tree is None else tree.get(current, []))
    return found


def tree_pss(pid: int) -> int:
    """The PSS of ``pid`` and of every process below it, in bytes (see the module)."""
    return sum(process_pss(p) for p in descendants(pid))


@contextlib.contextmanager
def paused(quiet: Any, resting: Any) -> Iterator[None]:
    """In a measured process: the :class:`PssSampler` whose ``quiet`` and ``resting`` these
    are (events it shares) takes no sample while the block runs, from its first line on;
    nothing without them (``None``: a run that samples and times the same saves)."""
    if quiet is None:
        yield
        return
    quiet.set()
    try:
        if not resting.wait(60):
            raise RuntimeError("the PSS sampler did not pause")
        yield
    finally:
        quiet.clear()


@dataclass(frozen=True, slots=True)
class PssSample:
    """One sample: ``time.monotonic()`` and the tree PSS of each root, in bytes."""

    at: float
    pss: dict[int, int]


@dataclass
class PssSampler:
    """Sample the tree PSS of ``roots`` every ``interval`` seconds on a thread.

    Use as a context manager (or :meth:`start` / :meth:`stop`); add roots while it runs
    with :meth:`watch`. :meth:`peak` and :meth:`before` read the samples in a window of
    ``time.monotonic()``.

    Sampling is not free: reading ``smaps_rollup`` walks the process's page tables under its
    mmap lock, about 90 ms for a process with 8 GiB resident, so sampling every 10 ms keeps
    a core busy. A measured process times inside :func:`paused`, which sets ``quiet`` (a
    ``multiprocessing`` event) for as long as it times and waits for ``resting``: set by
    this thread once it has stopped sampling, cleared when it samples again.
    """

    roots: list[int] = field(default_factory=list)
    interval: float = 0.01
    samples: list[PssSample] = field(default_factory=list)
    quiet: Any = None
    resting: Any = None

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, roots: Iterable[int]) -> None:
        """Sample these roots too, from the next sample on."""
        with self._lock:
            self.roots = [*self.roots, *roots]

    def start(self) -> PssSampler:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="pss-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> PssSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while True:
            if self.quiet is not None and self.quiet.is_set():
                if self.resting is not None:
                    self.resting.set()
                if self._stop.wait(self.interval):
                    return
                continue
            if self.resting is not None:
                self.resting.clear()
            with self._lock:
                roots = list(self.roots)
            sample = PssSample(time.monotonic(), {root: tree_pss(root) for root in roots})
            with self._lock:
                self.samples.append(sample)
            if self._stop.wait(self.interval):
                return

    def _window(self, start: float, end: float) -> Sequence[PssSample]:
        with self._lock:
            return [s for s in self.samples if start <= s.at <= end]

    def peak(self, root: int, start: float, end: float) -> int | None:
        """The largest tree PSS of ``root`` sampled in ``[start, end]`` (None: no sample)."""
        values = [s.pss[root] for s in self._window(start, end) if root in s.pss]
        return max(values) if values else None

    def before(self, root: int, at: float) -> int | None:
        """The last tree PSS of ``root`` sampled at or before ``at`` (None: no sample)."""
        with self._lock:
            values = [s.pss[root] for s in self.samples if s.at <= at and root in s.pss]
        return values[-1] if values else None
