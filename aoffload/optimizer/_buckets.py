"""OffloadAdam's buckets: the model's parameters grouped into the worker's sub-groups.

A bucket holds parameters of one param group, one device and one dtype, up to a size in
fp32 bytes, taken in backward order (the reverse of their order in the group: the last
layers' gradients are ready first). Started, it owns two flat fp32 tensors in shared
memory that the worker maps: the **master** (the parameters' values the worker steps in
place) and the **grad** (what the step reads), with a view of each shaped like every
parameter, each starting on a 64-byte boundary.

The model's own parameters are never written by the worker: a bucket *publishes* its
master into them (:meth:`Bucket.publish`, an in-place copy that moves their version
counters) once the step is final, on the thread that runs ``step()``/``astep()``. So the
model changes only inside the step, as with any ``torch.optim`` optimizer, speculative
values are never seen, and :class:`~aoffload.CheckpointEngine`'s fence rule and its
version check apply to the parameters unchanged.

A parameter changed outside the optimizer (``model.load_state_dict()``, an in-place
initialisation, a re-pointed ``.data``) is noticed by its version counter or its data
pointer before its bucket's next step, and the master takes its value (:meth:`Bucket.resync`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from .._errors import OptimizerError

__all__ = ["ALIGN", "Bucket", "plan"]

ALIGN = 16
"""Elements: every parameter's view starts on a 64-byte boundary of the flat buffers."""


