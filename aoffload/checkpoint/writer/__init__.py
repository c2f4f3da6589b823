"""The writer process's side of checkpointing: everything here runs in the worker.

- :mod:`._calls`: the calls the trainer sends and their answers (pure data, imported by
  both sides);
- :mod:`._service`: :class:`~._service.WriterService`, the worker's service;
- :mod:`._sink`: the hashing, ``O_DIRECT``, double-buffered file sink;
- :mod:`._loader`: loading a file for the trainer when its pickle is large.

Nothing here imports the trainer's side of the wing.
"""

from .service import TARGET as TARGET

__all__ = ("TARGET",)
