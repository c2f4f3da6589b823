"""OffloadAdam's buckets: the model's parameters grouped into the worker's sub-groups.

A bucket holds parameters of one param group, one device and one dtype (laid out by
:mod:`._bucket_plan`). Started, it owns two flat fp32 tensors in shared
memory that the worker maps: the **master** (the parameters' values the worker steps in
place) and the **grad** (what the step reads), with a view of each shaped like every
parameter, each starting on a 64-byte boundary.

**Resident parameters.** An fp32 CPU parameter that is contiguous and alone in its storage
*lives in* the master: at start its ``.data`` becomes its view of the master, so the
worker's step lands in the parameter itself, with no copy back. The worker writes them
from the moment their bucket is sent until the step returns; the step moves their version
counters when it settles (:meth:`Bucket.publish`), so :class:`~aoffload.CheckpointEngine`'s
fence rule sees the change, and the bucket's memory is guarded
(:mod:`aoffload._runtime.gate`) so that a staging copy and the worker's writes never
overlap. When the optimizer closes they get memory of their own again
(:meth:`Bucket.release`).

Their gradients live in the shared grad too, and ``zero_grad()`` keeps ``torch.optim``'s
meaning. A pre-hook on each one's gradient accumulator (:meth:`Bucket.first_grad`) writes
the step's first gradient into the shared grad and hands autograd that view, which it
keeps as ``.grad`` (it owns it alone, so it takes it without a copy); later gradients of
the step (accumulation) are added to it in place. That one write is the least a gradient
can cost to reach the worker: no zeroing, no second copy, no allocation. A gradient
autograd made elsewhere (``create_graph=True``, one set by hand) is copied in by the
post-accumulate hook.

Every other parameter (bf16/fp16, CUDA, a view into a larger storage, a tensor subclass)
is *copied*: the hook copies its gradient into the shared grad, and the bucket
*publishes* the stepped master into it (:meth:`Bucket.publish`, an in-place copy that
moves its version counter) once the step is final, on the step's thread.

A parameter changed outside the optimizer is noticed before its bucket's next step: a
copied one by its version counter or its data pointer, a resident one by its data pointer
(``model.load_state_dict()`` writes a resident parameter's memory in place, which the
master already is); the master takes its value (:meth:`Bucket.resync`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from ..._errors import ClosedError, OptimizerError

__all__ = ["ALIGN", "Bucket", "aligned", "can_reside"]

ALIGN = 16
"""Elements: every parameter's view starts on a 64-byte boundary of the flat buffers."""


