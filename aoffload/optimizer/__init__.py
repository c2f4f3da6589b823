"""The CPU optimizer: :class:`CPUAdam`, :class:`OffloadAdam` and the worker behind both.

- :mod:`._core`: the trainer's side without a loop (:class:`~._core.OptimizerCore`):
  thread-safe submits, registrations, state transfers; outcomes recorded by the worker
  core's reader thread;
- :mod:`._cpu_adam`: :class:`CPUAdam`, the asyncio face on that core;
- :mod:`._results`: step results, their thread-safe record and the stream that hands them out;
- :mod:`._subgroups`, :mod:`._state`: sub-group registration and the state-dict transfer;
- :mod:`._waits`: how the asyncio faces wait; :mod:`._affinity`: splitting the CPUs;
- :mod:`.worker`: the worker process (its calls, service, backends, stepping threads and
  DeepSpeed's op); it imports nothing of the trainer's side;
- :mod:`.offload`: :class:`OffloadAdam`, a ``torch.optim`` optimizer on that core.
"""

from __future__ import annotations

import typing as _typing

from .._lazy import exports as _exports

# Imported on first use (PEP 562): the optimizer's worker imports its service
# (:mod:`.worker`), not the trainer's side.
if _typing.TYPE_CHECKING:
    from ._cpu_adam import CPUAdam as CPUAdam
    from ._results import StepKind as StepKind
    from ._results import StepResult as StepResult
    from ._results import StepResults as StepResults
    from .offload._optimizer import OffloadAdam as OffloadAdam
    from .offload._step import StepReport as StepReport
else:
    _LAZY = {
        "CPUAdam": "._cpu_adam",
        "OffloadAdam": ".offload._optimizer",
        "StepReport": ".offload._step",
        "StepKind": "._results",
        "StepResult": "._results",
        "StepResults": "._results",
    }

    __getattr__, __dir__ = _exports(__name__, globals(), _LAZY)


__all__ = ("CPUAdam", "OffloadAdam", "StepKind", "StepReport", "StepResult", "StepResults")
