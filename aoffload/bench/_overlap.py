"""Overlap section: the optimizer steps sub-groups while the backward pass still runs.

A step is a simulated backward pass over 16 sub-groups of 1M fp32 parameters. Sub-group
``i``'s gradient is ready at ``t0 + (i + 1) * t_b / 16``, on the schedule of an accelerator
that computes on its own; the trainer waits for it with ``time.sleep`` (every system, aoffload
included: the trainer thread is blocked, as while it waits for an accelerator, and for
aoffload that thread is the event loop's, which does not turn until the step awaits), hands
it to the optimizer at once, and the step ends when every sub-group is updated. The ideal
step is ``max(t_b, t_adam) + t_adam / 16``: the backward or the optimizer, whichever is
longer, plus the last sub-group's own step; ``t_adam`` is the in-process optimizer's 16
sub-group steps, measured in the same run.

DeepSpeed's ``SuperOffloadCPUOptimizer`` and aoffload's drop-in for it
(``aoffload.deepspeed``, on the optimizer's thread-safe core, no event loop) are driven by
the same code, as DeepSpeed's stage 3 drives them.

A second run makes one step in ten overflow (declared after the step; the gradients stay
finite), so that every speculative sub-group step of that step is rolled back.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import inspect
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from ._common import Figure, Report, progress
from ._optimizer import CONFIG, _deepspeed_in_process, _subgroups
from ._overlap_report import (
    ADAPTER,
    BACKWARD_ALONE,
    BACKWARDS,
    EXACT,
    LR,
    NUMEL,
    OVERFLOW_BACKWARD,
    OVERFLOW_EVERY,
    PINNED,
    SECTION,
    SEQUENTIAL,
    SUBGROUPS,
    SUPEROFFLOAD,
    report_own,
    report_steps,
    step_metric,
)

Groups = list[tuple[torch.Tensor, torch.Tensor]]
# (what the step belongs to, t_b, whether it overflows); "warm-up" steps are not reported
Plan = list[tuple[str, float, bool]]
T = TypeVar("T")


def _variants() -> tuple[str, str, float | None]:
    """aoffload's defaults, named by what they are in the code being measured, and the
    other ``worker_cores`` choice: ``None`` (no pinning), or pinned when that is the default."""
    import aoffload

    default = inspect.signature(aoffload.CPUAdam.__init__).parameters["worker_cores"].default
    other = None if default is not None else PINNED
    return (
        f"aoffload CPUAdam (defaults: worker_cores={default!r})",
        f"aoffload CPUAdam (worker_cores={other!r})",
        other,
    )


def _ready_times(started: float, t_b: float) -> list[float]:
    return [started + (i + 1) * t_b / SUBGROUPS for i in range(SUBGROUPS)]


def _wait_until(deadline: float) -> None:
    remaining = deadline - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)  # the trainer blocked on its accelerator (simulated)


def _plan(reps: int, backwards: Sequence[float], windows: int) -> Plan:
    plan: Plan = [("warm-up", 0.0, False)]
    plan += [(step_metric(t_b), t_b, False) for t_b in backwards for _ in range(reps)]
    for _ in range(windows):
        plan += [("window", OVERFLOW_BACKWARD, i == OVERFLOW_EVERY - 1) for i in range(10)]
    return plan


def _collect(plan: Plan, times: list[float]) -> dict[str, list[float]]:
    """Step times by metric; overflow windows become their mean step and overflowed step."""
    out: dict[str, list[float]] = {}
    window: list[float] = []
    for (key, _, overflow), seconds in zip(plan, times, strict=True):
        if key == "window":
            window.append(seconds)
            if overflow:
                out.setdefault("mean", []).append(sum(window) / len(window))
                out.setdefault("overflowed", []).append(seconds)
                window = []
        elif key != "warm-up":
            out.setdefault(key, []).append(seconds)
    return out


def _backward_alone(plan: Plan) -> list[float]:
    """The simulation's own floor: the schedule waited out with no optimizer at all."""
    times = []
    for _, t_b, _ in plan:
        started = time.perf_counter()
        for ready in _ready_times(started, t_b):
            _wait_until(ready)
        times.append(time.perf_counter() - started)
    return times


