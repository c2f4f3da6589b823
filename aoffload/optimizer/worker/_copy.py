"""Copies of flat CPU tensors without the GIL and without torch's intra-op threads (both sides).

On cores that the trainer's backward and the worker's stepping threads share, a parallel
``copy_`` waits at its barrier for whichever of its threads was preempted; one
``memmove`` on the calling thread does not, and it releases the GIL while it runs.
"""

from __future__ import annotations

import ctypes

import torch

__all__ = ["copy_into"]


def copy_into(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target.copy_(source)``; a plain contiguous CPU source of ``target``'s dtype and size
    is one ``memmove``."""
    if (
        source.device.type == "cpu"
        and target.device.type == "cpu"
        and source.dtype == target.dtype
        and source.layout == torch.strided
        and source.is_contiguous()
        and target.is_contiguous()
        and source.numel() == target.numel()
        and not (source.is_conj() or source.is_neg())
    ):
        ctypes.memmove(target.data_ptr(), source.data_ptr(), source.numel() * source.element_size())
    else:
        target.copy_(source)
