"""The loop guard's clock: what blocked the event loop, less what the machine took from it.

asyncio's debug mode times each callback, so it names a callback that blocks the loop. It
cannot see a loop waiting in ``select()`` whose wake-up is held back: a library thread that
holds the GIL (a long C call that does not release it, a garbage collection) keeps the loop
from running its ready callbacks, and no callback is slow. So each guarded loop also runs a
callback every :data:`PERIOD` and measures how late it runs.

Both clocks are wall clocks, and on a busy host (another process keeping a core busy) the
kernel can leave the loop's thread waiting for a CPU for tens of milliseconds, inside a
callback or before a wake-up: no thread of this process blocked the loop then. So both
figures are taken less the time the loop's thread waited on the run queue in the same span
(``/proc/thread-self/schedstat``); the ticker records that counter at each tick, so that a
slow callback's span can be matched (:func:`queued_since`). Ticking only while the loop runs:
its ``run_forever`` arms the ticker and disarms it when it returns.
"""

from __future__ import annotations

import asyncio
import bisect
import threading
import time
from collections.abc import Callable

__all__ = ["PERIOD", "LoopTicker", "queued_since", "report_to", "run_delay"]

PERIOD = 0.01
"""Seconds between ticks."""
_KEEP = 1000
"""Ticks remembered per loop thread (10 s): a slow callback's span is matched among them."""

_REPORT: list[Callable[[str], None]] = []
_SAMPLES: dict[int, tuple[list[float], list[float]]] = {}
"""Per loop thread: the monotonic times of its recent ticks, and its run-queue delay then."""


def report_to(report: Callable[[str], None] | None) -> Callable[[str], None] | None:
    """Where a late tick is reported (the current test's guard), or nowhere; the previous."""
    previous = _REPORT[0] if _REPORT else None
    _REPORT[:] = [] if report is None else [report]
    return previous


def run_delay() -> float:
    """Seconds this thread has waited for a CPU since it started (0 where not known)."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as stats:
            return int(stats.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _sample() -> None:
    times, delays = _SAMPLES.setdefault(threading.get_ident(), ([], []))
    times.append(time.monotonic())
    delays.append(run_delay())
    if len(times) > 2 * _KEEP:
        del times[:_KEEP], delays[:_KEEP]


def queued_since(seconds: float) -> float:
    """How long this (loop) thread waited for a CPU over about the last ``seconds``: since
    the last tick at least that long ago (an overestimate by less than a period, so a
    callback is never charged for the machine's time; 0 where no tick is that old)."""
    times, delays = _SAMPLES.get(threading.get_ident(), ([], []))
    index = bisect.bisect_right(times, time.monotonic() - seconds) - 1
    return run_delay() - delays[index] if index >= 0 else 0.0


class LoopTicker:
    """Ticks on ``loop`` while it runs; a tick late by more than ``threshold`` seconds beyond
    its thread's own wait for a CPU is reported."""

    def __init__(self, loop: asyncio.AbstractEventLoop, threshold: float) -> None:
        self._loop = loop
        self._threshold = threshold
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0
        self._queued = 0.0
        run_forever = loop.run_forever

        def ticking_run_forever() -> None:
            self._arm()
            try:
                run_forever()
            finally:
                self._disarm()

        loop.run_forever = ticking_run_forever  # type: ignore[method-assign]

    def _arm(self) -> None:
        _sample()
        self._due = time.monotonic() + PERIOD
        self._queued = run_delay()
        self._handle = self._loop.call_later(PERIOD, self._tick)

    def _disarm(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _tick(self) -> None:
        late = time.monotonic() - self._due
        queued = run_delay() - self._queued
        if late - queued > self._threshold and _REPORT:
            _REPORT[0](
                f"the event loop woke {late * 1e3:.0f} ms late ({queued * 1e3:.0f} ms of it "
                f"waiting for a CPU): for {(late - queued) * 1e3:.0f} ms something kept it from "
                "running, a slow callback or another thread holding the GIL"
            )
        self._arm()
