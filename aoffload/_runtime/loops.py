"""The choice of event loop, made once: uvloop when installed, else asyncio's own.

:func:`run` is the public ``aoffload.run``; :func:`new_event_loop` is what the
synchronous adapters' portal runs on.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["loop_factory", "new_event_loop", "run"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """uvloop's ``new_event_loop`` when uvloop is installed, else asyncio's."""
    # Looked up, not imported in a try/except: an ImportError caught here would be chained
    # (as "During handling of the above exception...") to every error of the user's code.
    if importlib.util.find_spec("uvloop") is None:
        logger.debug("uvloop is not installed; using asyncio's default loop")
        return asyncio.new_event_loop
    import uvloop

    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop of the preferred kind (see :func:`loop_factory`)."""
    return loop_factory()()


def run(main: Coroutine[Any, Any, _T], *, debug: bool | None = None) -> _T:
    """Run ``main`` to completion on uvloop when it is installed, else on asyncio's loop.

    Like :func:`asyncio.run`, this creates a fresh event loop, closes it afterwards and
    never changes the global event-loop policy.
    """
    with asyncio.Runner(debug=debug, loop_factory=loop_factory()) as runner:
        return runner.run(main)