def _sequential(groups: Groups, plan: Plan) -> tuple[list[float], list[float]]:
    """In-process DeepSpeedCPUAdam after the backward; an overflowed step is skipped, as
    a trainer that checks for overflow before stepping skips it. Returns step and
    optimizer-only times."""
    step = _deepspeed_in_process(groups)
    times, adam = [], []
    for _, t_b, overflow in plan:
        started = time.perf_counter()
        for ready in _ready_times(started, t_b):
            _wait_until(ready)
        optimizer_started = time.perf_counter()
        if not overflow:
            step()
        ended = time.perf_counter()
        times.append(ended - started)
        adam.append(ended - optimizer_started)
    return times, adam


def _superoffload(groups: Groups, plan: Plan, *, ours: bool) -> list[float]:
    """A SuperOffload CPU optimizer as ZeRO-3 SuperOffload drives it: ``async_step`` and
    one non-blocking ``get_result`` per finished sub-group (``partition_grads``), then
    ``get_result`` with 1 ms sleeps until all are back (``_wait_for_async_operations``),
    each updated param copied into the fp32 partition; an overflow rolls back one
    sub-group at a time (``_handle_overflow_rollback``). ``ours``: aoffload's drop-in
    instead of DeepSpeed's class, each with its own defaults."""
    from deepspeed.runtime.superoffload.superoffload_utils import (
        EventTypes,
        ResultKeys,
        SuperOffloadCPUOptimizer,
        TaskKeys,
    )

    params = [p.clone() for p, _ in groups]
    grads = [g.clone() for _, g in groups]
    numel = max(p.numel() for p in params)
    optimizer: Any
    if ours:
        import aoffload.deepspeed

        optimizer = aoffload.deepspeed.SuperOffloadCPUOptimizer(dict(CONFIG), max_grad_numel=numel)
    else:
        optimizer = SuperOffloadCPUOptimizer(dict(CONFIG), max_grad_numel=numel)
    outstanding = 0
    deadline = 0.0

    def take(result: dict[str, Any] | None) -> bool:
        if result is None:
            if time.perf_counter() > deadline:  # stage 3 gives up after 60 s, too
                raise TimeoutError("DeepSpeed's SuperOffload worker sent no result for 60 s")
            return False
        params[result[TaskKeys.SUB_GROUP_ID]].copy_(result[ResultKeys.UPDATED_PARAM])
        return True

    try:
        times = []
        for _, t_b, overflow in plan:
            started = time.perf_counter()
            deadline = started + t_b + 60.0
            for i, ready in enumerate(_ready_times(started, t_b)):
                _wait_until(ready)
                optimizer.async_step(0, i, params[i], grads[i], lr=LR)
                outstanding += 1
                outstanding -= take(optimizer.get_result())
            while outstanding:
                if take(optimizer.get_result()):
                    outstanding -= 1
                else:
                    time.sleep(0.001)  # DeepSpeed's own wait
            if overflow:
                for i in range(SUBGROUPS):
                    optimizer.async_step(0, i, params[i], grads[i], rollback=True)
                    while not take(optimizer.get_result(expected_event_type=EventTypes.ROLLBACK)):
                        time.sleep(0.001)
            times.append(time.perf_counter() - started)
        return times
    finally:
        if ours:
            optimizer.close()  # an error of aoffload's close is a failure, reported
        else:
            with contextlib.suppress(Exception):  # its close() only logs; nothing to report
                optimizer.close()


async def _aoffload(groups: Groups, plan: Plan, **options: Any) -> tuple[list[float], list[float]]:
    """aoffload's CPUAdam: submit each sub-group when ready, from the loop's thread, which
    stays blocked through the whole backward; ``drain()`` at the end; an overflow rolls
    back every sub-group at once. Returns the step times and the worker's own optimizer
    time per step (the sum of the steps' ``seconds``)."""
    import aoffload

    params = [p.clone() for p, _ in groups]
    grads = [g.clone() for _, g in groups]
    times, computes = [], []
    async with aoffload.CPUAdam([dict(CONFIG)], **options) as optimizer:
        for i in range(SUBGROUPS):
            await optimizer.register(0, i, params[i], grads[i])
        for _, t_b, overflow in plan:
            started = time.perf_counter()
            for i, ready in enumerate(_ready_times(started, t_b)):
                _wait_until(ready)  # the loop does not turn: results are recorded regardless
                optimizer.submit(0, i, params[i], grads[i], lr=LR)
            results = await optimizer.drain()
            if overflow:
                for i in range(SUBGROUPS):
                    optimizer.submit(0, i, params[i], grads[i], rollback=True)
                await optimizer.drain()
            times.append(time.perf_counter() - started)
            computes.append(sum(result.seconds for result in results))
    return times, computes


