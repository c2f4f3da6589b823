"""OffloadAdam's hooks on the backward: each gradient taken as autograd produces it, each
bucket sent the moment it is complete, from the thread that runs the backward.

Two hooks per parameter:

* a post-accumulate-grad hook (:meth:`Hooks.on_grad`) takes the gradient into the shared
  grad (CUDA ones go through the link's pinned buffers) and submits the bucket it completes;
* for a resident parameter, a pre-hook on its gradient accumulator
  (:meth:`Hooks.before_grad`) writes the step's first gradient straight into the shared
  grad (:func:`~._grads.first_grad`).

They run on whatever thread runs the backward (the caller's for CPU parameters, autograd's
device threads for CUDA ones). A hook never raises into autograd: what goes wrong is
recorded, and the step raises it.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from typing import TYPE_CHECKING, Protocol

import torch

from ..._errors import OptimizerError
from ._buckets import Bucket
from ._grads import first_grad, take_grad

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from ._cuda import CudaLinks

__all__ = ["Hooks", "Sender"]


class Sender(Protocol):
    """What the hooks need of the offloader that sends the buckets (a protocol: the
    offloader imports this module)."""

    lock: threading.Lock
    sync: bool
    running: bool
    links: CudaLinks | None
    unfinished: concurrent.futures.Future[object] | None

    def submit(self, bucket: Bucket) -> None:
        """Send ``bucket``'s gradients to the worker."""


class Hooks:
    """The hooks of one OffloadAdam's parameters, and what they met for the step to raise."""

    def __init__(self, offloader: Sender) -> None:
        self._off = offloader
        self.lock = offloader.lock  # the buckets' per-step fields, the errors
        self._errors: list[BaseException] = []
        self._late: list[int] = []  # parameters whose gradient came after their bucket left
        self._handles: list[RemovableHandle] = []

    def install(self, bucket: Bucket) -> None:
        """Hook every parameter of ``bucket`` (started: its memory is allocated)."""
        for position, param in enumerate(bucket.params):
            hook = functools.partial(self.on_grad, bucket, position)
            self._handles.append(param.register_post_accumulate_grad_hook(hook))  # type: ignore[no-untyped-call]
            if bucket.resident[position]:
                with torch.enable_grad():  # the accumulator, kept so that it stays the one
                    accumulator = param.view_as(param).grad_fn.next_functions[0][0]  # type: ignore[union-attr]
                if accumulator is None:
                    raise RuntimeError("a parameter that requires grad has no accumulator")
                bucket.accumulators.append(accumulator)
                before = functools.partial(self.before_grad, bucket, position)
                self._handles.append(accumulator.register_prehook(before))

    def remove(self) -> None:
        """Remove every hook; forget what they met."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        with self.lock:
            self._errors, self._late = [], []

    def _wait_unfinished(self) -> None:
        unfinished = self._off.unfinished
        if unfinished is not None:
            concurrent.futures.wait([unfinished])  # the buckets are still that step's

    def before_grad(
        self, bucket: Bucket, position: int, grads: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, ...] | None:
        """A resident parameter's gradient accumulator's pre-hook: the step's first gradient
        goes straight into the shared grad; never raises."""
        if not self._off.running or torch.is_grad_enabled():
            return None  # create_graph=True: autograd keeps a graph, not our view
        self._wait_unfinished()  # its redo may still read the grads
        try:
            view = first_grad(bucket, position, grads[0])
        except Exception as exc:  # noqa: BLE001 - raised by the step, never into autograd
            self.record(exc)
            return None
        return None if view is None else (view,)

    def on_grad(self, bucket: Bucket, position: int, param: torch.Tensor) -> None:
        """A post-accumulate-grad hook: take the gradient; submit the bucket it completes."""
        off = self._off
        if not off.running or not off.sync:
            return
        self._wait_unfinished()
        grad = param.grad
        if grad is None:
            return
        try:
            with self.lock:
                if bucket.submitted:
                    self._late.append(bucket.indices[position])  # raised once, by the step
                    return
            links = off.links
            if bucket.link is None or links is None:
                take_grad(bucket, position, grad)
            else:
                links.grad_out(bucket, position, grad)
            with self.lock:
                complete = bucket.arrive(position)
                if complete:
                    bucket.submitted = True  # claimed: a later gradient of it is an error
            if not complete:
                return
            if links is not None and bucket.link is not None:
                links.complete(bucket, self._submit_recorded)
            else:
                off.submit(bucket)
        except Exception as exc:  # noqa: BLE001 - raised by the step, never into autograd
            self.record(exc)

    def take_errors(self) -> list[BaseException]:
        """The errors the hooks met since the last call (the caller holds :attr:`lock`)."""
        errors, self._errors = self._errors, []
        late, self._late = self._late, []
        if late:
            errors.append(
                OptimizerError(
                    f"the gradients of parameters {sorted(set(late))} were accumulated again "
                    "after their bucket was submitted: the step could not use their sum. Run "
                    "every backward of a step but the last inside `opt.no_sync()`"
                )
            )
        return errors

    def record(self, error: BaseException) -> None:
        """Keep an error met off the step's thread for the step to raise."""
        with self.lock:
            self._errors.append(error)

    def _submit_recorded(self, bucket: Bucket) -> None:
        try:
            self._off.submit(bucket)
        except Exception as exc:  # noqa: BLE001 - raised by the step
            self.record(exc)