def _aligned(numel: int) -> int:
    return -(-numel // ALIGN) * ALIGN


def _shared(numel: int) -> torch.Tensor:
    tensor = torch.empty(numel, dtype=torch.float32)
    tensor.share_memory_()  # type: ignore[no-untyped-call]
    return tensor


class Bucket:
    """One sub-group: its parameters, their place in the flat buffers, and this step's state.

    The per-step fields (``arrived``, ``has_grad``, ``norms``, ``submitted``, ``phase``) are
    changed under the offloader's lock by the threads that run the backward's hooks, and by
    the step's thread once the backward is over.
    """

    __slots__ = (
        "arrived",
        "device",
        "dtype",
        "grad",
        "grad_views",
        "group_id",
        "has_grad",
        "index",
        "indices",
        "link",
        "lr",
        "master",
        "master_views",
        "missing",
        "norms",
        "offsets",
        "params",
        "phase",
        "ptrs",
        "submitted",
        "versions",
    )

    def __init__(self, index: int, group_id: int, device: torch.device, dtype: torch.dtype) -> None:
        self.index = index  # the sub-group id
        self.group_id = group_id
        self.device = device
        self.dtype = dtype
        self.params: list[torch.Tensor] = []
        self.indices: list[int] = []  # each parameter's index in the optimizer's order
        self.offsets: list[int] = []
        self.master: torch.Tensor | None = None
        self.grad: torch.Tensor | None = None
        self.master_views: list[torch.Tensor] = []
        self.grad_views: list[torch.Tensor] = []
        self.versions: list[int] = []
        self.ptrs: list[int] = []
        self.link: object = None  # the device link of a CUDA bucket (see _cuda)
        self.arrived: list[bool] = []
        self.has_grad: list[bool] = []
        self.norms: list[torch.Tensor | None] = []
        self.missing = 0
        self.submitted = False
        self.phase = 0
        self.lr = 0.0  # the learning rate of this step's submit (a redo uses it again)

    @property
    def numel(self) -> int:
        """Elements of the flat buffers (every view padded to :data:`ALIGN`)."""
        return self.offsets[-1] + _aligned(self.params[-1].numel()) if self.params else 0

    def add(self, param: torch.Tensor, index: int) -> None:
        """Lay ``param`` (the optimizer's parameter ``index``) out after the others."""
        self.offsets.append(self.numel)
        self.params.append(param)
        self.indices.append(index)

    # -- life ----------------------------------------------------------------------------

    def allocate(self) -> None:
        """Make the shared master (with the parameters' values) and grad; record versions."""
        numel = self.numel
        self.master, self.grad = _shared(numel), _shared(numel)
        self.master.zero_()  # the padding too: every element the worker steps is a number
        self.grad.zero_()
        self.master_views = list(self._views(self.master))
        self.grad_views = list(self._views(self.grad))
        with torch.no_grad():
            for param, view in zip(self.params, self.master_views, strict=True):
                view.copy_(param.detach())
        self.mark_published()
        self.reset()

    def _views(self, flat: torch.Tensor) -> Iterator[torch.Tensor]:
        for param, offset in zip(self.params, self.offsets, strict=True):
            yield flat[offset : offset + param.numel()].view(param.shape)

    def release(self) -> None:
        """Drop the shared buffers (the worker has gone)."""
        self.master = self.grad = None
        self.master_views, self.grad_views = [], []
        self.link = None

    # -- a step --------------------------------------------------------------------------

    def reset(self) -> None:
        """Ready for the next step: no gradient arrived, nothing submitted."""
        count = len(self.params)
        self.arrived = [False] * count
        self.has_grad = [False] * count
        self.norms = [None] * count
        self.missing = count
        self.submitted = False
        self.phase = 0

    def arrive(self, position: int) -> bool:
        """Parameter ``position``'s gradient is in; whether that completes the bucket."""
        if not self.arrived[position]:
            self.arrived[position] = True
            self.has_grad[position] = True
            self.missing -= 1
        return self.missing == 0

    def take_grad(self, position: int, grad: torch.Tensor) -> None:
        """Copy a CPU parameter's gradient into the shared grad (fp32) on this thread."""
        if grad.is_sparse:
            raise OptimizerError("OffloadAdam does not support sparse gradients")
        self.grad_views[position].copy_(grad)

    def fill_missing(self) -> None:
        """Take the gradients no hook delivered (set by hand, or none: zeros) for a CPU bucket."""
        for position, param in enumerate(self.params):
            if self.arrived[position]:
                continue
            grad = param.grad
            if grad is None:
                self.grad_views[position].zero_()  # stepped with a zero gradient
            else:
                self.take_grad(position, grad)
                self.has_grad[position] = True
            self.arrived[position] = True
        self.missing = 0

    def compute_norms(self) -> None:
        """Each delivered gradient's 2-norm, as ``clip_grad_norm_`` computes it."""
        present = [i for i, has in enumerate(self.has_grad) if has]
        if not present:
            return
        norms = torch._foreach_norm([self.grad_views[i] for i in present], 2.0)
        for i, norm in zip(present, norms, strict=True):
            self.norms[i] = norm

    def scale_grads(self, coefficient: torch.Tensor) -> None:
        """Multiply the gradients by ``coefficient``, as ``clip_grads_with_norm_`` does."""
        torch._foreach_mul_(self.grad_views, coefficient)

    # -- the parameters --------------------------------------------------------------------

    def changed(self) -> list[int]:
        """Positions of parameters changed outside the optimizer since it last published."""
        return [
            i
            for i, param in enumerate(self.params)
            if param._version != self.versions[i] or param.data_ptr() != self.ptrs[i]
        ]

    def resync(self, values: Sequence[torch.Tensor] | None = None) -> None:
        """Let the master take the value of every parameter changed outside the optimizer.

        A master whose value, rounded to the parameter's dtype, is the parameter's keeps
        its precision (an fp32 master of a bf16 model reloaded from the same checkpoint).
        ``values`` are the changed parameters as CPU tensors (a CUDA bucket reads them).
        """
        changed = self.changed()
        if not changed:
            return
        with torch.no_grad():
            for n, i in enumerate(changed):
                value = self.params[i].detach() if values is None else values[n]
                master = self.master_views[i]
                if value.shape != master.shape:
                    raise OptimizerError(
                        f"parameter {self.indices[i]} changed shape from {tuple(master.shape)} "
                        f"to {tuple(value.shape)}: an optimizer's parameters keep their shape"
                    )
                if not torch.equal(master.to(value.dtype), value):
                    master.copy_(value)
        self.mark_published()

    def publish(self) -> None:
        """Copy the stepped master into the model's CPU parameters (on the step's thread)."""
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.master_views)
        self.mark_published()

    def mark_published(self) -> None:
        """The parameters hold the master's values now: remember their versions."""
        self.versions = [param._version for param in self.params]
        self.ptrs = [param.data_ptr() for param in self.params]


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
            nbytes = 4 * _aligned(param.numel())
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
