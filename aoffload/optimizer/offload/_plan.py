"""OffloadAdam's bucket plan: which parameters go together to the worker, in which order.

A bucket holds parameters of one param group, one device and one dtype, up to a size in
fp32 bytes, taken in backward order (the reverse of their order in the group: the last
layers' gradients are ready first). Nothing is allocated here (see :mod:`._buckets`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..._errors import OptimizerError
from ._buckets import Bucket, aligned

__all__ = ["plan"]


def plan(
    param_groups: Sequence[dict[str, object]],
    bucket_bytes: int,
    *,
    first_group: int = 0,
    first_param: int = 0,
    first_bucket: int = 0,
) -> list[Bucket]:
    """Lay the parameters of ``param_groups`` out in buckets (nothing is allocated).

    The groups are the optimizer's from ``first_group`` on, whose first parameter is the
    optimizer's parameter ``first_param``; bucket ids start at ``first_bucket``. Parameters
    that do not require a gradient are left out: like ``torch.optim``'s optimizers,
    OffloadAdam never steps a parameter without a gradient.
    """
    buckets: list[Bucket] = []
    index = first_param
    for group_id, group in enumerate(param_groups, start=first_group):
        params = group["params"]
        if not isinstance(params, list):
            raise OptimizerError(f"param group {group_id}: 'params' must be a list")
        numbered = list(enumerate(params, start=index))
        index += len(params)
        open_buckets: dict[tuple[torch.device, torch.dtype], tuple[Bucket, int]] = {}
        for position, param in reversed(numbered):
            if not isinstance(param, torch.Tensor) or not param.requires_grad:
                continue
            _check_param(group_id, param)
            key = (param.device, param.dtype)
            nbytes = 4 * aligned(param.numel())
            current = open_buckets.get(key)
            if current is None or (current[1] and current[1] + nbytes > bucket_bytes):
                bucket = Bucket(first_bucket + len(buckets), group_id, *key)
                buckets.append(bucket)
                current = (bucket, 0)
            bucket, used = current
            bucket.add(param, position)
            open_buckets[key] = (bucket, used + nbytes)
    return buckets


def _check_param(group_id: int, param: torch.Tensor) -> None:
    if not param.is_floating_point():
        raise OptimizerError(f"param group {group_id}: a {param.dtype} parameter cannot be stepped")
    if param.device.type not in ("cpu", "cuda"):
        raise OptimizerError(
            f"param group {group_id}: a parameter on {param.device}: OffloadAdam steps CPU and "
            "CUDA parameters"
        )
    if param.is_sparse or param.numel() == 0:
        raise OptimizerError(f"param group {group_id}: sparse and empty parameters are not stepped")
