"""OffloadAdam's machinery without a face: the worker, the buckets, submits, hyper-parameters.

:class:`Offloader` owns the worker (an :class:`~.._core.OptimizerCore`), the buckets and
the backward's hooks (:mod:`._hooks`). It needs no event loop and is thread-safe where it
must be: the hooks submit a bucket the moment its last gradient is in, on the thread that
runs the backward; the step itself (:mod:`._step`) runs on the thread that calls
``step()`` or ``astep()``.

The worker always keeps an exact pre-step copy of every bucket (``exact_rollback``): a
bucket sent by the backward steps at once, and if its gradients change before ``step()``
(clipping, unscaling, a hand edit) or the step is clipped or skipped, it is restored bit
for bit and stepped again.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
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
from ._grads import compute_norms, let_go, record_sent
from ._hooks import Hooks
from ._options import Options
from ._plan import plan
from ._state import Loaded, config_of

if TYPE_CHECKING:
    from ._cuda import CudaLinks

__all__ = ["Offloader"]

logger = logging.getLogger(__name__)


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
        self.lock = threading.Lock()  # the buckets' per-step fields, the hooks' errors
        self.sync = True  # False inside no_sync(): hooks let autograd accumulate
        self.running = False
        self.hooks = Hooks(self)
        self.group_calls: list[concurrent.futures.Future[None]] = []
        self._sent: list[GroupConfig] = []  # the hyper-parameters the worker has
        self._seen: dict[int, tuple[_Key | None, float]] = {}  # each group's values, checked
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
        self.group_calls, self.unfinished = [], None
        core = self.core = OptimizerCore(
            configs,
            backend=options.backend,
            worker_cores=options.worker_cores,
            exact_rollback=True,
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
            self.hooks.install(bucket)
        self.running = True
        logger.info(
            "OffloadAdam: %d buckets of at most %.0f MiB, %s backend%s",
            len(self.buckets),
            options.bucket_bytes / (1 << 20),
            core.backend,
            ", clipping and skipping by the global norm" if options.speculative else "",
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
        self.hooks.remove()
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

    def let_go(self) -> None:
        """``zero_grad`` during a step: the shared gradients the worker may read are not
        zeroed but set to ``None`` (the next backward writes them anew)."""
        for bucket in self.buckets:
            if bucket.resident_params:
                let_go(bucket)

    def submit(self, bucket: Bucket) -> None:
        """Send the bucket's step: its master takes outside changes, its gradients' norms are
        taken (speculation), its gradients recorded as sent, the group's hyper-parameters go
        along. Any thread."""
        self._core()
        if bucket.link is not None and self.links is not None:
            changed = bucket.changed()
            bucket.resync(self.links.read(bucket, changed) if changed else None)
        else:
            bucket.resync()
        if self.options.speculative:
            compute_norms(bucket)
        bucket.lr = self.group_lr(bucket.group_id)
        bucket.submitted = True
        record_sent(bucket)
        if bucket.resident_params:
            GATE.begin_write(bucket.address)  # after any staging copy of it; until landed()
        self.send(bucket)

    def send(self, bucket: Bucket, *, rollback: bool = False) -> None:
        """Send the bucket's step (at this step's ``lr``), or its exact rollback; any thread."""
        core = self._core()
        if bucket.master is None or bucket.grad is None:
            raise ClosedError("OffloadAdam was closed during the step")
        key, lr = (bucket.group_id, bucket.index), None if rollback else bucket.lr
        with self.lock:
            bucket.due += 0 if rollback else 1  # counted before its outcome can come back
        try:
            core.submit(key, bucket.master, bucket.grad, lr, rollback)
        except BaseException:
            with self.lock:
                bucket.due -= 0 if rollback else 1
            raise

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
                self.hooks.install(bucket)
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
