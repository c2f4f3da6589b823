"""Loading a file in the writer process, for the trainer (a file whose pickle is large).

torch's weights-only unpickler decodes a large non-tensor value (a 64 MB ``bytes``) in
single long calls that hold the GIL, which would stall the trainer's event loop whatever
thread runs them. Such a file is loaded here instead: :func:`load_in_worker` runs
``torch.load(weights_only=True, mmap=True)`` and describes the state for the trainer
(:class:`~.calls.LoadedFile`): tensors by where their storage lies in the file, large
``bytes`` values left in ``/dev/shm`` files. The trainer rebuilds the state from that
(``checkpoint/core/load.py``).
"""

from __future__ import annotations

import io
import itertools
import os
import pickle
from collections.abc import Iterable
from typing import Any

import torch

from ..._errors import CheckpointError
from ..._runtime.census import SHM_DIR
from .calls import LoadedFile, LoadFile

__all__ = ["BLOB_PREFIX", "load_in_worker", "unlink_all"]

BLOB_PREFIX = "aoffload-load-"
"""The ``/dev/shm`` name prefix of the large values a load hands over."""
_BLOB = 1 << 20  # a bytes value this large travels through /dev/shm
_numbers = itertools.count()


def unlink_all(paths: Iterable[str]) -> None:
    """Remove the files ``paths`` (``/dev/shm`` blobs); those already gone are skipped."""
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue


def _mapping_start(path: str) -> int:
    """Where this process mapped ``path`` from its first byte (``torch.load(mmap=True)``)."""
    target = os.path.realpath(path)
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].rstrip("\n") == target and int(fields[2], 16) == 0:
                return int(fields[0].split("-")[0], 16)
    raise CheckpointError(f"{path}: torch.load(mmap=True) left no mapping of the file")


class _Skeleton(pickle.Pickler):
    def __init__(self, file: io.BytesIO, path: str, blobs: list[str]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._path, self._blobs = path, blobs
        self._start: int | None = None  # read once a tensor keeps the mapping alive
        self._size = os.path.getsize(path)

    def persistent_id(self, obj: Any) -> tuple[Any, ...] | None:
        if isinstance(obj, torch.Tensor):
            if self._start is None:
                self._start = _mapping_start(self._path)
            storage = obj.untyped_storage()
            nbytes = storage.nbytes()
            at = storage.data_ptr() - self._start if nbytes else 0
            if not 0 <= at <= self._size - nbytes:
                raise CheckpointError(f"{self._path}: a tensor's storage is not in the file")
            parameter = isinstance(obj, torch.nn.Parameter)
            return ("tensor", at, nbytes, obj.dtype, tuple(obj.shape), obj.stride(),
                    obj.storage_offset(), obj.requires_grad, parameter)  # fmt: skip
        if type(obj) is bytes and len(obj) >= _BLOB:
            blob = f"{SHM_DIR}/{BLOB_PREFIX}{os.getpid()}-{next(_numbers)}"
            fd = os.open(blob, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            self._blobs.append(blob)
            try:
                with memoryview(obj) as view:
                    written = 0
                    while written < len(view):
                        written += os.write(fd, view[written:])
            finally:
                os.close(fd)
            return ("bytes", blob, len(obj))
        return None


def load_in_worker(call: LoadFile, blobs: list[str]) -> LoadedFile:
    """Load ``call.path`` here and describe the state for the trainer.

    The globals the trainer allowed are allowed here too. The ``/dev/shm`` files made for
    large values are added to ``blobs``, so that the worker can remove those the trainer
    never read (a failed call removes its own at once).
    """
    path = call.path
    with torch.serialization.safe_globals(list(call.safe_globals)):
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    made: list[str] = []
    try:
        buffer = io.BytesIO()
        _Skeleton(buffer, path, made).dump(state)
    except BaseException:
        unlink_all(made)
        raise
    finally:
        blobs += made
    return LoadedFile(buffer.getvalue(), tuple(made))
