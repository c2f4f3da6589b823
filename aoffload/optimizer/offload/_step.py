"""One OffloadAdam step once the backward is over: submit the rest, validate, redo, settle.

The hooks have submitted every bucket whose gradients arrived: those steps ran (or run)
*speculatively*, with the gradients as they were then, while the backward went on. The
worker keeps an exact pre-step copy of every bucket, so any of them can be undone bit for
bit. The step then, on the caller's thread:

0. tells the worker that the trainer now waits (it steps on every core from then on, on
   all but one while the backward runs);
1. waits for the CUDA hand-offs still on the link thread, if any;
2. submits the buckets no hook completed (their gradients taken from ``param.grad``, a
   zero gradient for a parameter that has none);
3. looks at what happened to the gradients since their buckets were sent
   (:mod:`._grads`): a ``GradScaler`` that found an inf or a nan (its
   ``_step_supports_amp_scaling`` protocol: ``found_inf``) **skips** the step; one that
   hands over its scale (``grad_scale``) has every gradient divided by it, as
   ``torch.optim.AdamW(fused=True)``'s kernel does; a bucket whose gradients were written,
   replaced or dropped (``clip_grad_norm_``, ``p.grad.mul_(...)``, ``GradScaler.unscale_``,
   which moves no version counter and is told by ``grad_scale`` being ``None``) takes them
   again and is **redone**: rolled back exactly and stepped again;
4. decides, from every gradient's norm (taken per parameter as ``clip_grad_norm_`` takes
   them, and combined in the optimizer's parameter order), when ``max_grad_norm`` or
   ``skip_nonfinite`` asks: a non-finite global norm **skips** the step, every bucket is
   rolled back; a norm over ``max_grad_norm`` **clips**: every bucket has its gradients
   scaled by ``clip_grads_with_norm_``'s coefficient and is redone;
5. settles: as each bucket's last step is back, it is published: the parameters that live
   in the master (fp32 CPU) have their version counters moved, the others get the master
   copied in, so the copies overlap the worker's remaining buckets. Once nothing is in
   flight, the worker writes no parameter until the next backward sends a bucket.

With the ``torch`` backend the result is bit-identical to ``torch.optim.AdamW(fused=True)``
stepping after the same edits. The flow is a generator: it yields what it needs to wait
for (:data:`OUTCOMES`, or a future) and its driver (:mod:`._drive`) waits, blocking
(``step()``) or awaiting (``astep()``), so the two forms run the same code.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import math
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch

from ..._errors import ClosedError
from .._results import StepKind, Wait
from ._grads import changed, fill_missing, retake, scale_grads, unscale
from ._offloader import Offloader

__all__ = ["OUTCOMES", "Amp", "Flow", "StepReport", "abandon_flow", "step_flow"]


class _Need(enum.Enum):
    OUTCOMES = "outcomes"


OUTCOMES = _Need.OUTCOMES
"""Yielded by a flow: wait until a step's outcome is in or none is in flight."""

Flow = Generator["_Need | concurrent.futures.Future[None]", None, "StepReport"]


@dataclass(frozen=True, slots=True)
class StepReport:
    """What one :class:`~aoffload.OffloadAdam` step did.

    ``grad_norm`` is the global 2-norm of the gradients (``None`` when neither
    ``max_grad_norm`` nor ``skip_nonfinite`` asked for it); ``clipped``: the norm was over
    ``max_grad_norm`` and the step was redone with the gradients scaled down; ``skipped``:
    a gradient was inf or nan (by the norm, or by a ``GradScaler``) and the step was undone
    (parameters, moments and step counts are as before it); ``redone``: how many buckets
    were rolled back and stepped again, because their gradients changed after the backward
    sent them (clipping, unscaling, an edit) or the step was clipped.
    """

    grad_norm: float | None
    clipped: bool
    skipped: bool
    redone: int = 0


@dataclass(frozen=True, slots=True)
class Amp:
    """What ``GradScaler.step`` told the optimizer before calling ``step()``: whether it
    found an inf or a nan, and the scale to divide the gradients by (``None``: it unscaled
    them itself, with ``unscale_``)."""

    found_inf: bool
    grad_scale: torch.Tensor | None

    @classmethod
    def of(cls, optimizer: object) -> Amp | None:
        """The ``found_inf`` and ``grad_scale`` a ``GradScaler`` set on ``optimizer``, if any."""
        found_inf: Any = getattr(optimizer, "found_inf", None)
        if found_inf is None:
            return None
        grad_scale = getattr(optimizer, "grad_scale", None)
        found = float(found_inf) if isinstance(found_inf, (torch.Tensor, float, int)) else 1.0
        return cls(found != 0.0, grad_scale if isinstance(grad_scale, torch.Tensor) else None)


@dataclass(frozen=True, slots=True)
class _Verdict:
    report: StepReport
    coefficient: torch.Tensor | None  # the clipping coefficient of a step to redo


def _verdict(off: Offloader, found_inf: bool) -> _Verdict:
    if found_inf:
        return _Verdict(StepReport(None, False, True), None)
    if not off.options.speculative:
        return _Verdict(StepReport(None, False, False), None)
    norms = sorted(
        (index, norm)
        for bucket in off.buckets
        for index, norm in zip(bucket.indices, bucket.norms, strict=True)
        if norm is not None
    )
    total = (
        torch.linalg.vector_norm(torch.stack([norm for _, norm in norms]), 2.0)
        if norms
        else torch.zeros(())
    )
    value = float(total)
    if not math.isfinite(value):
        return _Verdict(StepReport(value, False, True), None)
    max_norm = off.options.max_grad_norm
    if max_norm is not None:
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if float(coefficient) < 1.0:
            return _Verdict(StepReport(value, True, False), coefficient)
    return _Verdict(StepReport(value, False, False), None)


