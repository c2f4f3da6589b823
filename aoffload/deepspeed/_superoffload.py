"""DeepSpeed's ``SuperOffloadCPUOptimizer`` interface, backed by aoffload's CPU optimizer.

:class:`SuperOffloadCPUOptimizer` drives the optimizer's thread-safe core
(:class:`~aoffload.optimizer._core.OptimizerCore`, the same one :class:`~aoffload.CPUAdam`
is the asyncio face of) directly from the caller's thread: no event loop, no portal, no
pump. A step's result is recorded by the worker core's reader thread when it arrives and
taken by ``get_result()``; the blocking methods block on the core.
:func:`install_superoffload` puts it under a SuperOffload stage-3 optimizer.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from deepspeed.runtime.superoffload.superoffload_utils import EventTypes, ResultKeys, TaskKeys

from .._errors import ClosedError, OptimizerError
from ..optimizer import StepKind, StepResult
from ..optimizer._core import OptimizerCore
from ..optimizer.worker._calls import GROUP_KEYS

__all__ = ["SuperOffloadCPUOptimizer", "install_superoffload"]

logger = logging.getLogger(__name__)


_REQUIRED_KEYS = GROUP_KEYS[:5]  # what DeepSpeed's SuperOffload passes for every group
_CLOSE_TIMEOUT = 30.0


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
    """Drop-in for DeepSpeed's ``SuperOffloadCPUOptimizer``, backed by aoffload's CPU optimizer.

    Same constructor, ``async_step`` / ``get_result`` / ``close``, result keys (``TaskKeys``,
    ``ResultKeys``) and event types (``"adam_step"``, ``"rollback"``) as DeepSpeed's class.
    Every method runs on the caller's thread (any thread); there is no event loop behind it.

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
    (see :class:`aoffload.CPUAdam`'s ``worker_cores``); a fraction splits them, and the
    constructor's thread is the trainer's thread that :meth:`close` restores.
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
        self._closed = False
        # The memory each sub-group registered.
        self._registered: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._core = OptimizerCore.checked(
            _param_groups(optimizer_config),
            backend=backend,
            worker_cores=cpuadam_cores_perc,
            exact_rollback=exact_rollback,
            close_timeout=_CLOSE_TIMEOUT,
        )
        try:
            self._core.start(start_timeout)
        except BaseException:
            self._core.close()
            raise
        self._core.pin()

    @property
    def pid(self) -> int | None:
        """The worker's process id while it runs, else ``None``."""
        return None if self._closed else self._core.pid

    def _check_alive(self) -> None:
        if self._closed:
            raise ClosedError("the SuperOffloadCPUOptimizer is closed")
        self._core.check_running()  # raises WorkerDiedError once the worker is dead

    def _tensors(
        self, key: tuple[int, int], param: torch.Tensor, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The registered tensors of ``key``, with ``param`` and ``grad`` copied in if needed."""
        registered = self._registered.get(key)
        if registered is None:  # the first step registers them (async_step records them)
            if _pinned(param) or _pinned(grad):  # cannot move to shared memory in place
                param, grad = param.detach().clone(), grad.detach().clone()
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
        self._core.wait_subgroup(key)  # the registered memory is in use until then
        self._check_alive()
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
        """Queue one step (or, with ``rollback=True``, its undo) of a sub-group.

        Sent on the caller's thread; it only waits when other tensors than the registered
        ones must be copied into the registered memory while that sub-group has a step in
        flight.
        """
        self._check_alive()
        if fp32_grad.numel() > self.max_grad_numel:
            raise OptimizerError(
                f"gradient of {fp32_grad.numel()} elements exceeds max_grad_numel="
                f"{self.max_grad_numel}"
            )
        key = (param_group_id, sub_group_id)
        param, grad = self._tensors(key, fp32_param, fp32_grad)
        self._core.submit((param_group_id, sub_group_id), param, grad, lr=lr, rollback=rollback)
        if key not in self._registered:  # registered by this first step: record its memory
            self._registered[key] = (param, grad)

    def get_result(self, expected_event_type: str | None = None) -> dict[str, Any] | None:
        """The next finished step's result dict, or ``None`` when none has finished yet.

        Never blocks. Raises :class:`aoffload.WorkerDiedError` once the worker is dead and
        every result it produced has been returned, :class:`aoffload.RemoteError` for a
        step that failed, and :class:`aoffload.OptimizerError` when ``expected_event_type``
        does not match.
        """
        pending = self._core.outcomes.take()
        if pending is None:
            self._check_alive()
            return None
        item = _as_result(pending.result())
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
        return self._core.state_dict().result()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a state from :meth:`state_dict` (see :meth:`CPUAdam.load_state_dict`)."""
        self._check_alive()
        self._core.load_state_dict(state_dict).result()

    def close(self) -> None:
        """Stop the worker (draining queued steps, with a bound); idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._core.close()
        finally:
            self._core.kill()
            self._core.unpin()


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
