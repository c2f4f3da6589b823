"""OffloadAdam's machinery without a face: buckets, hooks, submits, hyper-parameters.

:class:`Offloader` owns the worker (an :class:`~._core.OptimizerCore`), the buckets and
the parameters' post-accumulate-grad hooks. It needs no event loop and is thread-safe
where it must be: hooks run on whatever thread runs the backward (the caller's for CPU
parameters, autograd's device threads for CUDA ones) and submit a bucket the moment its
last gradient is in, on that thread; the step itself (:mod:`._offload_step`) runs on the
thread that calls ``step()`` or ``astep()``. A hook never raises into autograd: what goes
wrong is recorded and raised by the step.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..._errors import ClosedError, OptimizerError
from ..._runtime.gate import GATE
from .._core import OptimizerCore
from ..worker._calls import GroupConfig
from ._buckets import Bucket
from ._plan import plan
from ._state import Loaded, config_of

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from ._cuda import CudaLinks

__all__ = ["Offloader"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Options:
    """OffloadAdam's options past the hyper-parameters (validated by the face)."""

    backend: str
    bucket_bytes: int
    max_grad_norm: float | None
    skip_nonfinite: bool
    worker_cores: float | None
    start_timeout: float
    close_timeout: float

    @property
    def speculative(self) -> bool:
        """Whether a step can be invalidated after it ran (and must be exactly undoable)."""
        return self.max_grad_norm is not None or self.skip_nonfinite


_Key = tuple[object, ...]


def _group_key(group: dict[str, Any]) -> _Key | None:
    """A param group's hyper-parameters as comparable values (``None``: a tensor ``lr``,
    which a scheduler may change in place)."""
    lr = group.get("lr")
    if isinstance(lr, torch.Tensor):
        return None
    betas = group.get("betas")
    return (
        lr,
        tuple(betas) if isinstance(betas, (list, tuple)) else betas,
        group.get("eps"),
        group.get("weight_decay"),
        group.get("amsgrad"),
        group.get("maximize"),
    )


