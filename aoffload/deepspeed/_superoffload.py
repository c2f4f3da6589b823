"""DeepSpeed's ``SuperOffloadCPUOptimizer`` interface, backed by :class:`aoffload.CPUAdam`.

:class:`SuperOffloadCPUOptimizer` owns a private event loop on a daemon thread (a
portal) that runs the :class:`~aoffload.CPUAdam`; :func:`install_superoffload` puts it
under a SuperOffload stage-3 optimizer.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from deepspeed.runtime.superoffload.superoffload_utils import EventTypes, ResultKeys, TaskKeys

from .._errors import AoffloadError, ClosedError, OptimizerError, RemoteError, WorkerDiedError
from .._runtime.threads import Portal
from ..optimizer import CPUAdam, StepKind, StepResult
from ..optimizer._calls import GROUP_KEYS

__all__ = ["SuperOffloadCPUOptimizer", "install_superoffload"]

logger = logging.getLogger(__name__)


_REQUIRED_KEYS = GROUP_KEYS[:5]  # what DeepSpeed's SuperOffload passes for every group


def _param_groups(optimizer_config: object) -> list[dict[str, Any]]:
    configs = optimizer_config if isinstance(optimizer_config, Sequence) else [optimizer_config]
    groups = []
    for index, config in enumerate(configs):
        if not isinstance(config, Mapping):
            raise OptimizerError(f"optimizer_config[{index}] must be a mapping, got {config!r}")
        missing = [key for key in _REQUIRED_KEYS if key not in config]
        if missing:
            raise OptimizerError(f"optimizer_config[{index}] lacks required keys {missing}")
        groups.append({key: config[key] for key in GROUP_KEYS if key in config})
    if not groups:
        raise OptimizerError("optimizer_config holds no parameter group")
    return groups


def _as_result(result: StepResult) -> dict[str, Any]:
    event = EventTypes.ROLLBACK if result.kind is StepKind.ROLLBACK else EventTypes.ADAM_STEP
    return {
        TaskKeys.PARAM_GROUP_ID: result.group_id,
        TaskKeys.SUB_GROUP_ID: result.subgroup_id,
        ResultKeys.UPDATED_PARAM: result.param,
        ResultKeys.EVENT_TYPE: event,
    }


class SuperOffloadCPUOptimizer:
    """Drop-in for DeepSpeed's ``SuperOffloadCPUOptimizer``, backed by :class:`aoffload.CPUAdam`.

    Same constructor, ``async_step`` / ``get_result`` / ``close``, result keys (``TaskKeys``,
    ``ResultKeys``) and event types (``"adam_step"``, ``"rollback"``) as DeepSpeed's class.

    Tensors: like DeepSpeed's, ``async_step`` takes any param and grad on every call. The
    first call of a sub-group registers its tensors (their storage moves to shared memory
    in place; pinned tensors are copied into shared ones instead); a later call with the
    same tensors sends no data, and the step updates ``fp32_param`` in place. A call with
    other tensors copies them into the registered memory (once that sub-group's earlier
    steps are done, which it waits for). Either way the result's ``updated_param`` is the
    registered tensor holding the updated values, as DeepSpeed's result holds the stepped
    tensor; DeepSpeed's stage 3 copies it into its own master copy.

    State: :meth:`state_dict` and :meth:`load_state_dict` (synchronous) return and restore
    the optimizer state as :meth:`aoffload.CPUAdam.state_dict` does, for checkpoints.

    Differences, all deliberate: ``get_result()`` stays non-blocking but raises
    :class:`aoffload.WorkerDiedError` once the worker is dead (instead of returning ``None``
    forever); an exception in one step raises :class:`aoffload.RemoteError` from
    ``get_result()`` and the worker keeps serving; bad configuration or a gradient larger than
    ``max_grad_numel`` raises :class:`aoffload.OptimizerError` at once instead of killing the
    worker. ``backend`` and ``exact_rollback`` are passed to :class:`aoffload.CPUAdam`;
    ``pin_memory`` is accepted for compatibility (there is no accelerator copy to speed up).
    ``cpuadam_cores_perc`` defaults to ``None`` (DeepSpeed's is 0.8): the worker and the
    trainer share every CPU, which measured faster when the trainer waits for the results
    (see :class:`aoffload.CPUAdam`'s ``worker_cores``); a fraction splits them.
    """

    def __init__(
        self,
        optimizer_config: Mapping[str, Any] | Sequence[Mapping[str, Any]],
        cpuadam_cores_perc: float | None = None,
        max_grad_numel: int = 1000000,
        pin_memory: bool = True,
        *,
        backend: str = "deepspeed",
        exact_rollback: bool = False,
        start_timeout: float = 60.0,
    ) -> None:
        if cpuadam_cores_perc is not None and not 0 < cpuadam_cores_perc <= 1:
            raise OptimizerError("cpuadam_cores_perc must be between 0 and 1")
        self.max_grad_numel = max_grad_numel
        self.pin_memory = pin_memory
        self._results: queue.SimpleQueue[dict[str, Any] | BaseException] = queue.SimpleQueue()
        self._pump: asyncio.Task[None] | None = None
        self._closed = False
        # The trainer thread's view: the memory each sub-group registered.
        self._registered: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        # The portal loop's view: steps sent and not yet answered, in the worker's order.
        self._order: collections.deque[tuple[int, int]] = collections.deque()
        self._in_flight: collections.Counter[tuple[int, int]] = collections.Counter()
        self._watchers: list[asyncio.Future[None]] = []
        self._optimizer = CPUAdam(
            param_groups=_param_groups(optimizer_config),
            backend=backend,
            worker_cores=cpuadam_cores_perc,
            exact_rollback=exact_rollback,
            start_timeout=start_timeout,
        )
        self._portal = Portal("superoffload")
        try:
            self._portal.call(self._open())
        except BaseException:
            self._portal.close()
            raise
        self._pid = self._optimizer.pid

    @property
    def pid(self) -> int | None:
        """The worker's process id while it runs, else ``None``."""
        return self._optimizer.pid

    def _check_alive(self) -> None:
        if self._closed:
            raise ClosedError("the SuperOffloadCPUOptimizer is closed")
        if self._optimizer.pid is None:
            raise WorkerDiedError("cpu-adam", self._pid, None)

    async def _open(self) -> None:
        await self._optimizer.start()
        self._pump = asyncio.get_running_loop().create_task(self._pump_results())

    async def _submit(
        self,
        param_group_id: int,
        sub_group_id: int,
        fp32_param: torch.Tensor,
        fp32_grad: torch.Tensor,
        rollback: bool,
        lr: float | None,
    ) -> None:
        self._optimizer.submit(
            param_group_id, sub_group_id, fp32_param, fp32_grad, lr=lr, rollback=rollback
        )
        key = (param_group_id, sub_group_id)
        self._order.append(key)
        self._in_flight[key] += 1

    def _answered(self) -> None:
        if self._order:
            key = self._order.popleft()
            self._in_flight[key] -= 1
        self._wake()

    def _wake(self) -> None:
        watchers, self._watchers = self._watchers, []
        for watcher in watchers:
            if not watcher.done():
                watcher.set_result(None)

    async def _until(self, condition: Any) -> None:
        """Wait until ``condition()`` holds or the pump has ended (the worker is gone)."""
        while not condition() and not (self._pump is None or self._pump.done()):
            watcher = asyncio.get_running_loop().create_future()
            self._watchers.append(watcher)
            await watcher

    async def _idle(self, key: tuple[int, int]) -> None:
        await self._until(lambda: not self._in_flight[key])

    async def _settle(self) -> None:
        await self._until(lambda: not self._order)

    async def _pump_results(self) -> None:
        # One consumer for the optimizer's life: results(follow=True) ends at the close.
        results = self._optimizer.results(follow=True)
        try:
            while True:
                try:
                    result = await anext(results)
                except StopAsyncIteration:
                    return
                except RemoteError as exc:  # that step failed; the worker serves on
                    self._results.put(exc)
                except AoffloadError as exc:  # the worker died: nothing more will come
                    self._results.put(exc)
                    return
                else:
                    self._results.put(_as_result(result))
                self._answered()
        finally:
            self._wake()

    def _tensors(
        self, key: tuple[int, int], param: torch.Tensor, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The registered tensors of ``key``, with ``param`` and ``grad`` copied in if needed."""
        registered = self._registered.get(key)
        if registered is None:
            if _pinned(param) or _pinned(grad):  # cannot move to shared memory in place
                param, grad = param.detach().clone(), grad.detach().clone()
            self._registered[key] = (param, grad)
            return param, grad
        own_param, own_grad = registered
        same_param = param.data_ptr() == own_param.data_ptr()
        same_grad = grad.data_ptr() == own_grad.data_ptr()
        if same_param and same_grad and param.numel() == own_param.numel():
            return registered
        if param.numel() != own_param.numel() or grad.numel() != own_grad.numel():
            raise OptimizerError(
                f"sub-group {key[1]} of group {key[0]} was registered with "
                f"{own_param.numel()} elements, got param {param.numel()} / grad {grad.numel()}"
            )
        self._portal.call(self._idle(key))  # the registered memory is in use until then
        if not same_param:
            own_param.copy_(param.reshape(own_param.shape))
        if not same_grad:
            own_grad.copy_(grad.reshape(own_grad.shape))
        return registered

    def async_step(
        self,
        param_group_id: int,
        sub_group_id: int,
        fp32_param: torch.Tensor,
        fp32_grad: torch.Tensor,
        rollback: bool = False,
        lr: float | None = None,
    ) -> None:
        """Queue one step (or, with ``rollback=True``, its undo) of a sub-group; never waits."""
        self._check_alive()
        if fp32_grad.numel() > self.max_grad_numel:
            raise OptimizerError(
                f"gradient of {fp32_grad.numel()} elements exceeds max_grad_numel="
                f"{self.max_grad_numel}"
            )
        key = (param_group_id, sub_group_id)
        new = key not in self._registered
        param, grad = self._tensors(key, fp32_param, fp32_grad)
        try:
            self._portal.call(self._submit(param_group_id, sub_group_id, param, grad, rollback, lr))
        except BaseException:
            if new:
                self._registered.pop(key, None)  # not registered: the next call tries again
            raise

    def get_result(self, expected_event_type: str | None = None) -> dict[str, Any] | None:
        """The next finished step's result dict, or ``None`` when none has finished yet.

        Raises :class:`aoffload.WorkerDiedError` once the worker is dead and every result it
        produced has been returned, :class:`aoffload.RemoteError` for a step that failed, and
        :class:`aoffload.OptimizerError` when ``expected_event_type`` does not match.
        """
        try:
            item = self._results.get_nowait()
        except queue.Empty:
            if self._closed or self._optimizer.pid is not None:
                self._check_alive()
                return None
            # Dead: first let through the results that finished before the death.
            self._portal.call(self._settle())
            try:
                item = self._results.get_nowait()
            except queue.Empty:
                raise WorkerDiedError("cpu-adam", self._pid, None) from None
        if isinstance(item, BaseException):
            raise item
        if expected_event_type is not None and item[ResultKeys.EVENT_TYPE] != expected_event_type:
            raise OptimizerError(
                f"Event type mismatch: expected {expected_event_type!r}, "
                f"got {item[ResultKeys.EVENT_TYPE]!r}"
            )
        return item

    def state_dict(self) -> dict[str, Any]:
        """The optimizer state after every step submitted so far (see :meth:`CPUAdam.state_dict`).

        Waits for those steps; their results still come from :meth:`get_result`.
        """
        self._check_alive()
        return self._portal.call(self._optimizer.state_dict())

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a state from :meth:`state_dict` (see :meth:`CPUAdam.load_state_dict`)."""
        self._check_alive()
        self._portal.call(self._optimizer.load_state_dict(state_dict))

    def close(self) -> None:
        """Stop the worker (draining queued steps, with a bound) and the portal; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._portal.call(self._optimizer.aclose())
        finally:
            self._portal.close()


def _pinned(tensor: torch.Tensor) -> bool:
    try:
        return bool(tensor.is_pinned())
    except RuntimeError:  # no accelerator runtime: nothing can be pinned
        return False


def install_superoffload(target: Any, **options: Any) -> SuperOffloadCPUOptimizer:
    """Make a SuperOffload stage-3 optimizer step through :class:`SuperOffloadCPUOptimizer`.

    ``target`` is the ``DeepSpeedEngine`` (or its ``optimizer``, a
    ``SuperOffloadOptimizer_Stage3``). Call it after ``deepspeed.initialize`` and before the
    first step: it closes DeepSpeed's CPU optimizer process and assigns the stage-3 optimizer's
    ``superoffload_cpu_optimizer`` attribute (DeepSpeed has no hook for this), building the
    replacement from the same parameter groups, ``max_grad_numel`` and ``pin_memory``.
    ``options`` (``cpuadam_cores_perc``, ``backend``, ``exact_rollback``) go to the constructor.
    """
    optimizer = getattr(target, "optimizer", target)
    if not hasattr(optimizer, "superoffload_cpu_optimizer"):
        optimizer = target
    old = getattr(optimizer, "superoffload_cpu_optimizer", None)
    if old is None:
        raise OptimizerError(f"{type(optimizer).__name__} is not a SuperOffload stage-3 optimizer")
    if getattr(optimizer, "async_cpuadam_num", 0):
        raise OptimizerError("install_superoffload() must run before the first step")
    configs = [
        {key: group[key] for key in _REQUIRED_KEYS} for group in optimizer.optimizer.param_groups
    ]
    new = SuperOffloadCPUOptimizer(
        configs,
        max_grad_numel=optimizer.max_grad_numel,
        pin_memory=getattr(optimizer, "offload_optimizer_pin_memory", True),
        **options,
    )
    try:
        old.close()
    except BaseException:
        new.close()
        raise
    optimizer.superoffload_cpu_optimizer = new
    return new
