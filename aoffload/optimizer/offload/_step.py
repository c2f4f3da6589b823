"""One OffloadAdam step once the backward is over: submit the rest, validate, settle.

The hooks have submitted every bucket whose gradients arrived: those steps ran (or run)
*speculatively*, with the gradients as they are, while the backward went on. The step
then, on the caller's thread:

0. tells the worker that the trainer now waits (it steps on every core from then on, on
   all but one while the backward runs);
1. waits for the CUDA hand-offs still on the link thread, if any;
2. submits the buckets no hook completed (their gradients taken from ``param.grad``, a
   zero gradient for a parameter that has none);
3. decides, from every gradient's norm (taken per parameter as each bucket was
   submitted, exactly as ``torch.nn.utils.clip_grad_norm_`` takes them, and combined in
   the optimizer's parameter order): a non-finite global norm (an inf or nan gradient:
   an AMP overflow) **skips** the step, every bucket's step is rolled back; a norm over
   ``max_grad_norm`` **clips**: each bucket, once its speculative step is back, has its
   gradients scaled by ``clip_grads_with_norm_``'s coefficient and its step rolled back
   and redone; otherwise the speculative steps stand;
4. settles: as each bucket's final step is back, it is published: the parameters that
   live in the master (fp32 CPU) have their version counters moved, the others get the
   master copied in, so the copies overlap the worker's remaining buckets. Once nothing
   is in flight, the worker writes no parameter until the next backward sends a bucket
   (:meth:`Offloader.landed`).

Rollbacks are exact (the worker keeps a pre-step copy when speculation is on), so with
the ``torch`` backend the result is bit-identical to clipping first and stepping after.

The flow is a generator: it yields what it needs to wait for (:data:`OUTCOMES`, or a
future) and its driver waits, blocking (``step()``) or awaiting (``astep()``), so the two
forms run the same code.
"""

from __future__ import annotations

import concurrent.futures
import enum
import math
from collections.abc import Generator
from dataclasses import dataclass

import torch

from ..._errors import ClosedError
from .._core import OptimizerCore
from .._results import StepKind, Wait
from ._buckets import Bucket
from ._offloader import Offloader

__all__ = ["OUTCOMES", "Flow", "StepReport", "step_flow"]


class _Need(enum.Enum):
    OUTCOMES = "outcomes"


OUTCOMES = _Need.OUTCOMES
"""Yielded by the flow: wait until a step's outcome is in or none is in flight."""

Flow = Generator["_Need | concurrent.futures.Future[None]", None, "StepReport"]


@dataclass(frozen=True, slots=True)
class StepReport:
    """What one :class:`~aoffload.OffloadAdam` step did.

    ``grad_norm`` is the global 2-norm of the gradients (``None`` when neither
    ``max_grad_norm`` nor ``skip_nonfinite`` asked for it); ``clipped``: the norm was over
    ``max_grad_norm`` and the step was redone with the gradients scaled down; ``skipped``:
    a gradient was inf or nan and the step was undone (parameters, moments and step
    counts are as before it).
    """

    grad_norm: float | None
    clipped: bool
    skipped: bool


@dataclass(frozen=True, slots=True)
class _Verdict:
    report: StepReport
    coefficient: torch.Tensor | None  # the clipping coefficient of a step to redo


def _verdict(off: Offloader) -> _Verdict:
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


def _send(core: OptimizerCore, bucket: Bucket, *, rollback: bool = False) -> None:
    if bucket.master is None or bucket.grad is None:
        raise RuntimeError("a bucket stepped after it was released")  # a bug of ours
    lr = None if rollback else bucket.lr
    core.submit((bucket.group_id, bucket.index), bucket.master, bucket.grad, lr, rollback)


def _add(errors: list[BaseException], error: BaseException) -> None:
    if not any(error is seen for seen in errors):  # one death fails every step: once
        errors.append(error)


def step_flow(off: Offloader) -> Flow:
    """The step; see the module docstring. Raises what went wrong once nothing is in flight:
    the error itself, or an :class:`ExceptionGroup` of several."""
    core = off.core
    if core is None or not off.running:
        raise ClosedError("OffloadAdam is not running: `async with opt:` or `with opt:`")
    errors: list[BaseException] = []
    verdict: _Verdict | None = None
    try:
        core.hurry()  # the backward is over: the worker may take every core
        if off.links is not None:
            flushed = off.links.flush()
            if not flushed.done():
                yield flushed
        for bucket in off.buckets:
            if not bucket.submitted:
                off.fill_missing(bucket)
                off.submit(bucket)
        verdict = _verdict(off)
        if verdict.report.skipped:
            for bucket in off.buckets:
                _send(core, bucket, rollback=True)  # behind its step: undone exactly
    except Exception as exc:  # noqa: BLE001 - raised below, once nothing is in flight
        errors.append(exc)
    yield from _settle(off, core, verdict, errors)
    with off.lock:
        for error in off.take_errors():
            _add(errors, error)
        for bucket in off.buckets:
            bucket.reset()
    off.landed()
    for call in [call for call in off.group_calls if call.done()]:
        off.group_calls.remove(call)
        if call.exception() is not None:
            _add(errors, call.exception())  # type: ignore[arg-type]
    if errors:
        if len(errors) == 1:
            raise errors[0]
        raise ExceptionGroup(f"{len(errors)} errors in an OffloadAdam step", errors)  # type: ignore[type-var]
    if off.links is not None:
        off.links.finish()
    return verdict.report if verdict is not None else StepReport(None, False, False)


def _settle(
    off: Offloader, core: OptimizerCore, verdict: _Verdict | None, errors: list[BaseException]
) -> Generator[_Need, None, None]:
    """Take every outcome until none is in flight; redo clipped buckets, publish final ones."""
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
        if verdict is None or errors or verdict.report.skipped:
            continue  # failing or skipped: only take the outcomes
        if pending.kind is StepKind.ROLLBACK:
            continue
        bucket = off.by_key(pending.group_id, pending.subgroup)
        if verdict.coefficient is not None and bucket.phase == 0:
            bucket.phase = 1  # its speculative step is back: scale, undo, redo
            try:
                bucket.scale_grads(verdict.coefficient)
                _send(core, bucket, rollback=True)
                _send(core, bucket)
            except Exception as exc:  # noqa: BLE001 - raised by the step, after the rest
                _add(errors, exc)
            continue
        try:
            off.publish(bucket)
        except Exception as exc:  # noqa: BLE001 - raised by the step, after the rest
            _add(errors, exc)
