"""The ``torch`` backend: AdamW in PyTorch ops with DeepSpeed's conventions.

It runs torch's fused AdamW kernel (what ``torch.optim.AdamW(fused=True)`` runs on the
CPU) over the same tensors as ``torch.optim.AdamW``, so its numbers are bit-identical to
it, and DeepSpeed's math (its bias correction and weight-decay convention) where that
kernel does not apply. Its algebraic rollback is DeepSpeed's, except that second moments
driven below zero by the rollback's rounding are clamped at zero.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch

from ._backend import Key, SubGroupBackend
from ._calls import GroupConfig

__all__ = ["TorchBackend"]

# torch's fused AdamW kernel (what `torch.optim.AdamW(fused=True)` runs on the CPU), if present.
_FUSED_ADAMW: Any = getattr(torch, "_fused_adamw_", None)


class TorchBackend(SubGroupBackend):
    """AdamW in PyTorch ops with DeepSpeed's conventions and its algebraic rollback."""

    name = "torch"

    def __init__(self, groups: tuple[GroupConfig, ...]) -> None:
        super().__init__(groups)
        self._local = threading.local()  # each stepping thread's scratch buffer

    def _scratch(self, numel: int) -> torch.Tensor:
        """This thread's scratch buffer of ``numel`` elements (sub-groups step side by side
        on several threads)."""
        scratch: torch.Tensor | None = getattr(self._local, "scratch", None)
        if scratch is None or scratch.numel() < numel:
            scratch = self._local.scratch = torch.empty(numel, dtype=torch.float32)
        return scratch[:numel]

    @torch.no_grad()
    def step(self, key: Key) -> int:
        """One AdamW step of sub-group ``key``; its step count after it."""
        state = self.subgroups[key]
        group = self._groups[key[0]]
        exp_avg, exp_avg_sq = state.moments()
        state.step += 1
        param, grad, lr = state.param, state.grad, group.lr
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
    def rollback(self, key: Key) -> int:
        """Undo sub-group ``key``'s last step algebraically (``grad`` must still hold its
        gradient); its step count after it."""
        state = self.subgroups[key]
        if state.step <= 0 or state.exp_avg is None or state.exp_avg_sq is None:
            raise self.no_step(key)
        group = self._groups[key[0]]
        param, grad, exp_avg, exp_avg_sq = state.param, state.grad, state.exp_avg, state.exp_avg_sq
        lr, beta1, beta2 = group.lr, group.beta1, group.beta2
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
