"""The suite's loop guard sees what it is for (tests/conftest.py, tests/_loop_ticker.py).

asyncio's debug mode times callbacks; the ticker also sees a loop kept from waking while it
waits in ``select()``, by another thread holding the GIL, which no callback timing shows.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from ._loop_ticker import LoopTicker, report_to


@pytest.fixture
def late() -> Iterator[list[str]]:
    """What the ticker reports here, instead of the test's guard."""
    seen: list[str] = []
    previous = report_to(seen.append)
    interval = sys.getswitchinterval()
    try:
        yield seen
    finally:
        sys.setswitchinterval(interval)
        report_to(previous)


def _loop_waiting_while(hold: object) -> None:
    """Run a loop that only waits (asyncio.sleep) while a thread runs ``hold()``."""
    loop = asyncio.new_event_loop()
    LoopTicker(loop, 0.05)

    async def wait() -> None:
        thread = threading.Thread(target=hold)  # type: ignore[arg-type]
        thread.start()
        await asyncio.sleep(0.4)
        thread.join()

    try:
        loop.run_until_complete(wait())
    finally:
        loop.close()


@pytest.mark.blocks_loop  # on purpose: the guard's own ticker is the subject
def test_a_thread_holding_the_gil_is_seen_while_the_loop_waits_in_select(
    late: list[str],
) -> None:
    sys.setswitchinterval(1.0)  # the thread keeps the GIL for its whole loop

    def hold() -> None:
        time.sleep(0.05)  # the loop is in select() by now
        deadline = time.perf_counter() + 0.2
        while time.perf_counter() < deadline:  # Python code: it holds the GIL throughout
            pass

    _loop_waiting_while(hold)
    assert late, "a 200 ms GIL stall went unseen"
    assert "kept it from running" in late[0]


def test_a_thread_that_releases_the_gil_is_not_blamed(late: list[str]) -> None:
    _loop_waiting_while(lambda: time.sleep(0.2))
    assert late == []
