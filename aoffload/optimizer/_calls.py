"""The CPU optimizer's wire: its configuration and its typed calls.

The trainer registers each sub-group once (:class:`Register` carries the param and
grad tensors, whose storage is already in shared memory, so the worker maps the very
same bytes); every later :class:`Step` carries only ids, the learning rate and a flag.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._runtime.protocol import Call, Wire

__all__ = [
    "GROUP_KEYS",
    "AdamConfig",
    "Done",
    "GetInfo",
    "GroupConfig",
    "Info",
    "Register",
    "Step",
]

GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "bias_correction")
"""The hyper-parameters a param group may set (DeepSpeed's names); the first five are
the ones DeepSpeed's SuperOffload passes for every group."""


@dataclass(frozen=True, slots=True)
class GroupConfig:
    """Hyper-parameters of one parameter group."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    bias_correction: bool = True


@dataclass(frozen=True, slots=True)
class AdamConfig:
    """How the worker starts: its backend, groups, cores and thread count."""

    groups: tuple[GroupConfig, ...]
    backend: str  # "auto" | "deepspeed" | "torch"
    exact_rollback: bool
    cores: tuple[int, ...] | None  # CPU affinity of the worker; None leaves it as inherited
    threads: int | None  # torch (and OpenMP) threads of the worker; None leaves the default


@dataclass(frozen=True, slots=True)
class Info:
    """What the worker runs: its backend, thread count and cores."""

    backend: str
    threads: int
    cores: tuple[int, ...] | None


@dataclass(frozen=True, slots=True)
class GetInfo(Call[Info]):
    """Ask the worker what it runs."""


@dataclass(frozen=True, slots=True)
class Register(Call[None]):
    """Trainer -> worker, once per sub-group: the shared param and grad tensors."""

    group_id: int
    subgroup_id: int
    param: torch.Tensor
    grad: torch.Tensor


@dataclass(frozen=True, slots=True)
class Done(Wire):
    """Reply to a :class:`Step`: the sub-group's step count after it, and the compute time."""

    step: int
    seconds: float


@dataclass(frozen=True, slots=True)
class Step(Call[Done]):
    """Trainer -> worker, per step: ids and scalars only, never tensors."""

    group_id: int
    subgroup_id: int
    lr: float | None
    rollback: bool
