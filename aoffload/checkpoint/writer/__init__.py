"""The writer process's side of checkpointing: everything here runs in the worker.

- :mod:`.calls`: the calls the trainer sends and their answers (pure data, imported by
  both sides), and the name the writer is spawned by (``TARGET``);
- :mod:`.service`: :class:`~.service.WriterService`, the worker's service;
- :mod:`.sink`: the hashing, ``O_DIRECT``, double-buffered file sink;
- :mod:`.loader`: loading a file for the trainer when its pickle is large;
- :mod:`.watch`: a dead distributed trainer's last word, said by its writer.

Nothing here imports the trainer's side of the wing; it reads the on-disk format
(``format/``), as the trainer does.
"""
