"""The CPU optimizer: :class:`CPUAdam` and the trainer/worker processes behind it.

- :mod:`._cpu_adam`: the trainer's side (register, submit, lifecycle, the CPU split);
- :mod:`._results`: step results and the stream that hands them out;
- :mod:`._calls`: the configuration and typed calls sent to the worker;
- :mod:`._service`: the worker service; :mod:`._backends`: its torch and DeepSpeed math;
- :mod:`._affinity`: splitting the process's CPUs between trainer and worker.
"""

from ._cpu_adam import CPUAdam as CPUAdam
from ._results import StepKind as StepKind
from ._results import StepResult as StepResult
from ._results import StepResults as StepResults

__all__ = ("CPUAdam", "StepKind", "StepResult", "StepResults")
