"""Sub-groups as the trainer sees them: validation, registration records, shared memory.

A sub-group is registered once (its param and grad move to shared memory in place and
are handed to the worker); :class:`SubGroup` remembers which memory that was, so a
later submit, from any thread, can take the fast path when the caller passes the very
same tensors. :class:`Registry` holds them, safe for every thread of the trainer.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
from collections.abc import Mapping, Sequence

import torch

from .._errors import OptimizerError
from .._runtime.core import WorkerCore
from .._runtime.threads import mark_retrieved
from .worker._calls import GROUP_KEYS, GroupConfig, Register

__all__ = [
    "BACKENDS",
    "Registry",
    "SubGroup",
    "check_options",
    "check_registered",
    "check_tensor",
    "group_config",
    "share",
    "valid_lr",
    "validate",
]


BACKENDS = ("auto", "deepspeed", "torch")


def check_options(
    param_groups: Sequence[Mapping[str, object]] | Mapping[str, object],
    backend: str,
    worker_cores: float | None,
) -> tuple[GroupConfig, ...]:
    """Validate the optimizer's arguments; its param groups as GroupConfigs."""
    if isinstance(param_groups, Mapping):
        param_groups = [param_groups]
    if not param_groups:
        raise OptimizerError("CPUAdam needs at least one param group")
    if backend not in BACKENDS:
        raise OptimizerError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if worker_cores is not None and not 0.0 < worker_cores <= 1.0:
        raise OptimizerError(f"worker_cores must be in (0, 1], got {worker_cores!r}")
    return tuple(group_config(i, group) for i, group in enumerate(param_groups))


def group_config(index: int, group: Mapping[str, object]) -> GroupConfig:
    """Validate param group ``index`` (DeepSpeed's keys and defaults) into a GroupConfig."""
    unknown = set(group) - set(GROUP_KEYS) - {"params"}
    if unknown:
        raise OptimizerError(
            f"param group {index} has unknown keys {sorted(unknown)}; "
            f"supported: {sorted(GROUP_KEYS)} ('params' is ignored)"
        )
    if group.get("amsgrad", False):
        raise OptimizerError(f"param group {index}: amsgrad is not supported (DeepSpeed has none)")
    betas = group.get("betas", (0.9, 0.999))
    try:
        beta1, beta2 = (float(b) for b in betas)  # type: ignore[attr-defined]
        config = GroupConfig(
            lr=float(group.get("lr", 1e-3)),  # type: ignore[arg-type]
            beta1=beta1,
            beta2=beta2,
            eps=float(group.get("eps", 1e-8)),  # type: ignore[arg-type]
            weight_decay=float(group.get("weight_decay", 0.0)),  # type: ignore[arg-type]
            bias_correction=bool(group.get("bias_correction", True)),
        )
    except (TypeError, ValueError) as exc:
        raise OptimizerError(f"param group {index}: {exc}") from exc
    if not (0.0 <= beta1 < 1.0 and 0.0 < beta2 < 1.0):
        raise OptimizerError(f"param group {index}: betas must lie in [0, 1), got {betas!r}")
    if config.lr < 0 or config.eps <= 0 or config.weight_decay < 0:
        raise OptimizerError(
            f"param group {index}: lr, eps and weight_decay must be >= 0 (eps > 0)"
        )
    return config


def check_tensor(role: str, tensor: object, where: str) -> torch.Tensor:
    """``tensor`` if it is a contiguous, non-empty CPU float32 tensor, else OptimizerError."""
    if not isinstance(tensor, torch.Tensor):
        raise OptimizerError(f"{where}: {role} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise OptimizerError(
            f"{where}: {role} is on {tensor.device}; CPUAdam steps CPU tensors (copy it to "
            "the CPU master copy first)"
        )
    if tensor.dtype != torch.float32:
        raise OptimizerError(f"{where}: {role} is {tensor.dtype}; CPUAdam needs torch.float32")
    if not tensor.is_contiguous():
        raise OptimizerError(f"{where}: {role} is not contiguous; pass `.contiguous()` once")
    if tensor.numel() == 0:
        raise OptimizerError(f"{where}: {role} is empty")
    return tensor


def valid_lr(lr: object) -> bool:
    """Whether ``lr`` is a finite number >= 0."""
    return isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0


