"""What the trainer gets back from the CPU optimizer: step results, their record, their stream.

:class:`Outcomes` is the thread-safe record of every submitted step, from its submit (on
any thread) to its consumption. The core's reader thread records each outcome the moment
the reply arrives, with no event loop involved. Consumers wait on it in two ways:

* a thread blocks in :meth:`Outcomes.wait` (a condition variable);
* an event loop registers a one-shot *watcher* (:meth:`Outcomes.watch`): a predicate and a
  callback that fires once, when the predicate holds. A burst of replies wakes the loop at
  most once, and only when something it waits for holds (``drain()`` wakes once, when the
  last step is done).

When a stream ends:

* ``results()`` covers the steps outstanding: it ends as soon as none is (at once if
  none is when it starts). For a loop that submits a batch and then consumes it.
* ``results(follow=True)`` covers the optimizer's life: it waits through idle periods
  (before the first submit too) and ends once the optimizer is closed and every result
  that arrived has been yielded. For a consumer running in its own task. If the worker
  dies, it raises :class:`~aoffload.WorkerDiedError` (through the failed steps, or at
  the close when none was in flight).
"""

from __future__ import annotations

import collections
import concurrent.futures
import enum
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from .._errors import OptimizerError
from .worker._calls import Done

__all__ = ["Outcomes", "Pending", "StepKind", "StepResult", "StepResults", "Wait", "Watcher"]


class StepKind(enum.Enum):
    """What a finished :class:`StepResult` did."""

    STEP = "step"
    ROLLBACK = "rollback"


@dataclass(frozen=True, slots=True)
class StepResult:
    """One finished sub-group operation, as yielded by :meth:`CPUAdam.results`.

    ``step`` is the sub-group's step count after the operation, ``param`` the caller's
    param tensor (already updated in place) and ``seconds`` the worker's compute time.
    """

    group_id: int
    subgroup_id: int
    kind: StepKind
    step: int
    param: torch.Tensor = field(repr=False)
    seconds: float


@dataclass(slots=True, eq=False)
class Pending:
    """One submitted step; the reply records its outcome here."""

    group_id: int
    subgroup: int
    kind: StepKind
    param: torch.Tensor = field(repr=False)
    register: concurrent.futures.Future[None] | None
    done: Done | None = None
    error: BaseException | None = None

    def result(self) -> StepResult:
        """The step's result, or its error raised."""
        if self.register is not None:
            self.register.result()  # a failed registration is the reason this step failed
        if self.error is not None:
            raise self.error
        if self.done is None:
            raise RuntimeError("a step result was read before it arrived")  # a bug of ours
        done = self.done
        return StepResult(
            self.group_id, self.subgroup, self.kind, done.step, self.param, done.seconds
        )


class Wait(enum.Enum):
    """What :meth:`Outcomes.next` returns when the caller must wait for a change."""

    WAIT = "wait"


Watcher = tuple[Callable[[], bool], Callable[[], None]]
"""``(ready, fire)``: ``fire()`` runs once, outside the lock, when ``ready()`` holds."""


