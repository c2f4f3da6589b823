"""A tiny service for the bridge benchmark: echo a value, sleep, hold memory.

It is a real worker served by the real bridge, so the benchmark measures the real
spawn, pipes, reads and death detection. The test suite extends it with fault
injection (``tests/services/echo.py``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._runtime.protocol import Call
from .._runtime.serve import Handler, Service, target

__all__ = ["TARGET", "Alloc", "Echo", "EchoService", "Sleep"]


@dataclass(frozen=True, slots=True)
class Echo(Call[object]):
    """Return ``value`` as is."""

    value: object = None


@dataclass(frozen=True, slots=True)
class Sleep(Call[None]):
    """Block the worker for ``seconds``."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Alloc(Call[int]):
    """Allocate, touch and hold ``nbytes`` of memory; returns the size held."""

    nbytes: int


class EchoService(Service):
    """Answers :class:`Echo`, :class:`Sleep` and :class:`Alloc`."""

    def __init__(self, config: object = None) -> None:
        self._held: list[bytearray] = []

    def handlers(self) -> Mapping[type[Call[Any]], Handler]:
        """Echo, sleep, alloc."""
        return {Echo: self._echo, Sleep: self._sleep, Alloc: self._alloc}

    def _echo(self, call: Echo) -> object:
        return call.value

    def _sleep(self, call: Sleep) -> None:
        time.sleep(call.seconds)

    def _alloc(self, call: Alloc) -> int:
        block = bytearray(call.nbytes)
        view = memoryview(block)
        for offset in range(0, call.nbytes, 4096):
            view[offset] = 1
        self._held.append(block)
        return len(block)

    def close(self) -> None:
        """Drop held memory."""
        self._held.clear()


TARGET = target(EchoService)
"""The name a bridge spawns the service by."""
