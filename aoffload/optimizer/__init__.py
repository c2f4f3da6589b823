"""The CPU optimizer: :class:`CPUAdam` and the trainer/worker processes behind it.

- :mod:`._core`: the trainer's side without a loop (:class:`~._core.OptimizerCore`):
  thread-safe submits, registrations, state transfers; outcomes recorded by the worker
  core's reader thread;
- :mod:`._cpu_adam`: :class:`CPUAdam`, the asyncio face on that core;
- :mod:`._results`: step results, their thread-safe record and the stream that hands them out;
- :mod:`._subgroups`, :mod:`._state`: sub-group registration and the state-dict transfer;
- :mod:`._calls`: the configuration and typed calls sent to the worker;
- :mod:`._service`: the worker service; :mod:`._backends`: its torch and DeepSpeed math;
  :mod:`._deepspeed_op`: DeepSpeed's op, from its stamped build or through DeepSpeed
  (:mod:`._deepspeed_start`);
- :mod:`._affinity`: splitting the process's CPUs between trainer and worker;
- :mod:`._offload_adam`: :class:`OffloadAdam`, a ``torch.optim`` optimizer on that core,
  with :mod:`._offloader` (buckets, hooks, submits), :mod:`._buckets`, :mod:`._offload_step`
  (the speculative step), :mod:`._offload_state` (its state dict) and :mod:`._cuda`.
"""

from __future__ import annotations

import typing as _typing

from .._lazy import exports as _exports

# Imported on first use (PEP 562): the optimizer's worker imports its service
# (:mod:`._service`, :mod:`._backends`, :mod:`._calls`), not the trainer's side.
if _typing.TYPE_CHECKING:
    from ._cpu_adam import CPUAdam as CPUAdam
    from ._offload_adam import OffloadAdam as OffloadAdam
    from ._offload_step import StepReport as StepReport
    from ._results import StepKind as StepKind
    from ._results import StepResult as StepResult
    from ._results import StepResults as StepResults
else:
    _LAZY = {
        "CPUAdam": "._cpu_adam",
        "OffloadAdam": "._offload_adam",
        "StepReport": "._offload_step",
        "StepKind": "._results",
        "StepResult": "._results",
        "StepResults": "._results",
    }

    __getattr__, __dir__ = _exports(__name__, globals(), _LAZY)


__all__ = ("CPUAdam", "OffloadAdam", "StepKind", "StepReport", "StepResult", "StepResults")
