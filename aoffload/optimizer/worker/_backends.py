"""The optimizer worker's two backends, both stepping one sub-group at a time.

* ``deepspeed``: DeepSpeed's CPU Adam op (loaded by :mod:`._deepspeed_op`) driven with the
  very calls of ``DeepSpeedCPUAdam``'s ``step_subgroup`` / ``rollback_subgroup``, as
  DeepSpeed's own SuperOffload worker drives it, so its numbers are bit-identical to DeepSpeed's;
* ``torch``: the same math (AdamW with DeepSpeed's bias correction and weight-decay
  convention) and the same algebraic rollback in PyTorch ops, except that second
  moments driven below zero by the rollback's rounding are clamped at zero.

Both export and import a sub-group's state in one layout (step count, flat ``exp_avg``
and ``exp_avg_sq``), so a state saved on one backend loads into the other. DeepSpeed's
op also carries a bias-correction state across calls (see :class:`DeepSpeedBackend`):
it is tracked, exported and replayed so that a resumed run takes bit-identical steps.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
from typing import Any

import numpy as np
import torch

from ._calls import GroupConfig, Kernel
from ._deepspeed_op import load_cpu_adam

__all__ = ["Backup", "DeepSpeedBackend", "NoStepError", "TorchBackend"]


class NoStepError(RuntimeError):
    """A rollback of a sub-group that has no step to undo."""


# torch's fused AdamW kernel (what `torch.optim.AdamW(fused=True)` runs on the CPU), if present.
_FUSED_ADAMW: Any = getattr(torch, "_fused_adamw_", None)


class _Moments:
    """Optimizer state of one sub-group in the torch backend."""

    __slots__ = ("count", "exp_avg", "exp_avg_sq", "grad", "param", "pieces", "step")

    def __init__(
        self, param: torch.Tensor, grad: torch.Tensor, pieces: tuple[tuple[int, int], ...]
    ) -> None:
        self.param = param
        self.grad = grad
        self.pieces = pieces
        self.exp_avg: torch.Tensor | None = None
        self.exp_avg_sq: torch.Tensor | None = None
        self.step = 0
        self.count = torch.zeros((), dtype=torch.float32)  # the step, as the kernel takes it

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` as the separate tensors laid out in it (see ``Register.pieces``)."""
        return [flat[o : o + n] for o, n in self.pieces] if self.pieces else [flat]


class Backup:
    """Pre-step copy of one sub-group (exact rollback)."""

    __slots__ = ("exp_avg", "exp_avg_sq", "param", "step", "valid")

    def __init__(self, numel: int) -> None:
        self.param = torch.empty(numel, dtype=torch.float32)
        self.exp_avg = torch.empty(numel, dtype=torch.float32)
        self.exp_avg_sq = torch.empty(numel, dtype=torch.float32)
        self.step = 0
        self.valid = False