def _run_aoffload(
    groups: Groups, plan: Plan, options: dict[str, Any]
) -> tuple[list[float], list[float]]:
    return asyncio.run(_aoffload(groups, plan, **options))


def _restoring(call: Callable[[], T]) -> T:
    """Run ``call``, then put back this process's CPU affinity and torch threads
    (DeepSpeed's worker re-pins the trainer and does not restore it)."""
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    threads = torch.get_num_threads()
    try:
        return call()
    finally:
        if affinity is not None:
            os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)


def run(report: Report, *, quick: bool, smoke: bool = False) -> None:
    """Measure one training step's overlap of backward and optimizer, and overflow."""
    reps = 1 if smoke else 3 if quick else 7  # --smoke: every system once at every t_b
    windows = 1 if smoke else 3 if quick else 5
    groups = _subgroups(SUBGROUPS, NUMEL // 64 if smoke else NUMEL)
    sweep, full = _plan(reps, BACKWARDS, 0), _plan(reps, BACKWARDS, windows)
    overflow_only = _plan(0, (), windows)
    default, alternative, other_cores = _variants()
    measured: dict[str, dict[str, list[float]]] = {}
    own: dict[str, dict[str, list[float]]] = {}
    t_adam: Figure | None = None

    progress(f"overlap: backward alone, {len(BACKWARDS)} x {reps} steps")
    measured[BACKWARD_ALONE] = _collect(sweep, _backward_alone(sweep))

    progress(f"overlap: {SEQUENTIAL}")
    try:
        times, adam = _restoring(lambda: _sequential(groups, full))
        measured[SEQUENTIAL] = _collect(full, times)
        adam = [a for (key, _, _), a in zip(full, adam, strict=True) if key.startswith("step")]
        t_adam = report.add(SECTION, SEQUENTIAL, "optimizer alone (t_adam)", "s", adam)
    except Exception as exc:  # noqa: BLE001 - a third-party anchor that cannot run is skipped
        report.skip(SECTION, SEQUENTIAL, f"{type(exc).__name__}: {exc}"[:300])

    progress(f"overlap: {SUPEROFFLOAD}")
    try:
        measured[SUPEROFFLOAD] = _collect(
            full, _restoring(lambda: _superoffload(groups, full, ours=False))
        )
    except Exception as exc:  # noqa: BLE001 - a third-party anchor that cannot run is skipped
        report.skip(SECTION, SUPEROFFLOAD, f"{type(exc).__name__}: {exc}"[:300])
    if importlib.util.find_spec("deepspeed") is None:
        report.notes.append(f"overlap: {ADAPTER} not measured: DeepSpeed is not installed")
    else:
        progress(f"overlap: {ADAPTER}")
        try:
            measured[ADAPTER] = _collect(
                full, _restoring(lambda: _superoffload(groups, full, ours=True))
            )
        except Exception as exc:  # noqa: BLE001 - an aoffload error is a failure, reported
            report.fail(SECTION, ADAPTER, exc)

    for system, plan, options in (
        (default, full, {}),
        (alternative, sweep, {"worker_cores": other_cores}),
        (EXACT, overflow_only, {"exact_rollback": True}),
    ):
        progress(f"overlap: {system}")
        try:
            times, computes = _restoring(functools.partial(_run_aoffload, groups, plan, options))
        except Exception as exc:  # noqa: BLE001 - an aoffload error is a failure, reported
            report.fail(SECTION, system, exc)
            continue
        measured[system] = _collect(plan, times)
        own[system] = _collect(plan, computes)

    report.notes.append(
        f"overlap: the backward is simulated; sub-group i's gradient is ready (i + 1) * t_b / "
        f"{SUBGROUPS} after the step starts, waited for with time.sleep by every system (for "
        "aoffload's CPUAdam on the event loop's thread, which does not turn until the step "
        "awaits drain(); the 'backward alone' row shows the wait's own overshoot); t_adam is "
        "the optimizer part of the sequential steps; the overflow is declared after the step, "
        "the gradients stay finite"
    )
    figures = report_steps(report, measured, t_adam, (default, alternative))
    report_own(report, figures, own, t_adam, (default, alternative))