def aligned(numel: int) -> int:
    """``numel`` rounded up to :data:`ALIGN`."""
    return -(-numel // ALIGN) * ALIGN


def can_reside(param: torch.Tensor) -> bool:
    """Whether ``param`` can be a view of its bucket's shared master: an fp32 CPU tensor,
    contiguous, alone in its storage, of no tensor subclass."""
    data = param.detach()
    return (
        type(data) is torch.Tensor
        and data.device.type == "cpu"
        and data.dtype == torch.float32
        and data.layout == torch.strided
        and data.is_contiguous()
        and data.storage_offset() == 0
        and data.untyped_storage().nbytes() == 4 * data.numel()
        and not data.is_inference()
    )


def _shared(numel: int) -> torch.Tensor:
    tensor = torch.empty(numel, dtype=torch.float32)
    tensor.share_memory_()  # type: ignore[no-untyped-call]
    return tensor


class Bucket:
    """One sub-group: its parameters, their place in the flat buffers, and this step's state.

    The per-step fields (``arrived``, ``has_grad``, ``norms``, ``submitted``, ``sent``,
    ``due``) are changed under the offloader's lock by the threads that run the backward's
    hooks, and by the step's thread once the backward is over (see :mod:`._grads`).
    """

    __slots__ = (
        "accumulators",
        "arrived",
        "copied_params",
        "copied_views",
        "device",
        "dtype",
        "due",
        "grad",
        "grad_ptrs",
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
        "ptrs",
        "resident",
        "resident_params",
        "sent",
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
        self.grad_ptrs: list[int] = []  # where each parameter's shared gradient is
        self.accumulators: list[object] = []  # resident parameters' gradient accumulators
        self.versions: list[int] = []
        self.ptrs: list[int] = []
        self.resident: list[bool] = []  # each parameter lives in the master (see the module)
        self.resident_params: list[torch.Tensor] = []
        self.copied_params: list[torch.Tensor] = []  # the others, and their master views
        self.copied_views: list[torch.Tensor] = []
        self.link: object = None  # the device link of a CUDA bucket (see _cuda)
        self.arrived: list[bool] = []
        self.has_grad: list[bool] = []
        self.norms: list[torch.Tensor | None] = []
        self.missing = 0
        self.submitted = False
        self.sent: list[tuple[int, int] | None] = []  # each gradient as sent: (where, version)
        self.due = 0  # steps sent this step whose outcome has not come back
        self.lr = 0.0  # the learning rate of this step's submit (a redo uses it again)

    @property
    def numel(self) -> int:
        """Elements of the flat buffers (every view padded to :data:`ALIGN`)."""
        return self.offsets[-1] + aligned(self.params[-1].numel()) if self.params else 0

    def add(self, param: torch.Tensor, index: int) -> None:
        """Lay ``param`` (the optimizer's parameter ``index``) out after the others."""
        self.offsets.append(self.numel)
        self.params.append(param)
        self.indices.append(index)

    # -- life ----------------------------------------------------------------------------

    def allocate(self) -> None:
        """Make the shared master (with the parameters' values) and grad, move the resident
        parameters and their gradients into them; record versions."""
        numel = self.numel
        self.master, self.grad = _shared(numel), _shared(numel)
        self.master.zero_()  # the padding too: every element the worker steps is a number
        self.grad.zero_()
        self.master_views = list(self._views(self.master))
        self.grad_views = list(self._views(self.grad))
        self.grad_ptrs = [view.data_ptr() for view in self.grad_views]
        with torch.no_grad():
            for param, view in zip(self.params, self.master_views, strict=True):
                view.copy_(param.detach())
        cpu = self.device.type == "cpu"
        self.resident = [cpu and can_reside(param) for param in self.params]
        for position, resident in enumerate(self.resident):
            if resident:
                self._move_in(position)
        self._sort()
        self.mark_published()
        self.reset()

    def _move_in(self, position: int) -> None:
        """Make parameter ``position`` a view of the master (its value is there already),
        and a gradient it has a view of the shared grad."""
        param = self.params[position]
        grad = param.grad
        param.data = self.master_views[position]
        if grad is not None:
            if grad.is_sparse:
                raise OptimizerError("OffloadAdam does not support sparse gradients")
            view = self.grad_view(position)
            view.copy_(grad)
            param.grad = view

    def grad_view(self, position: int) -> torch.Tensor:
        """A new view of parameter ``position``'s shared gradient (autograd may take it as
        ``.grad`` without a copy only if nothing else holds it)."""
        if self.grad is None:
            raise ClosedError("OffloadAdam was closed during the backward")
        offset, param = self.offsets[position], self.params[position]
        return self.grad[offset : offset + param.numel()].view(param.shape)

    def _sort(self) -> None:
        self.resident_params = [p for p, r in zip(self.params, self.resident, strict=True) if r]
        copied = [i for i, resident in enumerate(self.resident) if not resident]
        self.copied_params = [self.params[i] for i in copied]
        self.copied_views = [self.master_views[i] for i in copied]

    @property
    def address(self) -> int:
        """Where the master's memory starts (the key of its guard; 0 once released)."""
        return 0 if self.master is None else self.master.untyped_storage().data_ptr()

    def _views(self, flat: torch.Tensor) -> Iterator[torch.Tensor]:
        for param, offset in zip(self.params, self.offsets, strict=True):
            yield flat[offset : offset + param.numel()].view(param.shape)

    def release(self) -> None:
        """Drop the shared buffers (the worker has gone): the resident parameters, and their
        shared gradients, get memory of their own again, with their values."""
        with torch.no_grad():
            for position, resident in enumerate(self.resident):
                param = self.params[position]
                if not resident:
                    continue
                if param.data_ptr() == self.master_views[position].data_ptr():
                    param.data = param.detach().clone()
                grad = param.grad
                if grad is not None and grad.data_ptr() == self.grad_ptrs[position]:
                    param.grad = grad.clone()
        self.master = self.grad = None
        self.master_views, self.grad_views = [], []
        self.resident_params, self.copied_params, self.copied_views = [], [], []
        self.resident = [False] * len(self.params)
        self.grad_ptrs, self.accumulators = [], []
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
        self.sent = [None] * count
        self.due = 0

    def arrive(self, position: int) -> bool:
        """Parameter ``position``'s gradient is in; whether that completes the bucket."""
        if not self.arrived[position]:
            self.arrived[position] = True
            self.has_grad[position] = True
            self.missing -= 1
        return self.missing == 0

    # -- the parameters --------------------------------------------------------------------

    def changed(self) -> list[int]:
        """Positions of parameters changed outside the optimizer since it last published: a
        resident one when its data was re-pointed (in place, it writes the master itself)."""
        return [
            i
            for i, param in enumerate(self.params)
            if param.data_ptr() != self.ptrs[i]
            or (not self.resident[i] and param._version != self.versions[i])
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
                if self.resident[i]:
                    self._move_back(i, value)
                elif not torch.equal(master.to(value.dtype), value):
                    master.copy_(value)
        self.mark_published()

    def _move_back(self, position: int, value: torch.Tensor) -> None:
        """A resident parameter's data was re-pointed (``load_state_dict(assign=True)``,
        ``param.data = ...``): the master takes the value and the parameter lives in it
        again, or, if it no longer can (another dtype), is copied from now on."""
        param = self.params[position]
        self.master_views[position].copy_(value)
        if can_reside(param):
            param.data = self.master_views[position]
            return
        self.resident[position] = False
        grad = param.grad
        if grad is not None and grad.data_ptr() == self.grad_ptrs[position]:
            param.grad = grad.to(param.dtype)
        self._sort()

    def publish(self) -> None:
        """The step is final: copy the stepped master into the copied parameters, and move
        the resident ones' version counters (the worker wrote them); the step's thread."""
        if self.copied_params:
            with torch.no_grad():
                torch._foreach_copy_(self.copied_params, self.copied_views)
        for param in self.resident_params:
            torch.autograd.graph.increment_version(param)
        self.mark_published()

    def mark_published(self) -> None:
        """The parameters hold the master's values now: remember their versions."""
        self.versions = [param._version for param in self.params]
        self.ptrs = [param.data_ptr() for param in self.params]
