"""The on-disk format of a checkpoint directory, and every operation on it. No torch.

- :mod:`.layout`: what a directory holds (names, the manifest's record, a scan) and the
  checks of what reaches it from outside;
- :mod:`.paths`: path operations that never follow a link below the directory;
- :mod:`.read`: manifests, ``latest``, verified files, the scan at start;
- :mod:`.write`: publish a tag, move ``latest``, retire, gather ranks' files;
- :mod:`.lock`: the directory locks; :mod:`.shm`: the ``/dev/shm`` files aoffload makes;
- :mod:`.metadata`: commit metadata;
- :mod:`.inspect`: what the command line shows (``aoffload ls|verify|inspect|clean``).

The trainer's side, the writer process and the command line all read it; it imports
nothing of theirs.
"""
