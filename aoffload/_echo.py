"""A tiny diagnostic service: what the bridge's tests, demo and benchmark talk to.

It is a real worker like the others, served by the same bridge, so the tests that
use it exercise the real spawn, pipes, reader thread, death detection and shutdown.
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)


class EchoOp(enum.Enum):
    """Operations of the echo service."""

    ECHO = "echo"  # payload returned as is
    SLEEP = "sleep"  # payload: seconds to block the worker
    RAISE = "raise"  # payload: message of a ValueError raised in the worker
    ALLOC = "alloc"  # payload: bytes of memory to allocate, touch and hold
    PRINT = "print"  # payload: text printed to the worker's stdout (a stray print)
    LOG = "log"  # payload: text logged at WARNING in the worker
    EXIT = "exit"  # payload: exit code; the worker exits at once without replying
    PID = "pid"  # the worker's pid
    IGNORE_TERM = "ignore_term"  # ignore SIGTERM from now on (tests the shutdown ladder)


@dataclass(frozen=True, slots=True)
class EchoConfig:
    """How the echo worker starts: ``fail_on_start`` raises during construction."""

    fail_on_start: bool = False
    start_delay: float = 0.0


class EchoService:
    """Answers :class:`EchoOp` requests."""

    def __init__(self, config: EchoConfig) -> None:
        if config.start_delay:
            time.sleep(config.start_delay)
        if config.fail_on_start:
            raise RuntimeError("echo service configured to fail on start")
        self._held: list[bytearray] = []

    def handle(self, op: enum.Enum, payload: object) -> object:
        """Run one :class:`EchoOp`."""
        if op is EchoOp.ECHO:
            return payload
        if op is EchoOp.SLEEP and isinstance(payload, (int, float)):
            time.sleep(payload)
            return None
        if op is EchoOp.RAISE:
            raise ValueError(str(payload))
        if op is EchoOp.ALLOC and isinstance(payload, int):
            block = bytearray(payload)
            view = memoryview(block)
            for offset in range(0, payload, 4096):
                view[offset] = 1
            self._held.append(block)
            return len(block)
        if op is EchoOp.PRINT:
            print(payload)  # deliberately stray: the bridge must keep the protocol intact
            return None
        if op is EchoOp.LOG:
            logger.warning("%s", payload)
            return None
        if op is EchoOp.EXIT and isinstance(payload, int):
            os._exit(payload)
        if op is EchoOp.PID:
            return os.getpid()
        if op is EchoOp.IGNORE_TERM:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            return None
        raise ValueError(f"the echo service has no operation {op!r} with payload {payload!r}")

    def close(self) -> None:
        """Drop held memory."""
        self._held.clear()


def create(config: object) -> EchoService:
    """Worker-side factory named by ``"aoffload._echo:create"``."""
    return EchoService(config if isinstance(config, EchoConfig) else EchoConfig())


TARGET = f"{__name__}:create"
