"""The CPU optimizer's wire: its configuration and its typed calls.

The trainer registers each sub-group once (:class:`Register` carries the param and
grad tensors, whose storage is already in shared memory, so the worker maps the very
same bytes); every later :class:`Step` carries only ids, the learning rate and a flag.

Optimizer state moves through shared *state buffers* that the worker allocates once
(:class:`Allocate`) and both sides map: :class:`Snapshot` copies the moments into one,
:class:`Load` copies them out of one. Those calls carry ids, offsets and scalars only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..._runtime.protocol import Call, Wire

__all__ = [
    "GROUP_KEYS",
    "AdamConfig",
    "Done",
    "GetInfo",
    "GroupConfig",
    "Hurry",
    "Info",
    "Kernel",
    "Load",
    "Register",
    "Release",
    "SetGroups",
    "Settle",
    "Snapshot",
    "StateInfo",
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

    def as_dict(self) -> dict[str, Any]:
        """The group in a state dict's layout (DeepSpeed's keys, ``torch.optim``'s betas)."""
        return {
            "lr": self.lr,
            "betas": (self.beta1, self.beta2),
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            "amsgrad": False,
            "bias_correction": self.bias_correction,
        }


@dataclass(frozen=True, slots=True)
class AdamConfig:
    """How the worker starts: its backend, groups, cores and thread count."""

    groups: tuple[GroupConfig, ...]
    backend: str  # "auto" | "deepspeed" | "torch"
    exact_rollback: bool
    cores: tuple[int, ...] | None  # CPU affinity of the worker; None leaves it as inherited
    threads: int | None  # torch (and OpenMP) threads of the worker; None leaves the default
    side_by_side: bool = False
    """The torch backend steps sub-groups side by side on that many threads, one core each
    (replies then come in completion order; see ``_stepper``)."""


@dataclass(frozen=True, slots=True)
class Info:
    """What the worker runs: its backend, thread count and cores; for the deepspeed backend,
    the op's library and whether the worker has imported DeepSpeed (to load it, or else)."""

    backend: str
    threads: int
    cores: tuple[int, ...] | None
    op_library: str | None = None
    deepspeed_imported: bool = False
    fallback: str | None = None
    """Why ``backend="auto"`` runs the torch backend (``None``: it was not asked to choose,
    or DeepSpeed's op loaded)."""

    def __str__(self) -> str:
        op = ""
        if self.op_library is not None:
            imported = "imported" if self.deepspeed_imported else "not imported"
            op = f" (op {self.op_library}, DeepSpeed {imported})"
        cores = "unpinned" if self.cores is None else list(self.cores)
        return f"{self.backend} backend{op}, {self.threads} threads, worker cores {cores}"


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
    pieces: tuple[tuple[int, int], ...] = ()
    """``(offset, numel)`` of separate tensors laid out in the flat ``param`` (OffloadAdam's
    parameters); the torch backend steps them as a list, exactly as ``torch.optim.AdamW``
    steps separate tensors. Empty: one tensor."""


@dataclass(frozen=True, slots=True)
class SetGroups(Call[None]):
    """Trainer -> worker: replace every group's hyper-parameters (more groups: added ones).

    Served in order: the steps sent after it use the new values."""

    groups: tuple[GroupConfig, ...]


@dataclass(frozen=True, slots=True)
class Hurry(Call[None]):
    """Trainer -> worker: the trainer now waits for the steps it sent (the backward is over):
    step them on every core (see ``_stepper``). Answered at once."""

    plain = True


@dataclass(frozen=True, slots=True)
class Settle(Call[None]):
    """Trainer -> worker: every step sent is final (none will be rolled back): keep a copy
    of each sub-group's moments now, in the background, so that the next step's exact
    backup copies the parameter alone (see ``_backend``)."""

    plain = True


@dataclass(frozen=True, slots=True)
class Done(Wire):
    """Reply to a :class:`Step`: the sub-group's step count after it, and the compute time."""

    step: int
    seconds: float


@dataclass(frozen=True, slots=True)
class Step(Call[Done]):
    """Trainer -> worker, per step: ids and scalars only, never tensors."""

    plain = True
    group_id: int
    subgroup_id: int
    lr: float | None
    rollback: bool


Kernel = tuple[int, int, float, float]
"""DeepSpeed's CPU Adam bias-correction state: (anchor step, step, beta1, beta2).

``beta**anchor`` was computed with ``pow``, then multiplied by ``beta`` once per step
up to ``step``; the next step's rounding depends on it (see ``_deepspeed_backend``)."""


@dataclass(frozen=True, slots=True)
class Allocate(Call[torch.Tensor]):
    """Trainer -> worker: allocate state buffer ``buffer_id`` of ``numel`` float32 in shared
    memory; the reply is that tensor (its shared-memory handle, not its data)."""

    buffer_id: int
    numel: int


@dataclass(frozen=True, slots=True)
class Release(Call[None]):
    """Trainer -> worker: forget state buffer ``buffer_id``."""

    buffer_id: int


@dataclass(frozen=True, slots=True)
class StateInfo(Wire):
    """Reply to a :class:`Snapshot`: the scalars of the state (the moments are in the buffer)."""

    backend: str
    steps: tuple[int, ...]
    groups: tuple[GroupConfig, ...]
    kernel: Kernel | None


@dataclass(frozen=True, slots=True)
class Snapshot(Call[StateInfo]):
    """Trainer -> worker: copy the moments of ``keys`` into buffer ``buffer_id``.

    Sub-group ``keys[i]`` takes ``2 * numel`` floats at the running offset: ``exp_avg``
    then ``exp_avg_sq``. Served in order, so it sees every step sent before it.
    """

    buffer_id: int
    keys: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class Load(Call[None]):
    """Trainer -> worker: replace the optimizer state with the one staged in ``buffer_id``.

    ``entries`` are ``(group_id, subgroup_id, numel, step)`` laid out as in
    :class:`Snapshot`; registered sub-groups that are not listed start afresh, listed
    ones that are not registered yet take their state when they register.
    """

    buffer_id: int
    entries: tuple[tuple[int, int, int, int], ...]
    groups: tuple[GroupConfig, ...]
    kernel: Kernel | None