class Offloader:
    """The worker, the buckets and the hooks of one OffloadAdam; see the module docstring."""

    def __init__(self, param_groups: list[dict[str, Any]], options: Options) -> None:
        self.groups = param_groups  # the optimizer's own list: schedulers change it
        self.options = options
        self.buckets: list[Bucket] = plan(param_groups, options.bucket_bytes)
        self.core: OptimizerCore | None = None
        self.links: CudaLinks | None = None
        self.lock = threading.Lock()
        self.sync = True  # False inside no_sync(): hooks let autograd accumulate
        self.running = False
        self.errors: list[BaseException] = []  # met by hooks, raised by the step
        self.late: list[int] = []  # parameters whose gradient came after their bucket left
        self.group_calls: list[concurrent.futures.Future[None]] = []
        self._sent: list[GroupConfig] = []  # the hyper-parameters the worker has
        self._seen: dict[int, tuple[_Key | None, float]] = {}  # each group's values, checked
        self._hooks: list[RemovableHandle] = []
        # A step whose astep() was cancelled, finishing on a thread: the next waits for it.
        self.unfinished: concurrent.futures.Future[object] | None = None
        self._by_key = {(b.group_id, b.index): b for b in self.buckets}

    # -- life ----------------------------------------------------------------------------

    def start(self, pending: Loaded | None) -> None:
        """Start the worker, share and register the buckets, load ``pending``; blocking.

        On failure the caller runs :meth:`close`.
        """
        configs = tuple(config_of(i, group) for i, group in enumerate(self.groups))
        options = self.options
        core = self.core = OptimizerCore(
            configs,
            backend=options.backend,
            worker_cores=options.worker_cores,
            exact_rollback=options.speculative,
            close_timeout=options.close_timeout,
            side_by_side=True,
        )
        self._allocate(self.buckets)
        core.start(options.start_timeout)
        self._register(self.buckets)
        self._set_sent(configs)
        if pending is not None:
            self.load(pending)
        for bucket in self.buckets:
            self._hook(bucket)
        self.running = True
        logger.info(
            "OffloadAdam: %d buckets of at most %.0f MiB, %s backend%s",
            len(self.buckets),
            options.bucket_bytes / (1 << 20),
            core.backend,
            ", speculative steps (exact rollback)" if options.speculative else "",
        )

    def _allocate(self, buckets: Sequence[Bucket]) -> None:
        for bucket in buckets:
            bucket.allocate()
            if bucket.resident_params:
                GATE.guard(
                    bucket.address,
                    f"parameters {bucket.indices} (param group {bucket.group_id}) of an "
                    "OffloadAdam",
                )
            if bucket.device.type == "cuda":
                if self.links is None:
                    from ._cuda import CudaLinks

                    self.links = CudaLinks()
                self.links.attach(bucket)

    def _register(self, buckets: Sequence[Bucket]) -> None:
        core = self._core()
        calls = []
        for bucket in buckets:
            if bucket.master is None or bucket.grad is None:
                raise RuntimeError("a bucket registered before it was allocated")  # a bug
            pieces = tuple(zip(bucket.offsets, (p.numel() for p in bucket.params), strict=True))
            calls.append(
                core.register(bucket.group_id, bucket.index, bucket.master, bucket.grad, pieces)
            )
        for call in calls:
            call.result()

    def _hook(self, bucket: Bucket) -> None:
        for position, param in enumerate(bucket.params):
            hook = functools.partial(self.on_grad, bucket, position)
            self._hooks.append(param.register_post_accumulate_grad_hook(hook))  # type: ignore[no-untyped-call]
            if bucket.resident[position]:
                with torch.enable_grad():  # the accumulator, kept so that it stays the one
                    accumulator = param.view_as(param).grad_fn.next_functions[0][0]  # type: ignore[union-attr]
                if accumulator is None:
                    raise RuntimeError("a parameter that requires grad has no accumulator")
                bucket.accumulators.append(accumulator)
                before = functools.partial(self.before_grad, bucket, position)
                self._hooks.append(accumulator.register_prehook(before))

    def pin(self) -> None:
        """Pin the trainer's CPUs (only with ``worker_cores``); on the trainer's thread."""
        if self.core is not None:
            self.core.pin()

    def unpin(self) -> None:
        """Put the trainer's CPUs back (see :meth:`pin`); on the trainer's thread."""
        if self.core is not None:
            self.core.unpin()

    def close(self) -> None:
        """Remove the hooks, stop the worker, free the buckets; blocking, idempotent."""
        self.running = False
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        try:
            if self.core is not None:
                try:
                    self.core.close()
                finally:
                    self.core.kill()
        finally:
            if self.links is not None:
                self.links.close()
                self.links = None
            for bucket in self.buckets:
                GATE.unguard(bucket.address)
                bucket.release()

    def _core(self) -> OptimizerCore:
        core = self.core
        if core is None:
            raise ClosedError("OffloadAdam is not started: `async with opt:` or `with opt:`")
        return core

    # -- the backward ----------------------------------------------------------------------

    def before_grad(
        self, bucket: Bucket, position: int, grads: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, ...] | None:
        """A resident parameter's gradient accumulator's pre-hook: the step's first gradient
        goes straight into the shared grad (:meth:`Bucket.first_grad`); never raises."""
        if not self.running or torch.is_grad_enabled():
            return None  # create_graph=True: autograd keeps a graph, not our view
        unfinished = self.unfinished
        if unfinished is not None:
            concurrent.futures.wait([unfinished])  # its redo may still read the grads
        try:
            view = bucket.first_grad(position, grads[0])
        except Exception as exc:  # noqa: BLE001 - raised by the step, never into autograd
            self.record(exc)
            return None
        return None if view is None else (view,)

    def let_go(self) -> None:
        """``zero_grad`` during a step: the shared gradients the worker may read are not
        zeroed but set to ``None`` (the next backward writes them anew)."""
        for bucket in self.buckets:
            if bucket.resident_params:
                bucket.let_go()

    def on_grad(self, bucket: Bucket, position: int, param: torch.Tensor) -> None:
        """A post-accumulate-grad hook: take the gradient; submit the bucket it completes."""
        if not self.running or not self.sync:
            return
        unfinished = self.unfinished
        if unfinished is not None:
            concurrent.futures.wait([unfinished])  # the buckets are still that step's
        grad = param.grad
        if grad is None:
            return
        try:
            with self.lock:
                if bucket.submitted:
                    self.late.append(bucket.indices[position])  # raised once, by the step
                    return
            if bucket.link is None:
                bucket.take_grad(position, grad)
            elif self.links is not None:
                self.links.grad_out(bucket, position, grad)
            with self.lock:
                complete = bucket.arrive(position)
                if complete:
                    bucket.submitted = True  # claimed: a later gradient of it is an error
            if not complete:
                return
            if self.links is not None and bucket.link is not None:
                self.links.complete(bucket, self._submit_recorded)
            else:
                self.submit(bucket)
        except Exception as exc:  # noqa: BLE001 - raised by the step, never into autograd
            self.record(exc)

    def take_errors(self) -> list[BaseException]:
        """The errors the hooks met since the last call (the caller holds :attr:`lock`)."""
        errors, self.errors = self.errors, []
        if self.late:
            errors.append(
                OptimizerError(
                    f"the gradients of parameters {sorted(set(self.late))} were accumulated "
                    "again after their bucket was submitted: the step used them as they were "
                    "then. Run every backward of a step but the last inside `opt.no_sync()`"
                )
            )
            self.late = []
        return errors

    def record(self, error: BaseException) -> None:
        """Keep an error met off the step's thread for the step to raise."""
        with self.lock:
            self.errors.append(error)

    def _submit_recorded(self, bucket: Bucket) -> None:
        try:
            self.submit(bucket)
        except Exception as exc:  # noqa: BLE001 - raised by the step
            self.record(exc)

    def submit(self, bucket: Bucket) -> None:
        """Send the bucket's step: its master takes outside changes, its gradients' norms are
        taken (speculation), the group's hyper-parameters go along. Any thread."""
        core = self._core()
        if bucket.link is not None and self.links is not None:
            changed = bucket.changed()
            bucket.resync(self.links.read(bucket, changed) if changed else None)
        else:
            bucket.resync()
        if self.options.speculative:
            bucket.compute_norms()
        bucket.lr = self.group_lr(bucket.group_id)
        bucket.submitted = True
        if bucket.master is None or bucket.grad is None:
            raise ClosedError("OffloadAdam was closed during the step")
        if bucket.resident_params:
            GATE.begin_write(bucket.address)  # after any staging copy of it; until landed()
        core.submit((bucket.group_id, bucket.index), bucket.master, bucket.grad, lr=bucket.lr)

    def group_lr(self, group_id: int) -> float:
        """The group's learning rate now; its other hyper-parameters, if they changed since
        the worker last had them, are sent first (schedulers may change betas too)."""
        group = self.groups[group_id]
        key = _group_key(group)
        seen = self._seen.get(group_id)
        if key is not None and seen is not None and seen[0] == key:
            return seen[1]  # as when last checked: nothing to validate or send
        config = config_of(group_id, group)
        with self.lock:
            if dataclasses.replace(self._sent[group_id], lr=config.lr) != config:
                self.send_groups()
            self._seen[group_id] = (key, config.lr)
        return config.lr

    def send_groups(self) -> None:
        """Send every group's hyper-parameters to the worker (the caller holds :attr:`lock`)."""
        configs = tuple(config_of(i, group) for i, group in enumerate(self.groups))
        self.group_calls.append(self._core().set_groups(configs))
        self._set_sent(configs)

    def _set_sent(self, configs: Sequence[GroupConfig]) -> None:
        self._sent = list(configs)
        self._seen = {}

    def fill_missing(self, bucket: Bucket) -> None:
        """Take the gradients of a bucket no hook completed (on the step's thread)."""
        if bucket.link is not None and self.links is not None:
            self.links.fill_missing(bucket)
        else:
            bucket.fill_missing()

    def publish(self, bucket: Bucket) -> None:
        """Copy a bucket's final master into the model's parameters (the step's thread)."""
        if bucket.link is not None and self.links is not None:
            self.links.publish(bucket)
        else:
            bucket.publish()

    def landed(self) -> None:
        """The step has ended: the worker writes no parameter until the next one is sent."""
        for bucket in self.buckets:
            if bucket.resident_params:
                GATE.end_write(bucket.address)

    def by_key(self, group_id: int, subgroup_id: int) -> Bucket:
        """The bucket registered as sub-group ``subgroup_id`` of group ``group_id``."""
        return self._by_key[group_id, subgroup_id]

    def in_step(self) -> bool:
        """Whether a step has begun (a bucket was submitted) and not ended."""
        return any(bucket.submitted for bucket in self.buckets)

    # -- groups and state ------------------------------------------------------------------

    def add_group(self, group_id: int) -> None:
        """Bucket the parameters of the group just appended; register them if running."""
        first_param = sum(len(group["params"]) for group in self.groups[:group_id])
        new = plan(
            self.groups[group_id : group_id + 1],
            self.options.bucket_bytes,
            first_group=group_id,
            first_param=first_param,
            first_bucket=len(self.buckets),
        )
        if self.running:
            if self.in_step():
                raise OptimizerError("add_param_group() during a step: call it between steps")
            with self.lock:
                self.send_groups()
            self._allocate(new)
            self._register(new)
            for bucket in new:
                self._hook(bucket)
        self.buckets.extend(new)
        self._by_key.update({(b.group_id, b.index): b for b in new})

    def load(self, loaded: Loaded) -> None:
        """Put a validated state in place in the worker and the masters; blocking."""
        self._core().load_state_dict(loaded.core_state).result()
        self.loaded(loaded)

    def loaded(self, loaded: Loaded) -> None:
        """The trainer's part of a load, once the worker holds the state: the masters."""
        for bucket, position, master in loaded.masters:
            view = bucket.master_views[position]
            view.copy_(master.view(view.shape))
        with self.lock:
            self._set_sent(loaded.configs)

    def apply_groups(self, loaded: Loaded) -> None:
        """Give the param groups the loaded hyper-parameters (their params stay)."""
        for group, new in zip(self.groups, loaded.groups, strict=True):
            params = group["params"]
            group.clear()
            group.update(new)
            group["params"] = params