def _add(errors: list[BaseException], error: BaseException) -> None:
    if not any(error is seen for seen in errors):  # one death fails every step: once
        errors.append(error)


def _decide(off: Offloader, amp: Amp | None) -> tuple[_Verdict, int]:
    """Steps 3 and 4 of the module docstring: take changed gradients again, judge, and send
    the rollbacks and redos; the verdict and how many buckets are redone."""
    found_inf = amp is not None and amp.found_inf
    redo = []
    if not found_inf:
        if amp is not None and amp.grad_scale is not None:
            unscale((p for bucket in off.buckets for p in bucket.params), amp.grad_scale)
        every = amp is not None and amp.grad_scale is None  # unscale_ moved no version
        redo = [bucket for bucket in off.buckets if every or changed(bucket)]
        for bucket in redo:
            retake(bucket, off.options.speculative)
    verdict = _verdict(off, found_inf)
    sent = [bucket for bucket in off.buckets if bucket.due]  # never one a hook failed to send
    if verdict.report.skipped:
        for bucket in sent:
            off.send(bucket, rollback=True)  # behind its step: undone exactly
        return verdict, 0
    if verdict.coefficient is not None:
        redo = sent
        for bucket in redo:
            scale_grads(bucket, verdict.coefficient)
    redo = [bucket for bucket in redo if bucket.due]
    for bucket in redo:
        off.send(bucket, rollback=True)
        off.send(bucket)
    return verdict, len(redo)


def step_flow(off: Offloader, amp: Amp | None = None) -> Flow:
    """The step; see the module docstring. Raises what went wrong once nothing is in flight:
    the error itself, or an :class:`ExceptionGroup` of several."""
    core = off.core
    if core is None or not off.running:
        raise ClosedError("OffloadAdam is not running: use it inside `with opt:`")
    errors: list[BaseException] = []
    verdict: _Verdict | None = None
    redone = 0
    try:
        core.hurry()  # the backward is over: the worker may take every core
        if off.links is not None:
            flushed = off.links.flush()
            if not flushed.done():
                yield flushed
        for bucket in off.buckets:
            if not bucket.submitted:
                fill_missing(bucket)
                off.submit(bucket)
        verdict, redone = _decide(off, amp)
    except Exception as exc:  # noqa: BLE001 - raised below, once nothing is in flight
        errors.append(exc)
    yield from _settle(off, verdict, errors)
    _end(off, errors)
    if off.links is not None:
        off.links.finish()
    if verdict is None:
        return StepReport(None, False, False)
    if not verdict.report.skipped:
        core.settle()  # the worker keeps the moments for the next backup meanwhile
    return dataclasses.replace(verdict.report, redone=redone)


def abandon_flow(off: Offloader) -> Generator[_Need | concurrent.futures.Future[None], None, None]:
    """Undo a step the backward began and nobody finished (the optimizer closes between its
    backward and its step): every bucket sent is rolled back exactly, and the parameters,
    moments and step counts are as before it. Raises what went wrong, as :func:`step_flow`."""
    errors: list[BaseException] = []
    try:
        if off.links is not None:
            flushed = off.links.flush()
            if not flushed.done():
                yield flushed
        for bucket in off.buckets:
            if bucket.due:
                off.send(bucket, rollback=True)
    except Exception as exc:  # noqa: BLE001 - raised below, once nothing is in flight
        errors.append(exc)
    yield from _settle(off, None, errors)
    _end(off, errors)


def _end(off: Offloader, errors: list[BaseException]) -> None:
    with off.lock:
        for error in off.hooks.take_errors():
            _add(errors, error)
        for bucket in off.buckets:
            bucket.reset()
    off.landed()
    for call in [call for call in off.group_calls if call.done()]:
        off.group_calls.remove(call)
        if call.exception() is not None:
            _add(errors, call.exception())  # type: ignore[arg-type]
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ExceptionGroup(f"{len(errors)} errors in an OffloadAdam step", errors)  # type: ignore[type-var]


def _settle(
    off: Offloader, verdict: _Verdict | None, errors: list[BaseException]
) -> Generator[_Need, None, None]:
    """Take every outcome until none is in flight; publish each bucket after its last step."""
    core = off.core
    if core is None:
        return
    outcomes = core.outcomes
    while True:
        pending = outcomes.next(follow=False)
        if pending is Wait.WAIT:
            yield OUTCOMES
            continue
        if pending is None:
            return
        try:
            pending.result()
        except Exception as exc:  # noqa: BLE001 - raised by the step, after the rest
            _add(errors, exc)
            continue
        if pending.kind is StepKind.ROLLBACK:
            continue
        bucket = off.by_key(pending.group_id, pending.subgroup)
        with off.lock:
            bucket.due -= 1
            final = not bucket.due
        if not final or verdict is None or errors or verdict.report.skipped:
            continue  # a redo follows, or failing or skipped: only take the outcomes
        try:
            off.publish(bucket)
        except Exception as exc:  # noqa: BLE001 - raised by the step, after the rest
            _add(errors, exc)