class TorchBackend:
    """AdamW in PyTorch ops with DeepSpeed's conventions and its algebraic rollback."""

    name = "torch"

    def __init__(self, groups: tuple[GroupConfig, ...]) -> None:
        self._lr = [group.lr for group in groups]
        self._groups = groups
        self._subgroups: dict[tuple[int, int], _Moments] = {}
        self._local = threading.local()  # each stepping thread's scratch buffer

    def register(
        self,
        group_id: int,
        subgroup_id: int,
        param: torch.Tensor,
        grad: torch.Tensor,
        pieces: tuple[tuple[int, int], ...] = (),
    ) -> None:
        self._subgroups[group_id, subgroup_id] = _Moments(param.view(-1), grad.view(-1), pieces)

    def _scratch(self, numel: int) -> torch.Tensor:
        """This thread's scratch buffer of ``numel`` elements (sub-groups step side by side
        on several threads)."""
        scratch: torch.Tensor | None = getattr(self._local, "scratch", None)
        if scratch is None or scratch.numel() < numel:
            scratch = self._local.scratch = torch.empty(numel, dtype=torch.float32)
        return scratch[:numel]

    def set_lr(self, group_id: int, lr: float) -> None:
        self._lr[group_id] = lr

    def groups(self) -> tuple[GroupConfig, ...]:
        return tuple(
            dataclasses.replace(g, lr=lr) for g, lr in zip(self._groups, self._lr, strict=True)
        )

    def set_groups(self, groups: tuple[GroupConfig, ...]) -> None:
        self._groups = groups
        self._lr = [group.lr for group in groups]

    def kernel(self) -> Kernel | None:
        return None  # the torch math has no state across calls

    def set_kernel(self, kernel: Kernel | None) -> None:
        return None

    def export(
        self, group_id: int, subgroup_id: int, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor
    ) -> int:
        state = self._subgroups[group_id, subgroup_id]
        if state.exp_avg is None or state.exp_avg_sq is None:
            exp_avg.zero_()
            exp_avg_sq.zero_()
        else:
            exp_avg.copy_(state.exp_avg)
            exp_avg_sq.copy_(state.exp_avg_sq)
        return state.step

    def load(
        self,
        group_id: int,
        subgroup_id: int,
        step: int,
        exp_avg: torch.Tensor | None,
        exp_avg_sq: torch.Tensor | None,
    ) -> None:
        state = self._subgroups[group_id, subgroup_id]
        state.step = step
        if step == 0 or exp_avg is None or exp_avg_sq is None:
            state.exp_avg = state.exp_avg_sq = None
            return
        if state.exp_avg is None or state.exp_avg_sq is None:
            state.exp_avg = torch.empty_like(state.param)
            state.exp_avg_sq = torch.empty_like(state.param)
        state.exp_avg.copy_(exp_avg)
        state.exp_avg_sq.copy_(exp_avg_sq)

    @torch.no_grad()
    def step(self, group_id: int, subgroup_id: int) -> int:
        state = self._subgroups[group_id, subgroup_id]
        group, lr = self._groups[group_id], self._lr[group_id]
        if state.exp_avg is None or state.exp_avg_sq is None:
            state.exp_avg = torch.zeros_like(state.param)
            state.exp_avg_sq = torch.zeros_like(state.param)
        state.step += 1
        param, grad, exp_avg, exp_avg_sq = state.param, state.grad, state.exp_avg, state.exp_avg_sq
        beta1, beta2 = group.beta1, group.beta2
        if _FUSED_ADAMW is not None and group.bias_correction:
            # One pass over memory instead of six: torch's fused AdamW kernel, same formula,
            # over the same tensors as torch.optim.AdamW(fused=True) (its vectorised loop and
            # scalar tail round differently: the pieces keep the results bit-identical).
            state.count.fill_(state.step)
            split = state.split
            _FUSED_ADAMW(
                split(param), split(grad), split(exp_avg), split(exp_avg_sq), [],
                [state.count] * max(1, len(state.pieces)),
                lr=lr, beta1=beta1, beta2=beta2, weight_decay=group.weight_decay,
                eps=group.eps, amsgrad=False, maximize=False,
            )  # fmt: skip
            return state.step
        bias1, bias2 = 1.0, 1.0
        if group.bias_correction:
            bias1 = 1.0 - beta1**state.step
            bias2 = 1.0 / math.sqrt(1.0 - beta2**state.step)
        exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        denom = self._scratch(param.numel())
        torch.sqrt(exp_avg_sq, out=denom)
        denom.mul_(bias2).add_(group.eps)
        if group.weight_decay > 0:
            param.mul_(1.0 - lr * group.weight_decay)
        param.addcdiv_(exp_avg, denom, value=-lr / bias1)
        return state.step

    @torch.no_grad()
    def rollback(self, group_id: int, subgroup_id: int) -> int:
        state = self._subgroups[group_id, subgroup_id]
        if state.step <= 0 or state.exp_avg is None or state.exp_avg_sq is None:
            raise NoStepError(
                f"cannot roll back sub-group {subgroup_id} of group {group_id}: it has no step"
            )
        group, lr = self._groups[group_id], self._lr[group_id]
        param, grad, exp_avg, exp_avg_sq = state.param, state.grad, state.exp_avg, state.exp_avg_sq
        beta1, beta2 = group.beta1, group.beta2
        # As DeepSpeed's adam_rollback: bias correction always applies, whatever the group says.
        bias1 = 1.0 - beta1**state.step
        bias2 = 1.0 - beta2**state.step
        denom = self._scratch(param.numel())
        torch.div(exp_avg_sq, bias2, out=denom)
        denom.sqrt_().add_(group.eps)
        param.addcdiv_(exp_avg, denom, value=lr / bias1)
        param.div_(1.0 - lr * group.weight_decay)
        param.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        exp_avg.sub_(grad, alpha=1.0 - beta1).div_(beta1)
        exp_avg_sq.addcmul_(grad, grad, value=-(1.0 - beta2)).div_(beta2)
        # Rounding can leave a few second moments slightly negative; a later sqrt would
        # turn them into NaN. DeepSpeed keeps them; this backend clamps them at zero.
        exp_avg_sq.clamp_(min=0.0)
        state.step -= 1
        return state.step

    def snapshot(self, group_id: int, subgroup_id: int, backup: Backup) -> None:
        state = self._subgroups[group_id, subgroup_id]
        backup.param.copy_(state.param)
        backup.step = state.step
        if state.exp_avg is not None and state.exp_avg_sq is not None:
            backup.exp_avg.copy_(state.exp_avg)
            backup.exp_avg_sq.copy_(state.exp_avg_sq)

    def restore(self, group_id: int, subgroup_id: int, backup: Backup) -> int:
        state = self._subgroups[group_id, subgroup_id]
        state.param.copy_(backup.param)
        state.step = backup.step
        if backup.step == 0:
            state.exp_avg = state.exp_avg_sq = None
        elif state.exp_avg is not None and state.exp_avg_sq is not None:
            state.exp_avg.copy_(backup.exp_avg)
            state.exp_avg_sq.copy_(backup.exp_avg_sq)
        return state.step


