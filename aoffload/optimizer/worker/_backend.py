"""What the worker's two backends share: sub-groups, their state in one layout, exact backups.

A backend steps one sub-group at a time (:mod:`._torch_backend`: torch's fused AdamW;
:mod:`._deepspeed_backend`: DeepSpeed's CPU Adam op). Both keep a sub-group's state the
same way (a step count and flat fp32 ``exp_avg`` and ``exp_avg_sq``, none before its first
step), so they export and import it in one layout, and a state saved on one loads into the
other. :class:`SubGroupBackend` holds that state, the groups' hyper-parameters and the
exact backups; a backend adds its math (``step``, ``rollback``) and its kernel state.

**Exact backups** (:class:`Backup`): a pre-step copy of a sub-group's parameter and both
moments, restored bit for bit by a rollback. The parameter is copied before every step (the
trainer may change it between steps); the moments only when the backup does not hold them
already: after a rollback they are the backup's again, and once the trainer says a step is
final (``Settle``) they are copied in the background, while the trainer runs its next
forward, so the next step's backup copies the parameter alone.
"""

from __future__ import annotations

import dataclasses

import torch

from ._calls import GroupConfig, Kernel
from ._copy import copy_into

__all__ = ["Backup", "Key", "Moments", "NoStepError", "SubGroupBackend", "SubGroupState"]

Key = tuple[int, int]
"""A sub-group: ``(group_id, subgroup_id)``."""

Moments = tuple[torch.Tensor, torch.Tensor]
"""``(exp_avg, exp_avg_sq)``, flat fp32."""


class NoStepError(RuntimeError):
    """A rollback of a sub-group that has no step to undo."""


