"""What the optimizer's worker does before it loads DeepSpeed's CPU Adam op through DeepSpeed
(worker side; :mod:`._deepspeed_op` decides when that is needed).

Two things, both confined to the worker process:

* DeepSpeed logs ``Setting accelerator to CPU. If you have GPU or other accelerator, we
  were unable to detect it.`` as a warning when it finds no GPU. The worker runs a CPU
  optimizer, so the CPU accelerator is the right one: that one message is filtered out of
  DeepSpeed's logger; every other DeepSpeed record passes;
* DeepSpeed's op builder asks ``cpuinfo.get_cpu_info()`` for the CPU's architecture and
  SIMD width each time it loads the op (twice or more per load), and each call runs a
  fresh Python interpreter. The worker asks once, on a thread started before DeepSpeed is
  imported, so that interpreter runs while the worker imports DeepSpeed, and every later
  call returns the same answer.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
from typing import Any

__all__ = ["AcceleratorNoticeFilter", "prepare_deepspeed"]

logger = logging.getLogger(__name__)

_DEEPSPEED_LOGGER = "DeepSpeed"
_NOTICE = "Setting accelerator to CPU."


class AcceleratorNoticeFilter(logging.Filter):
    """Drops DeepSpeed's warning that it fell back to the CPU accelerator, and only it."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether ``record`` is logged."""
        return not (record.levelno == logging.WARNING and record.getMessage().startswith(_NOTICE))


class _OnceCpuInfo:
    """``cpuinfo.get_cpu_info``, asked once per process; later callers wait for that answer."""

    def __init__(self, ask: Any) -> None:
        self._ask = ask
        self._lock = threading.Lock()
        self._info: dict[str, Any] | None = None

    def __call__(self) -> dict[str, Any]:
        with self._lock:
            if self._info is None:
                self._info = dict(self._ask())
            return dict(self._info)


def prepare_deepspeed() -> None:
    """Quiet the accelerator notice, start asking for the CPU's info; idempotent."""
    logger = logging.getLogger(_DEEPSPEED_LOGGER)
    if not any(isinstance(f, AcceleratorNoticeFilter) for f in logger.filters):
        logger.addFilter(AcceleratorNoticeFilter())
    if importlib.util.find_spec("cpuinfo") is None:
        return  # DeepSpeed falls back to lscpu by itself
    cpuinfo: Any = importlib.import_module("cpuinfo")
    if isinstance(cpuinfo.get_cpu_info, _OnceCpuInfo):
        return
    once = _OnceCpuInfo(cpuinfo.get_cpu_info)
    cpuinfo.get_cpu_info = once  # DeepSpeed imports it from the module at each call
    threading.Thread(target=_ask, args=(once,), name="aoffload-cpu-info", daemon=True).start()


def _ask(once: _OnceCpuInfo) -> None:
    try:
        once()
    except Exception:
        logger.debug("cpuinfo.get_cpu_info() failed ahead of DeepSpeed's op build", exc_info=True)
