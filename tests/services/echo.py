"""The diagnostic worker the bridge tests talk to: the benchmark's echo service plus faults.

It is a real worker served by the real bridge, so the tests that use it exercise the
real spawn, pipes, reads, death detection and shutdown. Faults are injected through
its calls and its start configuration, never by mocking the bridge.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aoffload._runtime.protocol import Call
from aoffload._runtime.serve import Handler, target
from aoffload.bench._echo import Alloc, Echo, EchoService, Sleep

__all__ = [
    "TARGET",
    "Alloc",
    "CudaProbe",
    "Describe",
    "Echo",
    "EchoConfig",
    "EchoLarge",
    "Exit",
    "Log",
    "Pid",
    "Print",
    "Raise",
    "Sleep",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EchoLarge(Call[object]):
    """:class:`Echo` under another name, for the tests of large requests."""

    value: object = None


@dataclass(frozen=True, slots=True)
class Raise(Call[None]):
    """Raise a ValueError with ``message`` in the worker."""

    message: str


@dataclass(frozen=True, slots=True)
class Print(Call[None]):
    """Print ``text`` to the worker's stdout (a stray print the protocol must survive)."""

    text: str


@dataclass(frozen=True, slots=True)
class Log(Call[None]):
    """Log ``text`` at WARNING in the worker."""

    text: str


@dataclass(frozen=True, slots=True)
class Exit(Call[None]):
    """Exit the worker at once with ``code``, without replying."""

    code: int


@dataclass(frozen=True, slots=True)
class Pid(Call[int]):
    """The worker's pid."""


@dataclass(frozen=True, slots=True)
class Describe(Call[dict[str, Any]]):
    """What the worker inherited: parent, environment variable ``variable``, cwd, umask,
    CPU affinity, torch's thread count, nice value and scheduling policy."""

    variable: str = ""


@dataclass(frozen=True, slots=True)
class CudaProbe(Call[str]):
    """Initialise CUDA in the worker and run a kernel; the device's name."""


@dataclass(frozen=True, slots=True)
class EchoConfig:
    """How the echo worker starts: ``fail_on_start`` raises during construction."""

    fail_on_start: bool = False
    start_delay: float = 0.0


class FaultyEchoService(EchoService):
    """The echo service, plus calls that fail, print, log and exit."""

    def __init__(self, config: EchoConfig | None) -> None:
        super().__init__()
        config = config or EchoConfig()
        if config.start_delay:
            time.sleep(config.start_delay)
        if config.fail_on_start:
            raise RuntimeError("echo service configured to fail on start")

    def handlers(self) -> Mapping[type[Call[Any]], Handler]:
        return {
            **super().handlers(),
            EchoLarge: lambda call: call.value,
            Raise: self._raise,
            Print: lambda call: print(call.text),
            Log: lambda call: logger.warning("%s", call.text),
            Exit: lambda call: os._exit(call.code),
            Pid: lambda call: os.getpid(),
            Describe: self._describe,
            CudaProbe: self._cuda,
        }

    @staticmethod
    def _describe(call: Describe) -> dict[str, Any]:
        import torch

        umask = os.umask(0)
        os.umask(umask)
        return {
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "variable": os.environ.get(call.variable),
            "cwd": os.getcwd(),
            "umask": umask,
            "affinity": os.sched_getaffinity(0),
            "threads": torch.get_num_threads(),
            "nice": os.getpriority(os.PRIO_PROCESS, 0),
            "policy": os.sched_getscheduler(0),
            "main": getattr(sys.modules["__main__"], "__file__", None),
        }

    @staticmethod
    def _cuda(call: CudaProbe) -> str:
        import torch

        x = torch.ones(1 << 20, device="cuda")
        if float((x * 2).sum()) != 2.0 * (1 << 20):
            raise RuntimeError("a CUDA kernel in the worker computed a wrong sum")
        return torch.cuda.get_device_name()

    @staticmethod
    def _raise(call: Raise) -> None:
        raise ValueError(call.message)


TARGET = target(FaultyEchoService)
"""The name a bridge spawns the service by."""
