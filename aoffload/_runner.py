"""``aoffload.run``: run a coroutine on the fastest available event loop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


def run(main: Coroutine[Any, Any, _T], *, debug: bool | None = None) -> _T:
    """Run ``main`` to completion on uvloop when it is installed, else on asyncio's loop.

    Like :func:`asyncio.run`, this creates a fresh event loop, closes it afterwards and
    never changes the global event-loop policy.
    """
    try:
        import uvloop
    except ImportError:
        logger.debug("uvloop is not installed; running on asyncio's default loop")
        return asyncio.run(main, debug=debug)
    return uvloop.run(main, debug=debug)
