"""The CPU optimizer: :class:`CPUAdam` and the trainer/worker processes behind it.

- :mod:`._core`: the trainer's side without a loop (:class:`~._core.OptimizerCore`):
  thread-safe submits, registrations, state transfers; outcomes recorded by the worker
  core's reader thread;
- :mod:`._cpu_adam`: :class:`CPUAdam`, the asyncio face on that core;
- :mod:`._results`: step results, their thread-safe record and the stream that hands them out;
- :mod:`._subgroups`, :mod:`._state`: sub-group registration and the state-dict transfer;
- :mod:`._calls`: the configuration and typed calls sent to the worker;
- :mod:`._service`: the worker service; :mod:`._backends`: its torch and DeepSpeed math;
- :mod:`._affinity`: splitting the process's CPUs between trainer and worker.
"""

from ._cpu_adam import CPUAdam as CPUAdam
from ._results import StepKind as StepKind
from ._results import StepResult as StepResult
from ._results import StepResults as StepResults

__all__ = ("CPUAdam", "StepKind", "StepResult", "StepResults")
