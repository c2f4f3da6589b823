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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .._errors import ClosedError, OptimizerError
from .._runtime.bridge import Bridge
from .._runtime.resource import AsyncResource
from ._affinity import Affinity, Split, plan_split
from ._calls import AdamConfig, GetInfo, GroupConfig, Step
from ._results import Outcomes, Pending, StepKind, StepResult, StepResults
from ._service import TARGET
from ._state import StateTransfer
from ._subgroups import Registry, group_config, share, valid_lr, validate

__all__ = ["CPUAdam"]

logger = logging.getLogger(__name__)

_BACKENDS = ("auto", "deepspeed", "torch")


def _checked_groups(
    param_groups: Sequence[Mapping[str, object]], backend: str, worker_cores: float | None
) -> tuple[GroupConfig, ...]:
    """Validate :class:`CPUAdam`'s arguments; its param groups as GroupConfigs."""
    if isinstance(param_groups, Mapping):
        param_groups = [param_groups]
    if not param_groups:
        raise OptimizerError("CPUAdam needs at least one param group")
    if backend not in _BACKENDS:
        raise OptimizerError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if worker_cores is not None and not 0.0 < worker_cores <= 1.0:
        raise OptimizerError(f"worker_cores must be in (0, 1], got {worker_cores!r}")
    return tuple(group_config(i, group) for i, group in enumerate(param_groups))


async def _start_worker(bridge: Bridge, split: Split, affinity: Affinity) -> str:
    """Start the worker, pin the trainer to its side of ``split``, log both; the backend's name."""
    await bridge.start()
    info = await bridge.request(GetInfo())
    affinity.apply(split)
    logger.info(
        "CPUAdam worker (pid %s): %s backend, %d threads, worker cores %s, trainer cores %s",
        bridge.pid,
        info.backend,
        info.threads,
        "unpinned" if info.cores is None else list(info.cores),
        split.trainer if split.worker is not None else "unpinned",
    )
    return info.backend


