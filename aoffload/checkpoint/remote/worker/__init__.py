"""The uploader process's side of the remote tier: everything here runs in the worker
(and :mod:`.store` in the command line too). Nothing here imports torch.

- :mod:`.calls`: the calls the trainer sends and their answers (pure data), the uploader's
  retry policy, and the name it is spawned by (``TARGET``);
- :mod:`.store`: one checkpoint directory under an fsspec URL: scan, upload, publish by
  write order, retire, download verified; retries with backoff; credentials scrubbed;
- :mod:`.lanes`: an event loop and a filesystem instance per upload thread;
- :mod:`.service`: :class:`~.service.UploaderService`, the worker's service.

The trainer's side is ``remote/`` above: the tier one engine plugs in.
"""
