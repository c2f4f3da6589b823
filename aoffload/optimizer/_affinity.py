"""Splitting this process's CPUs between the trainer and a worker, and putting them back."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Affinity", "Split", "plan_split", "split_cores"]


def split_cores(allowed: Sequence[int], worker_fraction: float) -> tuple[list[int], list[int]]:
    """Split ``allowed`` CPUs into (trainer, worker) as DeepSpeed's ``cpuadam_cores_perc`` does.

    The worker takes the last ``round(worker_fraction * n)`` CPUs, but each side keeps at
    least one: on 2 CPUs any fraction gives one each (DeepSpeed's split silently leaves the
    affinity unchanged there). With a single CPU both sides share it.
    """
    cores = list(allowed)
    if len(cores) < 2:
        return cores, cores
    worker = min(max(round(worker_fraction * len(cores)), 1), len(cores) - 1)
    return cores[: len(cores) - worker], cores[len(cores) - worker :]


@dataclass(frozen=True, slots=True)
class Split:
    """Where the trainer and the worker run: ``None`` for the worker means unpinned."""

    original: set[int]
    trainer: list[int]
    worker: tuple[int, ...] | None

    @property
    def threads(self) -> int | None:
        """The worker's torch thread count: its share of the cores, or unchanged."""
        return None if self.worker is None else len(self.worker)


def plan_split(worker_fraction: float | None) -> Split:
    """The split ``worker_fraction`` asks for (``None``: none), where affinity can be set."""
    if worker_fraction is None or not hasattr(os, "sched_getaffinity"):
        return Split(set(), [], None)
    original = os.sched_getaffinity(0)
    trainer, worker = split_cores(sorted(original), worker_fraction)
    if not trainer or not set(trainer).isdisjoint(worker):
        return Split(original, [], None)  # one CPU: nothing to split
    return Split(original, trainer, tuple(worker))


class Affinity:
    """Pins this process's threads to the trainer's CPUs and puts them back on close."""

    def __init__(self) -> None:
        self._saved: dict[int, set[int]] = {}
        self._threads: int | None = None

    def apply(self, split: Split) -> None:
        """Pin the trainer to its side of ``split`` (nothing when the worker is unpinned)."""
        if split.worker is None:
            return
        for task in Path("/proc/self/task").iterdir():
            tid = int(task.name)
            try:
                if os.sched_getaffinity(tid) == split.original:
                    os.sched_setaffinity(tid, split.trainer)
                    self._saved[tid] = split.original
            except OSError:
                continue  # the thread ended meanwhile
        self._threads = torch.get_num_threads()
        torch.set_num_threads(max(1, min(self._threads, len(split.trainer))))

    def restore(self) -> None:
        for tid, cores in self._saved.items():
            try:
                os.sched_setaffinity(tid, cores)
            except OSError:
                continue
        self._saved.clear()
        if self._threads is not None:
            torch.set_num_threads(self._threads)
            self._threads = None
