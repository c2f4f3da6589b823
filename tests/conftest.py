"""Shared test set-up: every async test runs on asyncio's loop and on uvloop, in debug mode,
and fails if the library blocks the event loop for longer than ``SLOW_CALLBACK_SECONDS``."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
from collections.abc import Callable, Iterator, Mapping

import pytest

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is part of the dev extra
    uvloop = None

SLOW_CALLBACK_SECONDS = float(os.environ.get("AOFFLOAD_TEST_SLOW_CALLBACK", "0.05"))


def _debug_loop(factory: Callable[[], asyncio.AbstractEventLoop]) -> asyncio.AbstractEventLoop:
    loop = factory()
    loop.set_debug(True)
    loop.slow_callback_duration = SLOW_CALLBACK_SECONDS
    return loop


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
        "asyncio": lambda: _debug_loop(asyncio.new_event_loop),
    }
    if uvloop is not None:
        factories["uvloop"] = lambda: _debug_loop(uvloop.new_event_loop)
    return factories


class LoopBlockGuard(logging.Handler):
    """Collects asyncio's "Executing <callback> took N seconds" debug-mode warnings."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.slow: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Executing ") and " took " in message:
            self.slow.append(message)


@pytest.fixture(autouse=True, scope="session")
def _frozen_heap() -> None:
    """Move everything imported so far (torch, pytest) out of the collector's reach, so a
    full garbage collection of the test process's heap is not mistaken for the library
    blocking the loop."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def loop_block_guard() -> Iterator[LoopBlockGuard]:
    """Fails the test if any callback or task step blocked the event loop too long."""
    guard = LoopBlockGuard()
    asyncio_logger = logging.getLogger("asyncio")
    asyncio_logger.addHandler(guard)
    try:
        yield guard
    finally:
        asyncio_logger.removeHandler(guard)
    if guard.slow:
        pytest.fail(
            f"the event loop was blocked for more than {SLOW_CALLBACK_SECONDS * 1000:.0f} ms:\n"
            + "\n".join(guard.slow),
            pytrace=False,
        )
