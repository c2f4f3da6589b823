"""What the trainer gets back from the CPU optimizer: step results, and the stream of them.

:class:`Outcomes` tracks every submitted step from its submit to its consumption:
the reply callback records the outcome, :class:`StepResults` (``CPUAdam.results()``)
and ``drain()`` hand it out in completion order. Waiting is by futures that a reply
resolves; nothing polls.
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

    async def next_completed(self) -> Pending | None:
        """The next finished step, or ``None`` when none is outstanding."""
        while not self.completed:
            if not self.pending:
                return None
            await self._wait_for_change()
        return self.completed.popleft()

    async def drain(self) -> list[StepResult]:
        """Wait for every outstanding step and return their results in completion order.

        If any step failed, the first error is raised once all of them have finished.
        Cancelling the wait consumes nothing: a later ``drain()`` returns every result.
        """
        while self.pending:
            await self._wait_for_change(idle=True)  # one wake-up when the last step is done
        finished, self.completed = list(self.completed), collections.deque()
        results: list[StepResult] = []
        first_error: BaseException | None = None
        for pending in finished:
            try:
                results.append(pending.result())
            except Exception as exc:  # noqa: BLE001 - re-raised below, after the rest finished
                first_error = first_error or exc
        if first_error is not None:
            raise first_error
        return results


class StepResults:
    """Async iterator over finished steps in completion order (from :meth:`CPUAdam.results`).

    It holds no resources: ``break`` leaves the remaining results for a later
    ``results()`` or ``drain()``. It ends when no step is outstanding.
    """

    def __init__(self, outcomes: Outcomes) -> None:
        self._outcomes = outcomes

    def __aiter__(self) -> StepResults:
        """Return this iterator."""
        return self

    async def __anext__(self) -> StepResult:
        """The next finished step; raises that step's error if it failed."""
        pending = await self._outcomes.next_completed()
        if pending is None:
            raise StopAsyncIteration
        return pending.result()