class SubGroupState:
    """One registered sub-group: its shared param and grad (flat), its moments and step."""

    __slots__ = ("count", "exp_avg", "exp_avg_sq", "grad", "param", "pieces", "step")

    def __init__(
        self, param: torch.Tensor, grad: torch.Tensor, pieces: tuple[tuple[int, int], ...]
    ) -> None:
        self.param = param.view(-1)
        self.grad = grad.view(-1)
        self.pieces = pieces
        self.exp_avg: torch.Tensor | None = None
        self.exp_avg_sq: torch.Tensor | None = None
        self.step = 0
        self.count = torch.zeros((), dtype=torch.float32)  # the step, as torch's kernel takes it

    def moments(self) -> Moments:
        """The moments, zeros before the first step (then kept)."""
        if self.exp_avg is None or self.exp_avg_sq is None:
            self.exp_avg = torch.zeros_like(self.param)
            self.exp_avg_sq = torch.zeros_like(self.param)
        return self.exp_avg, self.exp_avg_sq

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` as the separate tensors laid out in it (see ``Register.pieces``)."""
        return [flat[o : o + n] for o, n in self.pieces] if self.pieces else [flat]


class Backup:
    """Pre-step copy of one sub-group (exact rollback).

    ``valid``: it holds the state before the sub-group's last step (a rollback may use it);
    ``moments``: its moments and step equal the sub-group's current ones (the next
    snapshot need not copy them).
    """

    __slots__ = ("exp_avg", "exp_avg_sq", "moments", "param", "step", "valid")

    def __init__(self, numel: int) -> None:
        self.param = torch.empty(numel, dtype=torch.float32)
        self.exp_avg = torch.empty(numel, dtype=torch.float32)
        self.exp_avg_sq = torch.empty(numel, dtype=torch.float32)
        self.step = 0
        self.valid = False
        self.moments = False


class SubGroupBackend:
    """The sub-groups, the groups' hyper-parameters and the backups of one backend; a
    backend class adds ``step(key)``, ``rollback(key)`` and its kernel state."""

    name = ""

    def __init__(self, groups: tuple[GroupConfig, ...]) -> None:
        self._groups = list(groups)
        self.subgroups: dict[Key, SubGroupState] = {}

    def register(
        self, key: Key, param: torch.Tensor, grad: torch.Tensor, pieces: tuple[tuple[int, int], ...]
    ) -> None:
        """Take sub-group ``key``'s shared tensors (``pieces``: see ``Register``)."""
        self.subgroups[key] = SubGroupState(param, grad, pieces)

    def set_lr(self, group_id: int, lr: float) -> None:
        """The group's learning rate from the next step on."""
        group = self._groups[group_id]
        if group.lr != lr:
            self._groups[group_id] = dataclasses.replace(group, lr=float(lr))

    def groups(self) -> tuple[GroupConfig, ...]:
        """Every group's hyper-parameters as they are now."""
        return tuple(self._groups)

    def set_groups(self, groups: tuple[GroupConfig, ...]) -> None:
        """Replace every group's hyper-parameters."""
        self._groups = list(groups)

    def step(self, key: Key) -> int:
        """One step of sub-group ``key``; its step count after it."""
        raise NotImplementedError

    def rollback(self, key: Key) -> int:
        """Undo sub-group ``key``'s last step algebraically; its step count after it."""
        raise NotImplementedError

    def kernel(self) -> Kernel | None:
        """The kernel's state across calls (``None``: it has none)."""
        return None

    def set_kernel(self, kernel: Kernel | None) -> None:
        """Put the kernel in ``kernel``'s state (nothing to do without one)."""

    def close(self) -> None:
        """Release what the backend holds outside Python (nothing by default)."""

    def export(self, key: Key, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> int:
        """Copy the moments out (zeros before the first step); the step count."""
        state = self.subgroups[key]
        if state.exp_avg is None or state.exp_avg_sq is None:
            exp_avg.zero_()
            exp_avg_sq.zero_()
        else:
            exp_avg.copy_(state.exp_avg)
            exp_avg_sq.copy_(state.exp_avg_sq)
        return state.step

    def load(self, key: Key, step: int, moments: Moments | None) -> None:
        """Take a state: ``step`` and a copy of ``moments`` (none, or step 0: afresh)."""
        state = self.subgroups[key]
        state.step = step
        if step == 0 or moments is None:
            state.exp_avg = state.exp_avg_sq = None
            return
        exp_avg, exp_avg_sq = state.moments()
        exp_avg.copy_(moments[0])
        exp_avg_sq.copy_(moments[1])

    def no_step(self, key: Key) -> NoStepError:
        """The error of a rollback of ``key`` with nothing to undo."""
        return NoStepError(f"cannot roll back sub-group {key[1]} of group {key[0]}: it has no step")

    def snapshot(self, key: Key, backup: Backup) -> None:
        """Copy the state before a step into ``backup`` (the moments unless it has them)."""
        state = self.subgroups[key]
        copy_into(backup.param, state.param)
        if backup.moments:
            return
        backup.step = state.step
        if state.exp_avg is not None and state.exp_avg_sq is not None:
            copy_into(backup.exp_avg, state.exp_avg)
            copy_into(backup.exp_avg_sq, state.exp_avg_sq)

    def keep_moments(self, key: Key, backup: Backup) -> None:
        """The last step is final: copy the moments into ``backup`` ahead of the next step
        (which then copies the parameter alone); nothing is left to roll back."""
        state = self.subgroups[key]
        backup.step = state.step
        if state.exp_avg is not None and state.exp_avg_sq is not None:
            copy_into(backup.exp_avg, state.exp_avg)
            copy_into(backup.exp_avg_sq, state.exp_avg_sq)
        backup.valid, backup.moments = False, True

    def restore(self, key: Key, backup: Backup) -> int:
        """Put ``backup`` back, bit for bit; the step count."""
        state = self.subgroups[key]
        copy_into(state.param, backup.param)
        state.step = backup.step
        if backup.step == 0:
            state.exp_avg = state.exp_avg_sq = None
        else:
            exp_avg, exp_avg_sq = state.moments()
            copy_into(exp_avg, backup.exp_avg)
            copy_into(exp_avg_sq, backup.exp_avg_sq)
        return state.step
