"""The uploader process's side of the remote tier: everything here runs in the worker
(and :mod:`._store` in the command line too). Nothing here imports torch.

- :mod:`._store`: one checkpoint directory under an fsspec URL: scan, upload, publish by
  write order, retire, download verified; retries with backoff; credentials scrubbed;
- :mod:`._calls`: the calls the trainer sends and their answers (pure data);
- :mod:`._service`: :class:`~._service.UploaderService`, the worker's service.

The trainer's side is :mod:`.._upload` (one engine's uploads) and :mod:`.._spread` (ranks
that do not share a filesystem).
"""

from .service import TARGET as TARGET

__all__ = ("TARGET",)
