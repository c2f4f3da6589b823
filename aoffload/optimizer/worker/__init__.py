"""The CPU optimizer's worker process: everything here runs in the worker.

- :mod:`._calls`: the configuration and the typed calls the trainer sends, and their
  answers (pure data, imported by both sides);
- :mod:`._service`: :class:`~._service.AdamService`, the worker's service, with its
  backends (:mod:`._backend`, :mod:`._torch_backend`,
  :mod:`._deepspeed_backend`) and its stepping threads (:mod:`._stepper`);
- :mod:`._deepspeed_op`: DeepSpeed's CPU Adam op, from its stamped build or through
  DeepSpeed (:mod:`._deepspeed_start`).

Nothing here imports the trainer's side of the wing.
"""

from ._service import TARGET as TARGET

__all__ = ("TARGET",)
