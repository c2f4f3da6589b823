"""The ``deepspeed`` backend: DeepSpeed's CPU Adam op, driven with ``DeepSpeedCPUAdam``'s calls.

The op is loaded by :mod:`._deepspeed_op` and driven with the very calls of
``DeepSpeedCPUAdam``'s ``step_subgroup`` / ``rollback_subgroup``, as DeepSpeed's own
SuperOffload worker drives it, so its numbers are bit-identical to DeepSpeed's. Its op
carries a bias-correction state across calls (see :class:`DeepSpeedBackend`): it is
tracked, exported and replayed so that a resumed run takes bit-identical steps.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch

from ._backend import Key, SubGroupBackend, SubGroupState
from ._calls import GroupConfig, Kernel
from ._deepspeed_op import load_cpu_adam

__all__ = ["DeepSpeedBackend"]


def _f32(value: float) -> float:
    return float(np.float32(value))


_FIRST_OP_ID = 1 << 30  # ids DeepSpeedCPUAdam's own counter (from 0) does not reach
_op_ids = itertools.count(_FIRST_OP_ID)


class DeepSpeedBackend(SubGroupBackend):
    """DeepSpeed's CPU Adam op, driven with exactly the calls of ``DeepSpeedCPUAdam``.

    The op comes from :func:`._deepspeed_op.load_cpu_adam` (its build, or DeepSpeed, which
    builds it with ``build``). It is
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

    def __init__(self, groups: tuple[GroupConfig, ...], *, build: bool) -> None:
        super().__init__(groups)
        self.op = load_cpu_adam(build=build)  # without build: OpUnavailable, or the op
        self._ops: Any = self.op.module
        self._id = next(_op_ids)
        first = groups[0]
        # DeepSpeedCPUAdam: create_adam(id, lr, beta1, beta2, eps, weight_decay, adamw_mode,
        # should_log_le("info")); DeepSpeed's logger is at WARNING unless the process set it.
        self._ops.create_adam(
            self._id, first.lr, first.beta1, first.beta2, first.eps, first.weight_decay,
            True, False,
        )  # fmt: skip
        self._kernel: Kernel = (0, 0, _f32(first.beta1), _f32(first.beta2))  # a new op's state

    def close(self) -> None:
        """Destroy the op's optimizer (``DeepSpeedCPUAdam.__del__`` does the same)."""
        self._ops.destroy_adam(self._id)

    def kernel(self) -> Kernel | None:
        """The op's bias-correction state, as :meth:`_advance` mirrors it."""
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

    def _call(self, name: str, key: Key, state: SubGroupState) -> None:
        g = self._groups[key[0]]
        exp_avg, exp_avg_sq = state.moments()  # zeros before the first step, as DeepSpeed's
        getattr(self._ops, name)(
            self._id, state.step, g.lr, g.beta1, g.beta2, g.eps, g.weight_decay,
            g.bias_correction, state.param, state.grad, exp_avg, exp_avg_sq,
        )  # fmt: skip

    def step(self, key: Key) -> int:
        """``DeepSpeedCPUAdam.step_subgroup``'s calls; the step count after it."""
        state = self.subgroups[key]
        state.step += 1
        self._call("adam_update", key, state)
        group = self._groups[key[0]]
        self._advance(state.step, group.beta1, group.beta2)
        return state.step

    def rollback(self, key: Key) -> int:
        """``DeepSpeedCPUAdam.rollback_subgroup``'s calls; the step count after it."""
        state = self.subgroups[key]
        if state.step <= 0 or state.exp_avg is None:
            raise self.no_step(key)
        self._call("adam_rollback", key, state)
        state.step -= 1
        return state.step