class SubGroup:
    """A registered sub-group: the caller's tensors and the shared memory the worker maps.

    ``in_flight`` (its steps sent and not answered) is guarded by the outcomes' lock.
    """

    __slots__ = ("grad", "grad_buffer", "grad_ptr", "in_flight", "numel", "param", "param_ptr")

    def __init__(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        self.param = param
        self.grad = grad
        # An alias of the shared grad memory that the caller cannot re-point (`set_()`).
        self.grad_buffer = grad.detach()
        self.param_ptr = param.data_ptr()
        self.grad_ptr = grad.data_ptr()
        self.numel = param.numel()
        self.in_flight = 0

    def same(self, param: object, grad: object) -> bool:
        """The registered tensors themselves, still on their registered memory (fast path)."""
        return (
            param is self.param
            and grad is self.grad
            and self.is_param(self.param)
            and self.is_grad(self.grad)
        )

    def is_param(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is the registered param memory."""
        return param.data_ptr() == self.param_ptr and param.numel() == self.numel

    def is_grad(self, grad: torch.Tensor) -> bool:
        """Whether ``grad`` is the registered grad memory."""
        return grad.data_ptr() == self.grad_ptr and grad.numel() == self.numel


def validate(
    groups: int,
    registered: Mapping[tuple[int, int], SubGroup],
    group_id: object,
    subgroup_id: object,
    param: object,
    grad: object,
    lr: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check one submit's arguments against ``groups`` groups and the registered sub-groups."""
    if not isinstance(group_id, int) or not 0 <= group_id < groups:
        raise OptimizerError(
            f"unknown param group id {group_id!r}: this CPUAdam has groups 0..{groups - 1}"
        )
    if not isinstance(subgroup_id, int):
        raise OptimizerError(f"subgroup_id must be an int, got {type(subgroup_id).__name__}")
    where = f"sub-group {subgroup_id} of group {group_id}"
    param_t = check_tensor("param", param, where)
    grad_t = check_tensor("grad", grad, where)
    if grad_t.shape != param_t.shape:
        raise OptimizerError(
            f"{where}: grad shape {tuple(grad_t.shape)} != param shape {tuple(param_t.shape)}"
        )
    if lr is not None and not valid_lr(lr):
        raise OptimizerError(f"{where}: lr must be a finite float >= 0 or None, got {lr!r}")
    known = registered.get((group_id, subgroup_id))
    if known is not None:
        check_registered(known, group_id, subgroup_id, param_t)
    return param_t, grad_t


def check_registered(known: SubGroup, group_id: int, subgroup_id: int, param: torch.Tensor) -> None:
    """Refuse a ``param`` that is not the memory sub-group ``known`` registered."""
    if not known.is_param(param):
        raise OptimizerError(
            f"sub-group {subgroup_id} of group {group_id}: param is not the memory registered "
            f"on its first submit (a tensor of {known.numel} elements; re-pointing it with "
            "`.set_()` or `.data =` counts as another tensor): the worker updates that memory "
            "in place. Copy new values into it (`registered.copy_(new)`), or use a new "
            "sub-group id"
        )


def share(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Move ``param`` and ``grad`` to shared memory in place (the worker maps the same bytes)."""
    try:
        param.share_memory_()  # type: ignore[no-untyped-call]
        grad.share_memory_()  # type: ignore[no-untyped-call]
    except RuntimeError as exc:
        raise OptimizerError(
            f"could not move the tensors to shared memory ({exc}); pass tensors that own "
            "their memory (not pinned, not from numpy/from_blob)"
        ) from exc


class Registry:
    """The sub-groups registered with one worker, and the loaded state waiting for others.

    Thread-safe: :attr:`subgroups` is read without a lock (a dict lookup is atomic) and
    written under :attr:`lock`, which also guards :attr:`loaded` and :attr:`loading`. A
    registration sends its ``Register`` call under the lock and publishes the sub-group
    after it, so any thread that finds a sub-group sends its steps behind its registration.
    The core's reader thread never takes this lock.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.subgroups: dict[tuple[int, int], SubGroup] = {}
        self.loaded: dict[tuple[int, int], int] = {}  # numel of loaded, unregistered sub-groups
        self.loading = False  # a load_state_dict() is in progress: no submit, no registration

    def check_not_loading(self) -> None:
        """Refuse a submit or a registration while a state is being loaded."""
        if self.loading:
            raise OptimizerError(
                "load_state_dict() is in progress: await it before submitting or registering"
            )

    def check_loaded(self, group_id: int, subgroup_id: int, param: torch.Tensor) -> None:
        """Refuse a sub-group whose size differs from the state loaded for it."""
        expected = self.loaded.get((group_id, subgroup_id))
        if expected is not None and expected != param.numel():
            raise OptimizerError(
                f"sub-group {subgroup_id} of group {group_id} has {param.numel()} elements; "
                f"the state loaded for it holds {expected}: is this the same model and split?"
            )

    def register(
        self,
        worker: WorkerCore,
        key: tuple[int, int],
        param: torch.Tensor,
        grad: torch.Tensor,
        pieces: tuple[tuple[int, int], ...] = (),
    ) -> tuple[SubGroup, concurrent.futures.Future[None] | None]:
        """Hand the shared ``param`` and ``grad`` to the worker as sub-group ``key``.

        Returns the sub-group and the future of its ``Register`` call, or the sub-group
        another thread registered meanwhile and ``None``.
        """
        with self.lock:
            known = self.subgroups.get(key)
            if known is not None:
                return known, None
            self.check_not_loading()
            self.check_loaded(*key, param)
            future = worker.submit(Register(*key, param.detach(), grad.detach(), pieces))
            future.add_done_callback(mark_retrieved)  # a failed register fails its first step
            self.loaded.pop(key, None)
            sub = self.subgroups[key] = SubGroup(param, grad)
            return sub, future

    def numels(self) -> dict[tuple[int, int], int]:
        """The registered sub-groups' sizes (call under :attr:`lock`)."""
        return {key: sub.numel for key, sub in self.subgroups.items()}

    def clear(self) -> None:
        """Forget every sub-group (the worker is gone)."""
        with self.lock:
            self.subgroups = {}
            self.loaded = {}
