"""The loop guard's clock: what blocked the event loop, less what the machine took from it.

asyncio's debug mode times each callback, so it names a callback that blocks the loop. It
cannot see a loop waiting in ``select()`` whose wake-up is held back: a library thread that
holds the GIL (a long C call that does not release it, a garbage collection) keeps the loop
from running its ready callbacks, and no callback is slow. So each guarded loop also runs a
callback every :data:`PERIOD` and measures how late it runs.

Both clocks are wall clocks, and on a busy host (another process keeping a core busy) the
kernel can leave the loop's thread waiting for a CPU for tens of milliseconds, inside a
callback or before a wake-up; or leave waiting the thread that holds the GIL the loop wants:
then the machine, not this process, held up the loop. So both figures are taken less the
longest time any thread of this process waited on the run queue in the same span (each
thread's ``/proc/self/task/TID/schedstat``). The ticker records those counters at each tick,
so that a slow callback's span can be matched (:func:`queued_since`). On a quiet host nothing
waits and the guard is exact; on a busy one it excuses what the machine may have caused.
Ticking only while the loop runs: its ``run_forever`` arms the ticker and disarms it when it
returns.
"""

from __future__ import annotations

import asyncio
import bisect
import os
import threading
import time
from collections.abc import Callable

__all__ = ["PERIOD", "LoopTicker", "queued_since", "report_to", "run_delays", "waited"]

PERIOD = 0.02
"""Seconds between ticks (each reads every thread's counters: about 0.2 ms for 30 threads)."""
_KEEP = 500
"""Ticks remembered per loop thread (10 s): a slow callback's span is matched among them."""

_REPORT: list[Callable[[str], None]] = []
_SAMPLES: dict[int, tuple[list[float], list[dict[int, float]]]] = {}
"""Per loop thread: the monotonic times of its recent ticks, and every thread's run-queue
delay then."""


def report_to(report: Callable[[str], None] | None) -> Callable[[str], None] | None:
    """Where a late tick is reported (the current test's guard), or nowhere; the previous."""
    previous = _REPORT[0] if _REPORT else None
    _REPORT[:] = [] if report is None else [report]
    return previous


def run_delays() -> dict[int, float]:
    """Seconds each thread of this process has waited for a CPU, by thread id (empty where
    not known)."""
    delays = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return {}
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/schedstat", "rb") as stats:
                delays[int(tid)] = int(stats.read().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
            continue
    return delays


def waited(before: dict[int, float], after: dict[int, float]) -> float:
    """The longest any thread waited for a CPU between two :func:`run_delays` (a thread
    started meanwhile: all its wait, as for the one a ``Thread.start()`` waits for)."""
    return max((delay - before.get(tid, 0.0) for tid, delay in after.items()), default=0.0)


def _sample() -> dict[int, float]:
    times, delays = _SAMPLES.setdefault(threading.get_ident(), ([], []))
    now = run_delays()
    times.append(time.monotonic())
    delays.append(now)
    if len(times) > 2 * _KEEP:
        del times[:_KEEP], delays[:_KEEP]
    return now


def queued_since(seconds: float) -> float:
    """The longest any thread waited for a CPU over about the last ``seconds``: since this
    (loop) thread's last tick at least that long ago (an overestimate by less than a period,
    so a callback is never charged for the machine's time; 0 where no tick is that old)."""
    times, delays = _SAMPLES.get(threading.get_ident(), ([], []))
    index = bisect.bisect_right(times, time.monotonic() - seconds) - 1
    return waited(delays[index], run_delays()) if index >= 0 else 0.0


class LoopTicker:
    """Ticks on ``loop`` while it runs; a tick late by more than ``threshold`` seconds beyond
    its thread's own wait for a CPU is reported."""

    def __init__(self, loop: asyncio.AbstractEventLoop, threshold: float) -> None:
        self._loop = loop
        self._threshold = threshold
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0
        self._queued: dict[int, float] = {}
        run_forever = loop.run_forever

        def ticking_run_forever() -> None:
            self._arm()
            try:
                run_forever()
            finally:
                self._disarm()

        loop.run_forever = ticking_run_forever  # type: ignore[method-assign]

    def _arm(self) -> None:
        self._queued = _sample()
        self._due = time.monotonic() + PERIOD
        self._handle = self._loop.call_later(PERIOD, self._tick)

    def _disarm(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _tick(self) -> None:
        late = time.monotonic() - self._due
        queued = waited(self._queued, run_delays())
        # the loop's own threshold where it has one: a test that raises it for a step that
        # blocks the loop on purpose raises it for the ticker too
        threshold = getattr(self._loop, "slow_callback_duration", self._threshold)
        if late - queued > threshold and _REPORT:
            _REPORT[0](
                f"the event loop woke {late * 1e3:.0f} ms late (no thread of this process waited "
                f"more than {queued * 1e3:.0f} ms of it for a CPU): for "
                f"{(late - queued) * 1e3:.0f} ms something in this process kept it from "
                "running, a slow callback or another thread holding the GIL"
            )
        self._arm()
