"""CPUAdam: SuperOffload-style Adam(W) sub-group steps in a worker process, awaited on asyncio.

The trainer submits a sub-group (``submit()`` returns at once) as soon as its gradients
are ready and keeps working; the worker applies the step to the param **in place**
through shared memory, and ``results()`` yields a :class:`StepResult` per finished step.

Zero copy: on a sub-group's first submit (or :meth:`CPUAdam.register`) its param and
grad are moved to shared memory *in place* (``Tensor.share_memory_()``: the caller's
tensors, and every view of their storage, keep working) and handed to the worker once.
Every later submit sends two ids, the learning rate and a flag: no tensor, no file
descriptor, no pickled data.

Rollback: ``rollback=True`` undoes the sub-group's last step. By default this is
DeepSpeed's algebraic inverse, which needs ``grad`` to still hold the gradient of the
step it undoes; its rounding can leave a few second moments slightly negative (a later
zero gradient then makes them NaN in DeepSpeed). The ``torch`` backend clamps them at
zero; the ``deepspeed`` backend stays bit-identical to DeepSpeed and keeps them.
``exact_rollback=True`` instead keeps a pre-step copy of param and both moments of
every sub-group in the worker (12 extra bytes per element: the optimizer then holds
20 bytes per element instead of 8, on top of the param) plus one 3-tensor copy per
step, and restores them bit-exactly; it undoes one step (a second rollback in a row
is an error).

State: ``await opt.state_dict()`` snapshots the step counts, moments and group
hyper-parameters after every step submitted before the call, in one layout for both
backends (:mod:`._state`), and ``await opt.load_state_dict(sd)`` puts such a state
back, so a run saved with :class:`~aoffload.CheckpointEngine` resumes bit-identically.
The moments travel through shared memory, never through the pipe.

Threads: ``CPUAdam`` is the asyncio face of a thread-safe core (:mod:`._core`).
``submit()`` may be called from any thread, a backward hook's included; each step's
result is recorded by the worker's reader thread when it arrives, while the event loop
is busy or blocked, and an awaiting ``results()``/``drain()`` is woken once per burst of
results, when what it waits for holds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .._runtime.resource import AsyncResource, State
from .._runtime.threads import run_in_thread
from ._core import OptimizerCore
from ._results import Pending, StepResult, StepResults
from ._waits import LoopWaits

__all__ = ["CPUAdam"]

logger = logging.getLogger(__name__)


class CPUAdam(AsyncResource):
    """Adam(W) on the CPU in a worker process, one sub-group at a time (SuperOffload-style).

    ``param_groups`` is a list of dicts with ``lr``, ``betas``, ``eps``, ``weight_decay``
    and ``amsgrad`` (must be false), as DeepSpeed's optimizer config; missing keys take
    DeepSpeed's defaults and a ``params`` key is ignored. ``backend`` is ``"deepspeed"``
    (DeepSpeed's CPU Adam op, built on first use: a minute or two, said at WARNING),
    ``"torch"`` or ``"auto"`` (DeepSpeed's op when a worker has already loaded its build,
    else the torch backend, said once at INFO: ``"auto"`` never builds). The choice is
    exposed as :attr:`backend`. See the module docstring for rollback, the zero-copy
    contract and threads.

    ``worker_cores=None`` (the default) changes nothing in the trainer: the worker
    inherits the process's CPUs and torch's default thread count, and the OS shares the
    cores. ``worker_cores=f`` (as DeepSpeed's ``cpuadam_cores_perc``) is an explicit
    request to split: the worker gets that fraction of this process's allowed CPUs and a
    matching torch thread count, and the trainer's threads are pinned to the rest with
    its torch thread count lowered to match; both are restored by :meth:`aclose`. With
    one allowed CPU (or no affinity support) nothing is pinned. The default is None
    because it was measured faster wherever the trainer idles while it waits for
    results (on a 2-core host the split leaves the optimizer one core, ~2x slower:
    ``python -m aoffload.bench optimizer``); split on hosts with cores to spare when
    the trainer computes while the optimizer steps.
    """

    _what = "this CPUAdam"

    def __init__(
        self,
        param_groups: Sequence[Mapping[str, object]],
        *,
        backend: str = "auto",
        worker_cores: float | None = None,
        exact_rollback: bool = False,
        start_timeout: float = 120.0,
        close_timeout: float = 30.0,
    ) -> None:
        super().__init__()
        self._core = OptimizerCore.checked(
            param_groups,
            backend=backend,
            worker_cores=worker_cores,
            exact_rollback=exact_rollback,
            close_timeout=close_timeout,
        )
        self._start_timeout = start_timeout
        self._waits = LoopWaits()

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The worker's process id while it runs, else ``None``."""
        running = self._state in (State.RUNNING, State.CLOSING)
        return self._core.pid if running else None

    @property
    def backend(self) -> str | None:
        """The backend the worker runs (``"deepspeed"`` or ``"torch"``) once started."""
        return self._core.backend

    @property
    def outstanding(self) -> int:
        """Submitted steps whose result has not been consumed yet."""
        return self._core.outcomes.outstanding

    async def _open(self) -> None:
        """Spawn the worker, build its backend and split the CPUs; see the class docstring."""
        self._waits.bind(asyncio.get_running_loop())
        await run_in_thread(self._core.start, self._start_timeout, name="aoffload-cpu-adam-start")
        self._core.pin()

    async def _close(self) -> None:
        """Stop the worker after the steps already sent.

        Results not consumed yet are dropped. The trainer's CPU affinity and torch thread
        count are restored. No process or shared-memory segment outlives it (the params
        stay in shared memory as long as the caller holds them).
        """
        try:
            await run_in_thread(self._core.close, name="aoffload-cpu-adam-close")
        finally:
            self._core.kill()  # cancelled: never leave the worker behind
            self._core.unpin()

    # -- submitting ----------------------------------------------------------------------

    async def register(
        self, group_id: int, subgroup_id: int, param: torch.Tensor, grad: torch.Tensor
    ) -> None:
        """Move ``param`` and ``grad`` to shared memory off the event loop and register them.

        Optional: the first :meth:`submit` of a sub-group does the same on the caller's
        thread (a copy of both tensors, which blocks the loop for large ones when the
        caller is the loop).
        """
        self.check_running()
        await self._waits.result(self._core.register(group_id, subgroup_id, param, grad))

    def submit(
        self,
        group_id: int,
        subgroup_id: int,
        param: torch.Tensor,
        grad: torch.Tensor,
        lr: float | None = None,
        rollback: bool = False,
    ) -> None:
        """Queue one step (or, with ``rollback=True``, the undo of the last one); non-blocking.

        Any thread may call it (a backward hook on autograd's thread, for instance); the
        step is sent at once and its result recorded when it arrives, whatever the event
        loop is doing. ``param`` is updated in place; ``grad`` must not change until this
        step's result arrives. A ``grad`` other than the sub-group's registered one is
        copied into the registered (shared) buffer here, on the caller's thread: one
        memcpy, allowed only when none of that sub-group's steps is in flight. ``lr`` sets
        the group's learning rate from this step on. Raises :class:`OptimizerError` for
        bad input, before anything is sent.
        """
        self.check_running()
        self._core.submit((group_id, subgroup_id), param, grad, lr, rollback)

    # -- results -----------------------------------------------------------------------

    def results(self, *, follow: bool = False) -> StepResults:
        """Iterate finished steps in completion order.

        By default the stream covers the steps outstanding: it ends as soon as none is
        (at once if none is), for a loop that submits a batch and then consumes it. With
        ``follow=True`` it covers the optimizer's life, for a consumer in its own task:
        it waits through idle periods (before the first submit too) and ends once the
        optimizer is closed and every result that arrived was yielded.

        A failed step raises :class:`~aoffload.RemoteError` for that step (iteration may
        go on); a dead worker raises :class:`~aoffload.WorkerDiedError`.
        """
        return StepResults(self._next_result, follow=follow)

    async def drain(self) -> list[StepResult]:
        """Wait for every outstanding step and return their results in completion order.

        Failures are raised once every step has finished: the error itself when there is
        one (a dead worker counts once), an :class:`ExceptionGroup` when there are
        several. No result is dropped: those of the steps that succeeded stay outstanding
        for the next ``drain()`` or ``results()``. Cancelling the wait consumes nothing.
        """
        outcomes = self._core.outcomes
        while not outcomes.idle():
            # One wake-up, when the last step is done.
            await self._waits.until(outcomes, outcomes.idle)
        return outcomes.collect()

    async def _next_result(self, *, follow: bool) -> Pending | None:
        return await self._waits.next(self._core.outcomes, follow=follow)

    # -- state ---------------------------------------------------------------------------

    async def state_dict(self) -> dict[str, Any]:
        """The optimizer state after every step submitted before this call.

        Waits for those steps (their results are still delivered by :meth:`results`),
        then returns step counts, ``exp_avg`` and ``exp_avg_sq`` of every registered
        sub-group and each group's hyper-parameters (``lr`` overrides included), in one
        layout for both backends (see ``aoffload/optimizer/_state.py``). The tensors are
        flat CPU float32 views of shared memory that the caller owns: later steps never
        change them, and :meth:`CheckpointEngine.save` takes them as they are.
        """
        self.check_running()
        return await self._waits.result(self._core.state_dict())

    async def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Replace the optimizer state with ``state_dict`` (from :meth:`state_dict`).

        Every sub-group's next step is then bit-identical to the one the saved optimizer
        would have taken (on the same backend). Sub-groups of the state that are not
        registered yet take their state when they register; registered ones that it does
        not list start afresh; group hyper-parameters are replaced, as torch's optimizers
        do. An unknown group id, a size or dtype mismatch raises
        :class:`~aoffload.OptimizerError` and changes nothing. Steps already submitted run
        first; :meth:`submit` raises while the load is in progress (until the load itself
        has ended, even if this wait is cancelled). An exact-rollback pre-step copy does
        not survive a load: a rollback needs a step after it.
        """
        self.check_running()
        await self._waits.result(self._core.load_state_dict(state_dict))
