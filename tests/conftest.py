"""Shared test set-up: every async test runs on asyncio's loop and on uvloop, in debug mode,
and fails if the library blocks the event loop for longer than ``SLOW_CALLBACK_SECONDS``:
a slow callback (asyncio's debug mode), or a loop kept from waking while it waits in
``select()``, by another thread holding the GIL (a ticker on the loop: tests/_loop_ticker.py).

The guard also watches the loops a synchronous test starts itself (``asyncio.run``,
``aoffload.run``). A test that blocks the loop on purpose (a synchronous training step
between ``stage()`` and its fence) is marked ``blocks_loop``: the guard leaves it alone.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import importlib.util
import logging
import os
import re
from collections.abc import Callable, Iterator, Mapping

import pytest

import aoffload.testing
from aoffload.testing import loop_factories
from tests._bench_run import BenchRun, BenchSmoke, start_bench_smoke
from tests._loop_ticker import LoopTicker, queued_since, report_to

SLOW_CALLBACK_SECONDS = float(os.environ.get("AOFFLOAD_TEST_SLOW_CALLBACK", "0.05"))
_TOOK = re.compile(r" took (\d+(?:\.\d+)?) seconds$")


def pytest_configure(config: pytest.Config) -> None:
    # Installed, aoffload registers its plugin through the `pytest11` entry point; a checkout
    # that is not installed (or a run with plugin autoloading off) gets it here.
    if not config.pluginmanager.is_registered(aoffload.testing):
        config.pluginmanager.register(aoffload.testing, "aoffload")


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    factories = loop_factories(slow_callback_duration=SLOW_CALLBACK_SECONDS)
    return {name: _ticking(factory) for name, factory in factories.items()}


@functools.cache
def _ticking(
    factory: Callable[[], asyncio.AbstractEventLoop],
) -> Callable[[], asyncio.AbstractEventLoop]:
    # One wrapper per factory, however often the hook asks: pytest-asyncio shares a module-
    # or session-scoped loop only between tests whose factories are equal.
    def new_loop() -> asyncio.AbstractEventLoop:
        loop = factory()
        LoopTicker(loop, SLOW_CALLBACK_SECONDS)
        return loop

    return new_loop


class LoopBlockGuard(logging.Handler):
    """Collects asyncio's "Executing <callback> took N seconds" debug-mode warnings, each
    less the time the loop's thread waited for a CPU meanwhile (tests/_loop_ticker.py):
    another process keeping a core busy is not the library blocking the loop."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.slow: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        took = _TOOK.search(message)
        if not message.startswith("Executing ") or took is None:
            return
        seconds = float(took.group(1))  # emitted on the loop's thread, right after the callback
        queued = queued_since(seconds)
        if seconds - queued > SLOW_CALLBACK_SECONDS:
            self.slow.append(
                f"{message} (no thread waited more than {queued * 1e3:.0f} ms for a CPU)"
            )


@pytest.fixture(autouse=True, scope="session")
def _frozen_heap() -> None:
    """Move everything imported so far (torch, pytest) out of the collector's reach, so a
    full garbage collection of the test process's heap is not mistaken for the library
    blocking the loop.

    Before that, the first ``torch.testing.assert_close`` runs here: it imports
    ``torch.distributed.tensor`` and sympy (1-2 s), which a test calling it on its loop
    would otherwise be blamed for."""
    import torch

    torch.testing.assert_close(torch.zeros(1), torch.zeros(1))
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _heap_frozen_before_each_test(_frozen_heap: None) -> None:
    """The same before each test, for what earlier tests left alive (a long session's heap
    grows): the garbage is collected here, outside any loop, and what lives on is frozen, so a
    collection during the test (on whatever thread) only walks the test's own objects. In a
    full run a test's loop once waited 79 ms for the GIL; such a collection on another thread
    is the likely holder (not verified)."""
    gc.collect()
    gc.freeze()


def _guarded(
    factory: Callable[[], asyncio.AbstractEventLoop],
) -> Callable[[], asyncio.AbstractEventLoop]:
    def new_loop() -> asyncio.AbstractEventLoop:
        loop = factory()
        loop.set_debug(True)
        loop.slow_callback_duration = SLOW_CALLBACK_SECONDS
        LoopTicker(loop, SLOW_CALLBACK_SECONDS)
        return loop

    return new_loop


@pytest.fixture(autouse=True)
def loop_block_guard(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[LoopBlockGuard]:
    """Fails the test if any callback or task step blocked the event loop too long."""
    guard = LoopBlockGuard()
    asyncio_logger = logging.getLogger("asyncio")
    asyncio_logger.addHandler(guard)
    # The loops a synchronous test makes itself: asyncio.run and aoffload.run.
    monkeypatch.setattr(asyncio.events, "new_event_loop", _guarded(asyncio.events.new_event_loop))
    monkeypatch.setattr(asyncio, "new_event_loop", _guarded(asyncio.new_event_loop))
    if importlib.util.find_spec("uvloop") is not None:
        import uvloop

        monkeypatch.setattr(uvloop, "new_event_loop", _guarded(uvloop.new_event_loop))
    report_to(guard.slow.append)
    try:
        yield guard
    finally:
        report_to(None)
        asyncio_logger.removeHandler(guard)
    if guard.slow and request.node.get_closest_marker("blocks_loop") is None:
        pytest.fail(
            f"the event loop was blocked for more than {SLOW_CALLBACK_SECONDS * 1000:.0f} ms:\n"
            + "\n".join(guard.slow),
            pytrace=False,
        )


_smoke: list[BenchSmoke] = []


def _reads_smoke(item: pytest.Item) -> bool:
    return "bench_smoke" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The tests that read the smoke run go last: it runs beside all the others meanwhile.
    items.sort(key=_reads_smoke)


def pytest_collection_finish(session: pytest.Session) -> None:
    # The smoke run starts in the background now, if a test that reads it was selected.
    if not session.config.option.collectonly and any(map(_reads_smoke, session.items)):
        _smoke.append(start_bench_smoke())


def pytest_sessionfinish(session: pytest.Session) -> None:
    while _smoke:
        _smoke.pop().stop()


@pytest.fixture(scope="session")
def bench_smoke() -> BenchRun:
    """``python -m aoffload.bench all --smoke``, run once for every test that reads it (the
    longest run of the suite: about 90 s of one core), started in the background when the
    suite was collected (tests/_bench_run.py)."""
    if not _smoke:
        _smoke.append(start_bench_smoke())
    return _smoke[0].wait()