class Outcomes:
    """Submitted steps in flight, finished ones not consumed yet, and who waits; thread-safe.

    :attr:`lock` guards everything here; the optimizer core also guards its sub-groups'
    in-flight counts with it, so that a step's outcome is one critical section.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._changed = threading.Condition(self.lock)
        self._blocked = 0  # threads waiting in wait()
        self.in_flight = 0
        self.completed: collections.deque[Pending] = collections.deque()
        self._watchers: list[Watcher] = []
        self.closed = False
        self.death: BaseException | None = None  # set by the close when the worker had died

    @property
    def outstanding(self) -> int:
        """Submitted steps whose result has not been consumed yet."""
        return self.in_flight + len(self.completed)

    # -- changes (any thread) -------------------------------------------------------------

    def finish_locked(self, pending: Pending, done: object, error: BaseException | None) -> None:
        """Record a step's outcome; the caller holds :attr:`lock` and calls :meth:`fire`."""
        # The outcome is raised by results()/drain(), or dropped by aclose().
        if error is not None:
            pending.error = error
        elif isinstance(done, Done):
            pending.done = done
        else:
            pending.error = OptimizerError(f"the worker answered a step with {done!r}")
        self.in_flight -= 1
        self.completed.append(pending)

    def ready_locked(self) -> list[Callable[[], None]]:
        """After a change (under :attr:`lock`): wake blocked threads, and take the watchers
        whose predicate now holds; the caller runs them once it released the lock."""
        if self._blocked:
            self._changed.notify_all()
        watchers = self._watchers
        if not watchers:
            return []
        if len(watchers) == 1:  # the usual case: one awaiting drain() or results()
            ready, fire = watchers[0]
            if not ready():
                return []
            self._watchers = []
            return [fire]
        fired = [fire for ready, fire in watchers if ready()]
        if fired:
            self._watchers = [w for w in watchers if w[1] not in fired]
        return fired

    @staticmethod
    def fire(callbacks: list[Callable[[], None]]) -> None:
        """Run the callbacks :meth:`ready_locked` returned (outside the lock)."""
        for callback in callbacks:
            callback()

    def close(self, death: BaseException | None) -> None:
        """The optimizer is closing: followers end once nothing is in flight."""
        with self.lock:
            self.closed = True
            self.death = death
            fired = self.ready_locked()
        self.fire(fired)

    # -- waiting -------------------------------------------------------------------------

    def watch(self, ready: Callable[[], bool], fire: Callable[[], None]) -> bool:
        """Run ``fire()`` once when ``ready()`` holds; ``False`` (and no watcher) if it holds now.

        ``ready`` runs under :attr:`lock` on whichever thread made the change.
        """
        with self.lock:
            if ready():
                return False
            self._watchers.append((ready, fire))
            return True

    def unwatch(self, fire: Callable[[], None]) -> None:
        """Forget the watcher of ``fire`` if it has not fired (a cancelled wait)."""
        with self.lock:
            self._watchers = [w for w in self._watchers if w[1] is not fire]

    def wait(self, ready: Callable[[], bool], timeout: float | None = None) -> bool:
        """Block the calling thread until ``ready()`` holds (checked under :attr:`lock`)."""
        with self.lock:
            self._blocked += 1
            try:
                return self._changed.wait_for(ready, timeout)
            finally:
                self._blocked -= 1

    # -- predicates (called under the lock) ------------------------------------------------

    def idle(self) -> bool:
        """Nothing in flight."""
        return not self.in_flight

    def has_next(self) -> bool:
        """A finished step is waiting, or the stream of the outstanding steps has ended."""
        return bool(self.completed) or not self.in_flight

    def has_next_following(self) -> bool:
        """A finished step is waiting, or the optimizer's life-long stream has ended."""
        return bool(self.completed) or (self.closed and not self.in_flight)

    # -- consuming -----------------------------------------------------------------------

    def next(
        self, *, follow: bool, fire: Callable[[], None] | None = None
    ) -> Pending | Wait | None:
        """The next finished step, ``None`` at the end of the stream, or :attr:`Wait.WAIT`:
        then ``fire`` (if given) is watching for the next change of the stream, registered
        in the same critical section (one lock, not two, for a consumer that must wait)."""
        with self.lock:
            if self.completed:
                return self.completed.popleft()
            if follow:
                if self.closed and not self.in_flight:
                    if self.death is not None:
                        raise self.death
                    return None
            elif not self.in_flight:
                return None
            if fire is not None:
                ready = self.has_next_following if follow else self.has_next
                self._watchers.append((ready, fire))
            return Wait.WAIT

    def take(self) -> Pending | None:
        """The next finished step, or ``None`` if none has finished (never waits)."""
        with self.lock:
            return self.completed.popleft() if self.completed else None

    def collect(self) -> list[StepResult]:
        """Every finished step's result, in completion order (``drain()`` once idle).

        If steps failed, their errors are raised: the error itself when there is one (a
        dead worker's :class:`~aoffload.WorkerDiedError` counts once, however many steps it
        failed), an :class:`ExceptionGroup` of them when there are several. No result is
        dropped: the results of the steps that succeeded stay outstanding, ahead of any
        that finished meanwhile, for the next ``drain()`` or ``results()``.
        """
        with self.lock:
            finished, self.completed = self.completed, collections.deque()
            results: list[StepResult] = []
            kept: list[Pending] = []
            errors: dict[int, Exception] = {}  # by identity: one death fails every step
            for pending in finished:
                try:
                    results.append(pending.result())
                    kept.append(pending)
                except Exception as exc:  # noqa: BLE001 - raised below, after the rest finished
                    errors.setdefault(id(exc), exc)
            if errors:
                self.completed.extendleft(reversed(kept))
        if not errors:
            return results
        if len(errors) == 1:
            raise next(iter(errors.values()))
        raise ExceptionGroup(
            f"{len(errors)} CPUAdam steps failed ({len(kept)} results kept for the next "
            "drain() or results())",
            list(errors.values()),
        )


_Next = Callable[..., Awaitable[Pending | None]]
"""``await next_result(follow=...)``: the next finished step, ``None`` at the end."""


class StepResults:
    """Async iterator over finished steps in completion order (from :meth:`CPUAdam.results`).

    It holds no resources: ``break`` leaves the remaining results for a later
    ``results()`` or ``drain()``. It ends when no step is outstanding, or with
    ``follow=True`` once the optimizer is closed (see the module docstring). A failed
    step raises its error from ``__anext__``; iterating on after it is allowed.
    """

    def __init__(self, source: _Next, *, follow: bool = False) -> None:
        self._source = source
        self._follow = follow

    def __aiter__(self) -> StepResults:
        """Return this iterator."""
        return self

    async def __anext__(self) -> StepResult:
        """The next finished step; raises that step's error if it failed."""
        pending = await self._source(follow=self._follow)
        if pending is None:
            raise StopAsyncIteration
        return pending.result()
