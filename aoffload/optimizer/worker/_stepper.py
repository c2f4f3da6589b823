"""The worker's stepping threads: sub-groups stepped side by side, each on one core.

A worker that shares its cores with the trainer steps badly with one kernel spread over
every core: each parallel region of the kernel ends at a barrier, and on a core the
trainer's backward holds, one of the kernel's threads waits for a time slice while the
others wait for it (measured on 2 cores: a 0.7 ms step of one 1M-parameter bucket took 3-8
ms while the backward copied gradients). So the worker runs several stepping threads,
each with one intra-op thread: a sub-group's step is one task, taken by whichever thread
is free, and a thread the trainer preempts delays its own task only; the others go on
with the next ones. With nothing else to run, the threads still fill the cores, one
sub-group each.

Order is kept where it matters: the tasks of one sub-group run one after another in the
order they were sent (a rollback after its step, a redo after the rollback), and a call
that is not a step (registration, state, hyper-parameters) runs once every step sent
before it has ended (:meth:`Stepper.wait_idle`, on the serve loop's thread).
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Stepper"]

Key = tuple[int, int]
_Task = tuple[Key, Callable[[], Any], "concurrent.futures.Future[Any]"]


class Stepper:
    """``size`` threads that run tasks, one sub-group's in order; thread-safe.

    While the trainer runs its backward, at most ``size - 1`` of them step (one core is
    left to the backward, whose gradient copies are the step's critical path); once the
    trainer waits for the step (:meth:`hurry`), every thread does, until none is left.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._ready: collections.deque[_Task] = collections.deque()
        self._waiting: dict[Key, collections.deque[_Task]] = {}  # keys with a task running
        self._in_flight = 0
        self._running = 0
        self._backward_limit = max(1, size - 1)
        self._limit = self._backward_limit
        self._closing = False
        self._threads = [
            threading.Thread(target=self._run, name=f"aoffload-adam-step-{i}", daemon=True)
            for i in range(size)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, key: Key, work: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run ``work`` after every task of ``key`` sent before; its future."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        task: _Task = (key, work, future)
        with self._lock:
            self._in_flight += 1
            waiting = self._waiting.get(key)
            if waiting is not None:
                waiting.append(task)
                return future
            self._waiting[key] = collections.deque()
            self._ready.append(task)
            self._changed.notify_all()
        return future

    def hurry(self) -> None:
        """The trainer waits for the steps sent: every thread may step until none is left."""
        with self._lock:
            if self._in_flight:
                self._limit = self.size
                self._changed.notify_all()

    def wait_idle(self) -> None:
        """Block until every task sent has ended."""
        with self._lock:
            while self._in_flight:
                self._changed.wait()

    def close(self) -> None:
        """Stop the threads once the tasks sent have ended."""
        with self._lock:
            self._limit = self.size
            self._changed.notify_all()
        self.wait_idle()
        with self._lock:
            self._closing = True
            self._changed.notify_all()
        for thread in self._threads:
            thread.join()

    def _take(self) -> _Task | None:
        with self._lock:
            while not (self._ready and self._running < self._limit):
                if self._closing:
                    return None
                self._changed.wait()
            self._running += 1
            return self._ready.popleft()

    def _run(self) -> None:
        torch.set_num_threads(1)  # this thread's kernels run on this thread only
        while (task := self._take()) is not None:
            key, work, future = task
            try:
                result = work()
            except BaseException as exc:  # noqa: BLE001 - the reply carries it
                future.set_exception(exc)
            else:
                future.set_result(result)
            with self._lock:
                self._running -= 1
                self._in_flight -= 1
                waiting = self._waiting[key]
                if waiting:
                    self._ready.append(waiting.popleft())
                else:
                    del self._waiting[key]
                if not self._in_flight:
                    self._limit = self._backward_limit  # the next backward's steps
                self._changed.notify_all()
