"""DeepSpeed's ``SuperOffloadCPUOptimizer`` interface, backed by :class:`aoffload.CPUAdam`.

:class:`SuperOffloadCPUOptimizer` owns a private event loop on a daemon thread (a
portal) that runs the :class:`~aoffload.CPUAdam`; :func:`install_superoffload` puts it
under a SuperOffload stage-3 optimizer.
"""

from __future__ import annotations

import asyncio
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
    ``ResultKeys``) and event types (``"adam_step"``, ``"rollback"``) as DeepSpeed's class. The
    step runs in aoffload's worker on ``fp32_param`` in place (its storage moves to shared
    memory on the first step), and the result's ``updated_param`` is that same tensor.

    Differences, all deliberate: ``get_result()`` stays non-blocking but raises
    :class:`aoffload.WorkerDiedError` once the worker is dead (instead of returning ``None``
    forever); an exception in one step raises :class:`aoffload.RemoteError` from
    ``get_result()`` and the worker keeps serving; bad configuration or a gradient larger than
    ``max_grad_numel`` raises :class:`aoffload.OptimizerError` at once instead of killing the
    worker. ``backend`` and ``exact_rollback`` are passed to :class:`aoffload.CPUAdam`;
    ``pin_memory`` is accepted for compatibility (there is no accelerator copy to speed up).
    """

    def __init__(
        self,
        optimizer_config: Mapping[str, Any] | Sequence[Mapping[str, Any]],
        cpuadam_cores_perc: float = 0.8,
        max_grad_numel: int = 1000000,
        pin_memory: bool = True,
        *,
        backend: str = "deepspeed",
        exact_rollback: bool = False,
        start_timeout: float = 60.0,
    ) -> None:
        if not 0 < cpuadam_cores_perc <= 1:
            raise OptimizerError("cpuadam_cores_perc must be between 0 and 1")
        self.max_grad_numel = max_grad_numel
        self.pin_memory = pin_memory
        self._results: queue.SimpleQueue[dict[str, Any] | BaseException] = queue.SimpleQueue()
        self._pump: asyncio.Task[None] | None = None
        self._closed = False
        self._optimizer = CPUAdam(
            param_groups=_param_groups(optimizer_config),
            backend=backend,
            worker_cores=cpuadam_cores_perc,
            exact_rollback=exact_rollback,
            start_timeout=start_timeout,
        )
        self._portal = Portal("superoffload")
        try:
            self._portal.call(self._optimizer.__aenter__())
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
        if self._pump is None or self._pump.done():
            self._pump = asyncio.get_running_loop().create_task(self._pump_results())

    async def _settle(self) -> None:
        if self._pump is not None:
            await asyncio.wait({self._pump})

    async def _pump_results(self) -> None:
        # results() ends when nothing is outstanding; the next _submit starts a new pump.
        while True:
            try:
                async for result in self._optimizer.results():
                    self._results.put(_as_result(result))
            except RemoteError as exc:
                self._results.put(exc)
                continue
            except AoffloadError as exc:
                self._results.put(exc)
            return

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
        self._portal.call(
            self._submit(param_group_id, sub_group_id, fp32_param, fp32_grad, rollback, lr)
        )

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

    def close(self) -> None:
        """Stop the worker (draining queued steps, with a bound) and the portal; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._portal.call(self._optimizer.aclose())
        finally:
            self._portal.close()


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