class CPUAdam(AsyncResource):
    """Adam(W) on the CPU in a worker process, one sub-group at a time (SuperOffload-style).

    ``param_groups`` is a list of dicts with ``lr``, ``betas``, ``eps``, ``weight_decay``
    and ``amsgrad`` (must be false), as DeepSpeed's optimizer config; missing keys take
    DeepSpeed's defaults and a ``params`` key is ignored. ``backend`` is ``"deepspeed"``,
    ``"torch"`` or ``"auto"`` (DeepSpeed when it imports and its op builds; the choice is
    logged and exposed as :attr:`backend`). See the module docstring for rollback and
    the zero-copy contract.

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
        groups = _checked_groups(param_groups, backend, worker_cores)
        super().__init__()
        self._groups = groups
        self._requested_backend = backend
        self._worker_cores = worker_cores
        self._exact = exact_rollback
        self._start_timeout = start_timeout
        self._close_timeout = close_timeout
        self._bridge: Bridge | None = None
        self._backend: str | None = None
        self._affinity = Affinity()
        self._registry = Registry()
        self._subgroups = self._registry.subgroups
        self._outcomes = Outcomes()
        self._transfer = StateTransfer()
        self._loading = False

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The worker's process id while it runs, else ``None``."""
        return None if self._bridge is None else self._bridge.pid

    @property
    def backend(self) -> str | None:
        """The backend the worker runs (``"deepspeed"`` or ``"torch"``) once started."""
        return self._backend

    @property
    def outstanding(self) -> int:
        """Submitted steps whose result has not been consumed yet."""
        return self._outcomes.outstanding

    async def _open(self) -> None:
        """Spawn the worker, build its backend and split the CPUs; see the class docstring."""
        split = plan_split(self._worker_cores)
        config = AdamConfig(
            groups=self._groups,
            backend=self._requested_backend,
            exact_rollback=self._exact,
            cores=split.worker,
            threads=split.threads,
        )
        self._bridge = Bridge(
            TARGET,
            config,
            name="cpu-adam",
            start_timeout=self._start_timeout,
            close_timeout=self._close_timeout,
        )
        self._backend = await _start_worker(self._bridge, split, self._affinity)

    async def _close(self) -> None:
        """Stop the worker after the steps already sent.

        Results not consumed yet are dropped. The trainer's CPU affinity and torch thread
        count are restored. No process or shared-memory segment outlives it (the params
        stay in shared memory as long as the caller holds them).
        """
        self._outcomes.closed = True
        try:
            if self._bridge is not None:
                # for a follower that waits with nothing in flight
                self._outcomes.death = self._bridge.death
                await self._bridge.aclose()
        finally:
            self._affinity.restore()
            await self._registry.close()
            self._outcomes.wake()
            self._transfer.clear()

    # -- submitting ----------------------------------------------------------------------

    def _running_bridge(self) -> Bridge:
        self.check_running()
        if self._bridge is None:
            raise ClosedError("CPUAdam was never started")
        self._bridge.check_running()
        return self._bridge

    async def register(
        self, group_id: int, subgroup_id: int, param: torch.Tensor, grad: torch.Tensor
    ) -> None:
        """Move ``param`` and ``grad`` to shared memory off the event loop and register them.

        Optional: the first :meth:`submit` of a sub-group does the same on the loop (a
        copy of both tensors, which blocks the loop for large ones).
        """
        self._running_bridge()
        param_t, grad_t = validate(
            len(self._groups), self._subgroups, group_id, subgroup_id, param, grad, None
        )
        if (group_id, subgroup_id) in self._subgroups:
            return
        self._registry.check_loaded(group_id, subgroup_id, param_t)
        self._check_not_loading()
        thread = self._registry.thread()
        await asyncio.get_running_loop().run_in_executor(thread, share, param_t, grad_t)
        bridge = self._running_bridge()
        self._check_not_loading()
        if (group_id, subgroup_id) not in self._subgroups:
            await self._registry.register(bridge, group_id, subgroup_id, param_t, grad_t)

    def _check_not_loading(self) -> None:
        if self._loading:
            raise OptimizerError(
                "load_state_dict() is in progress: await it before submitting or registering"
            )

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

        ``param`` is updated in place; ``grad`` must not change until this step's result
        arrives. A ``grad`` other than the sub-group's registered one is copied into the
        registered (shared) buffer here, on the caller's thread: one memcpy, allowed only
        when none of that sub-group's steps is in flight. ``lr`` sets the group's learning
        rate from this step on. Raises :class:`OptimizerError` for bad input, before
        anything is sent.
        """
        bridge = self._running_bridge()
        self._check_not_loading()
        key = (group_id, subgroup_id)
        sub = self._subgroups.get(key)
        register: asyncio.Future[None] | None = None
        if sub is not None and sub.same(param, grad) and (lr is None or valid_lr(lr)):
            param_t = sub.param  # the steady state: nothing to check, nothing to copy
        else:
            param_t, grad_t = validate(
                len(self._groups), self._subgroups, group_id, subgroup_id, param, grad, lr
            )
            sub, register = self._registry.prepare(bridge, key, sub, param_t, grad_t)
        step = Step(group_id, subgroup_id, None if lr is None else float(lr), bool(rollback))
        kind = StepKind.ROLLBACK if rollback else StepKind.STEP
        pending = Pending(group_id, subgroup_id, kind, param_t, register)
        subgroup, outcomes = sub, self._outcomes

        def on_done(done: object, error: BaseException | None) -> None:
            subgroup.in_flight -= 1
            outcomes.finish(pending, done, error)

        bridge.call_with_callback(step, on_done)
        sub.in_flight += 1
        outcomes.pending.add(pending)

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
        return StepResults(self._outcomes, follow=follow)

    async def drain(self) -> list[StepResult]:
        """Wait for every outstanding step and return their results in completion order.

        Failures are raised once every step has finished: the error itself when there is
        one (a dead worker counts once), an :class:`ExceptionGroup` when there are
        several. No result is dropped: those of the steps that succeeded stay outstanding
        for the next ``drain()`` or ``results()``. Cancelling the wait consumes nothing.
        """
        return await self._outcomes.drain()

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
        return await self._transfer.snapshot(self._running_bridge(), self._subgroups)

    async def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Replace the optimizer state with ``state_dict`` (from :meth:`state_dict`).

        Every sub-group's next step is then bit-identical to the one the saved optimizer
        would have taken (on the same backend). Sub-groups of the state that are not
        registered yet take their state when they register; registered ones that it does
        not list start afresh; group hyper-parameters are replaced, as torch's optimizers
        do. An unknown group id, a size or dtype mismatch raises
        :class:`~aoffload.OptimizerError` and changes nothing. Steps already submitted run
        first; :meth:`submit` raises while the load is in progress. An exact-rollback
        pre-step copy does not survive a load: a rollback needs a step after it.
        """
        bridge = self._running_bridge()
        if self._loading:
            raise OptimizerError("another load_state_dict() is in progress")
        self._loading = True
        try:
            self._groups = await self._transfer.load_state_dict(
                bridge, state_dict, len(self._groups), self._registry
            )
        finally:
            self._loading = False
