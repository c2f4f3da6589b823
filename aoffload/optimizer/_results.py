"""What the trainer gets back from the CPU optimizer: step results, and the stream of them.

:class:`Outcomes` tracks every submitted step from its submit to its consumption:
the reply callback records the outcome, :class:`StepResults` (``CPUAdam.results()``)
and ``drain()`` hand it out in completion order. Waiting is by futures that a reply
(or a submit, or the close) resolves; nothing polls.

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

import asyncio
import collections
import enum
from dataclasses import dataclass, field

import torch

from .._errors import OptimizerError
from ._calls import Done

__all__ = ["Outcomes", "Pending", "StepKind", "StepResult", "StepResults"]


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


class Pending:
    """One submitted step; its reply callback records the outcome."""

    __slots__ = ("done", "error", "group_id", "kind", "param", "register", "subgroup")

    def __init__(
        self,
        group_id: int,
        subgroup: int,
        kind: StepKind,
        param: torch.Tensor,
        register: asyncio.Future[None] | None,
    ) -> None:
        self.group_id = group_id
        self.subgroup = subgroup
        self.kind = kind
        self.param = param
        self.register = register
        self.done: Done | None = None
        self.error: BaseException | None = None

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


class Outcomes:
    """Submitted steps: in flight, finished and not yet consumed, and who waits for them."""

    def __init__(self) -> None:
        self.pending: set[Pending] = set()
        self.completed: collections.deque[Pending] = collections.deque()
        self._waiters: set[asyncio.Future[None]] = set()
        self._idle_waiters: set[asyncio.Future[None]] = set()
        self.closed = False
        self.death: BaseException | None = None  # set by the close when the worker had died

    @property
    def outstanding(self) -> int:
        """Submitted steps whose result has not been consumed yet."""
        return len(self.pending) + len(self.completed)

    def finish(self, pending: Pending, done: object, error: BaseException | None) -> None:
        """Record a step's outcome (from its reply callback) and wake the waiters."""
        # The outcome is raised by results()/drain(), or dropped by aclose().
        if error is not None:
            pending.error = error
        elif isinstance(done, Done):
            pending.done = done
        else:
            pending.error = OptimizerError(f"the worker answered a step with {done!r}")
        self.pending.discard(pending)
        self.completed.append(pending)
        self.wake()

    def wake(self) -> None:
        """Wake every waiter; the idle waiters once nothing is in flight."""
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        if not self.pending or self.closed:
            for waiter in self._idle_waiters:
                if not waiter.done():
                    waiter.set_result(None)

    async def _wait_for_change(self, *, idle: bool = False) -> None:
        # Each wait has its own future, so a cancelled wait never disturbs another.
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters = self._idle_waiters if idle else self._waiters
        waiters.add(waiter)
        try:
            await waiter
        finally:
            waiters.discard(waiter)

    async def next_completed(self, *, follow: bool = False) -> Pending | None:
        """The next finished step; ``None`` at the end of the stream (see the module doc)."""
        while not self.completed:
            if follow and self.closed and not self.pending:
                if self.death is not None:
                    raise self.death
                return None
            if not follow and not self.pending:
                return None
            await self._wait_for_change()
        return self.completed.popleft()

    async def drain(self) -> list[StepResult]:
        """Wait for every outstanding step and return their results in completion order.

        If steps failed, their errors are raised once all steps have finished: the error
        itself when there is one (a dead worker's :class:`~aoffload.WorkerDiedError` counts
        once, however many steps it failed), an :class:`ExceptionGroup` of them when there
        are several. No result is dropped: the results of the steps that succeeded stay
        outstanding, for the next ``drain()`` or ``results()``. Cancelling the wait
        consumes nothing.
        """
        while self.pending:
            await self._wait_for_change(idle=True)  # one wake-up when the last step is done
        finished, self.completed = list(self.completed), collections.deque()
        results: list[StepResult] = []
        kept: list[Pending] = []
        errors: dict[int, Exception] = {}  # by identity: one death fails every step
        for pending in finished:
            try:
                results.append(pending.result())
                kept.append(pending)
            except Exception as exc:  # noqa: BLE001 - raised below, after the rest finished
                errors.setdefault(id(exc), exc)
        if not errors:
            return results
        self.completed.extend(kept)
        if len(errors) == 1:
            raise next(iter(errors.values()))
        raise ExceptionGroup(
            f"{len(errors)} CPUAdam steps failed ({len(kept)} results kept for the next "
            "drain() or results())",
            list(errors.values()),
        )


class StepResults:
    """Async iterator over finished steps in completion order (from :meth:`CPUAdam.results`).

    It holds no resources: ``break`` leaves the remaining results for a later
    ``results()`` or ``drain()``. It ends when no step is outstanding, or with
    ``follow=True`` once the optimizer is closed (see the module docstring). A failed
    step raises its error from ``__anext__``; iterating on after it is allowed.
    """

    def __init__(self, outcomes: Outcomes, *, follow: bool = False) -> None:
        self._outcomes = outcomes
        self._follow = follow

    def __aiter__(self) -> StepResults:
        """Return this iterator."""
        return self

    async def __anext__(self) -> StepResult:
        """The next finished step; raises that step's error if it failed."""
        pending = await self._outcomes.next_completed(follow=self._follow)
        if pending is None:
            raise StopAsyncIteration
        return pending.result()