def _f32(value: float) -> float:
    return float(np.float32(value))


class _OpState:
    """Optimizer state of one sub-group in the deepspeed backend (``DeepSpeedCPUAdam``'s)."""

    __slots__ = ("exp_avg", "exp_avg_sq", "step")

    def __init__(self, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int) -> None:
        self.exp_avg = exp_avg
        self.exp_avg_sq = exp_avg_sq
        self.step = step


_FIRST_OP_ID = 1 << 30  # ids DeepSpeedCPUAdam's own counter (from 0) does not reach
_op_ids = itertools.count(_FIRST_OP_ID)


class DeepSpeedBackend:
    """DeepSpeed's CPU Adam op, driven with exactly the calls of ``DeepSpeedCPUAdam``.

    The op comes from :func:`._deepspeed_op.load_cpu_adam` (its build, or DeepSpeed). It is
    created as ``DeepSpeedCPUAdam.__init__`` creates it (AdamW mode, the first group's
    hyper-parameters, DeepSpeed's default log level) and stepped and rolled back as its
    ``step_subgroup`` and ``rollback_subgroup`` do (state initialised with zeros, the step
    count incremented before ``adam_update`` and decremented after ``adam_rollback``), so
    its numbers are bit-identical to DeepSpeed's own SuperOffload worker's.

    DeepSpeed's C++ op keeps ``beta**step`` across calls: a step number one above the
    previous call's multiplies it by ``beta``, the same number keeps it, anything else
    (or other betas) recomputes it with ``pow``. The product and ``pow`` can differ in
    the last bit, so the next step depends on that history. :attr:`_kernel` mirrors it
    as ``(anchor, step, beta1, beta2)``; :meth:`set_kernel` replays it into the op.
    """

    name = "deepspeed"

    def __init__(self, groups: tuple[GroupConfig, ...]) -> None:
        self.op = load_cpu_adam()
        self._ops: Any = self.op.module
        self._id = next(_op_ids)
        first = groups[0]
        # DeepSpeedCPUAdam: create_adam(id, lr, beta1, beta2, eps, weight_decay, adamw_mode,
        # should_log_le("info")); DeepSpeed's logger is at WARNING unless the process set it.
        self._ops.create_adam(
            self._id, first.lr, first.beta1, first.beta2, first.eps, first.weight_decay,
            True, False,
        )  # fmt: skip
        self._groups = list(groups)
        self._params: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._states: dict[tuple[int, int], _OpState] = {}
        self._kernel: Kernel = (0, 0, _f32(first.beta1), _f32(first.beta2))  # a new op's state

    def close(self) -> None:
        """Destroy the op's optimizer (``DeepSpeedCPUAdam.__del__`` does the same)."""
        self._ops.destroy_adam(self._id)

    def register(
        self,
        group_id: int,
        subgroup_id: int,
        param: torch.Tensor,
        grad: torch.Tensor,
        pieces: tuple[tuple[int, int], ...] = (),
    ) -> None:
        self._params[group_id, subgroup_id] = (param, grad)  # one tensor: pieces unused

    def set_lr(self, group_id: int, lr: float) -> None:
        self._groups[group_id] = dataclasses.replace(self._groups[group_id], lr=float(lr))

    def groups(self) -> tuple[GroupConfig, ...]:
        return tuple(self._groups)

    def set_groups(self, groups: tuple[GroupConfig, ...]) -> None:
        self._groups = list(groups)

    def kernel(self) -> Kernel | None:
        return self._kernel

    def _advance(self, step: int, beta1: float, beta2: float) -> None:
        # Mirrors Adam_Optimizer::IncrementStep (deepspeed/ops/csrc/includes/cpu_adam.h).
        anchor, current, b1, b2 = self._kernel
        beta1, beta2 = _f32(beta1), _f32(beta2)
        if (beta1, beta2) != (b1, b2) or step not in (current, current + 1):
            self._kernel = (step, step, beta1, beta2)
        else:
            self._kernel = (anchor, step, b1, b2)

    def set_kernel(self, kernel: Kernel | None) -> None:
        """Drive the op into ``kernel``'s state with calls on a one-element scratch tensor."""
        if kernel is None:
            return
        anchor, step, beta1, beta2 = kernel
        scratch = [torch.zeros(1) for _ in range(4)]
        # Other betas force the pow branch twice: once away, once onto beta**anchor...
        calls = [(1, beta1 / 2, beta2 / 2), (anchor, beta1, beta2)]
        # ...then one multiplication per step, as the saved op did.
        calls += [(s, beta1, beta2) for s in range(anchor + 1, step + 1)]
        for s, b1, b2 in calls:
            self._ops.adam_update(self._id, s, 0.0, b1, b2, 1e-8, 0.0, True, *scratch)
        self._kernel = (anchor, step, _f32(beta1), _f32(beta2))

    def _call(self, name: str, group_id: int, subgroup_id: int, state: _OpState) -> None:
        param, grad = self._params[group_id, subgroup_id]
        g = self._groups[group_id]
        getattr(self._ops, name)(
            self._id, state.step, g.lr, g.beta1, g.beta2, g.eps, g.weight_decay,
            g.bias_correction, param, grad, state.exp_avg, state.exp_avg_sq,
        )  # fmt: skip

    def step(self, group_id: int, subgroup_id: int) -> int:
        state = self._states.get((group_id, subgroup_id))
        if state is None:
            param = self._params[group_id, subgroup_id][0]
            zeros = torch.zeros_like(param, dtype=torch.float32)
            state = self._states[group_id, subgroup_id] = _OpState(zeros, zeros.clone(), 0)
        state.step += 1
        self._call("adam_update", group_id, subgroup_id, state)
        group = self._groups[group_id]
        self._advance(state.step, group.beta1, group.beta2)
        return state.step

    def rollback(self, group_id: int, subgroup_id: int) -> int:
        state = self._states.get((group_id, subgroup_id))
        if state is None or state.step <= 0:
            raise NoStepError(
                f"cannot roll back sub-group {subgroup_id} of group {group_id}: it has no step"
            )
        self._call("adam_rollback", group_id, subgroup_id, state)
        state.step -= 1
        return state.step

    def export(
        self, group_id: int, subgroup_id: int, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor
    ) -> int:
        state = self._states.get((group_id, subgroup_id))
        if state is None:
            exp_avg.zero_()
            exp_avg_sq.zero_()
            return 0
        exp_avg.copy_(state.exp_avg.view(-1))
        exp_avg_sq.copy_(state.exp_avg_sq.view(-1))
        return state.step

    def load(
        self,
        group_id: int,
        subgroup_id: int,
        step: int,
        exp_avg: torch.Tensor | None,
        exp_avg_sq: torch.Tensor | None,
    ) -> None:
        key = (group_id, subgroup_id)
        if step == 0 or exp_avg is None or exp_avg_sq is None:
            self._states.pop(key, None)
            return
        state = self._states.get(key)
        if state is None:
            param = self._params[key][0]
            state = _OpState(torch.empty_like(param), torch.empty_like(param), step)
            self._states[key] = state
        state.exp_avg.view(-1).copy_(exp_avg)
        state.exp_avg_sq.view(-1).copy_(exp_avg_sq)
        state.step = step

    def snapshot(self, group_id: int, subgroup_id: int, backup: Backup) -> None:
        backup.param.copy_(self._params[group_id, subgroup_id][0].view(-1))
        state = self._states.get((group_id, subgroup_id))
        backup.step = state.step if state is not None else 0
        if state is not None:
            backup.exp_avg.copy_(state.exp_avg.view(-1))
            backup.exp_avg_sq.copy_(state.exp_avg_sq.view(-1))

    def restore(self, group_id: int, subgroup_id: int, backup: Backup) -> int:
        key = (group_id, subgroup_id)
        self._params[key][0].view(-1).copy_(backup.param)
        if backup.step == 0:
            self._states.pop(key, None)
            return 0
        state = self._states[key]
        state.exp_avg.view(-1).copy_(backup.exp_avg)
        state.exp_avg_sq.view(-1).copy_(backup.exp_avg_sq)
        state.step = backup.step
        return backup.step
