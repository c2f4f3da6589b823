"""A bucket's gradients: how they reach the shared grad the worker reads, and whether they
changed after their bucket was sent.

**Intake.** A resident parameter's first gradient of a step is written straight into the
shared grad by a pre-hook on its gradient accumulator (:func:`first_grad`), and autograd
keeps that view as its ``.grad``; any other gradient (a copied parameter's, one set by hand,
one of a CUDA parameter read back) is copied in (:func:`take_grad`, :func:`fill_missing`).

**Changes after the send.** What users do between ``backward()`` and ``step()``
(``clip_grad_norm_``, ``GradScaler.unscale_``, ``p.grad.mul_(...)``, ``p.grad = ...``)
happens after the hooks sent the buckets. So each gradient is recorded as it is sent, by
where it lives and its version counter (:func:`record_sent`, which in-place writes move);
at the step, a bucket whose gradients moved (:func:`changed`) takes them again
(:func:`retake`) and is rolled back and stepped again. Views of one storage share one
version counter: a resident parameter's gradient moves with any write to its bucket's
shared grad, so the unit of change is the bucket, as is the unit of a redo.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch

from ..._errors import OptimizerError
from ..worker._copy import copy_into
from ._buckets import Bucket

__all__ = [
    "changed",
    "compute_norms",
    "fill_missing",
    "first_grad",
    "let_go",
    "record_sent",
    "retake",
    "scale_grads",
    "take_grad",
    "unscale",
]


def first_grad(bucket: Bucket, position: int, grad: torch.Tensor) -> torch.Tensor | None:
    """A gradient accumulator's pre-hook (the backward's thread): a resident parameter with
    no ``.grad`` gets this gradient written into the shared grad, and that view instead
    (autograd keeps it as ``.grad``). ``None``: leave the gradient alone (an accumulation, a
    layout the view cannot take, a bucket already sent: then a shared ``.grad`` is let go, so
    that the late gradient cannot change what the worker reads)."""
    param = bucket.params[position]
    current = param.grad
    if bucket.submitted:
        if current is not None and current.data_ptr() == bucket.grad_ptrs[position]:
            param.grad = None  # a late gradient must not change what the worker reads
        return None
    if (
        not bucket.resident[position]
        or current is not None
        or grad.layout != torch.strided
        or not grad.is_contiguous()
    ):
        return None
    view = bucket.grad_view(position)
    copy_into(view, grad)
    return view


def take_grad(bucket: Bucket, position: int, grad: torch.Tensor) -> None:
    """Have a parameter's gradient in the shared grad (fp32), on this thread: a resident
    parameter's usually is already (see :func:`first_grad`), else a copy (from the device,
    blocking, for a CUDA gradient)."""
    if grad.data_ptr() == bucket.grad_ptrs[position]:
        return
    if grad.is_sparse:
        raise OptimizerError("OffloadAdam does not support sparse gradients")
    copy_into(bucket.grad_views[position], grad.detach())


def fill_missing(bucket: Bucket) -> None:
    """Take the gradients no hook delivered (set by hand, or none: zeros)."""
    for position, param in enumerate(bucket.params):
        if bucket.arrived[position]:
            continue
        grad = param.grad
        if grad is None:
            bucket.grad_views[position].zero_()  # stepped with a zero gradient
        else:
            take_grad(bucket, position, grad)
            bucket.has_grad[position] = True
        bucket.arrived[position] = True
    bucket.missing = 0


def let_go(bucket: Bucket) -> None:
    """Set the shared gradients of resident parameters to ``None`` (``zero_grad`` while the
    worker may read them: they must not be zeroed under it)."""
    for position, param in enumerate(bucket.params):
        grad = param.grad
        if grad is not None and grad.data_ptr() == bucket.grad_ptrs[position]:
            param.grad = None


def compute_norms(bucket: Bucket) -> None:
    """Each delivered gradient's 2-norm, as ``clip_grad_norm_`` computes it."""
    present = [i for i, has in enumerate(bucket.has_grad) if has]
    bucket.norms = [None] * len(bucket.params)
    if not present:
        return
    norms = torch._foreach_norm([bucket.grad_views[i] for i in present], 2.0)
    for i, norm in zip(present, norms, strict=True):
        bucket.norms[i] = norm


def scale_grads(bucket: Bucket, coefficient: torch.Tensor) -> None:
    """Multiply the gradients by ``coefficient``, as ``clip_grads_with_norm_`` does."""
    torch._foreach_mul_(bucket.grad_views, coefficient)


def _now(param: torch.Tensor) -> tuple[int, int] | None:
    grad = param.grad
    return None if grad is None else (grad.data_ptr(), grad._version)


def record_sent(bucket: Bucket) -> None:
    """Remember every gradient as the bucket is sent: where it lives, its version."""
    bucket.sent = [_now(param) for param in bucket.params]


def changed(bucket: Bucket) -> bool:
    """Whether a gradient of the bucket was written, replaced or dropped since it was sent."""
    return any(_now(param) != sent for param, sent in zip(bucket.params, bucket.sent, strict=True))


def retake(bucket: Bucket, norms: bool) -> None:
    """Take every gradient of the bucket again, as it is now (a missing one: zeros), and
    their norms if ``norms``; on the step's thread."""
    for position, param in enumerate(bucket.params):
        grad = param.grad
        if grad is None:
            bucket.grad_views[position].zero_()
        else:
            take_grad(bucket, position, grad)
        bucket.has_grad[position] = grad is not None
    if norms:
        compute_norms(bucket)
    record_sent(bucket)


def unscale(params: Iterable[torch.Tensor], grad_scale: torch.Tensor) -> None:
    """Divide every gradient by ``grad_scale`` in place, as ``torch.optim.AdamW(fused=True)``'s
    kernel does when ``GradScaler.step`` hands it the scale (bit for bit the same quotient)."""
    grouped: defaultdict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for param in params:
        grad = param.grad
        if grad is not None:
            grouped[grad.device, grad.dtype].append(grad)
    with torch.no_grad():
        for (device, _), grads in grouped.items():
            torch._foreach_div_(grads, grad_scale.to(device))
