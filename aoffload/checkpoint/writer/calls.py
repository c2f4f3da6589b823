"""The writer's calls: what the trainer asks of its writer process, and the answers.

Pure data, imported by both sides (the trainer's pipeline and commit, and the writer's
service). Tensors never cross the pipe: a :class:`WriteFile` names where they lie in a
staging segment both processes map.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..._runtime.protocol import Call

TARGET = "aoffload.checkpoint.writer.service:WriterService"
"""The name a bridge spawns the writer by (a name: importing the calls imports no service)."""

__all__ = [
    "TARGET",
    "FileRecord",
    "LoadFile",
    "LoadedFile",
    "MapSegment",
    "SyncTree",
    "TensorRecord",
    "WatchRank",
    "WriteFile",
    "WriterConfig",
]


@dataclass(frozen=True, slots=True)
class WriterConfig:
    """How the writer works: ``durable`` fsyncs; ``direct_io`` tries ``O_DIRECT`` first."""

    durable: bool = True
    direct_io: bool = True


@dataclass(frozen=True, slots=True)
class MapSegment(Call[None]):
    """Map the staging segment at ``path`` (``size`` bytes); later writes name it by path."""

    path: str
    size: int


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """One tensor: a view (``storage_offset``, ``shape``, ``stride``, in elements of
    ``dtype``) of the storage staged at ``offset`` (``nbytes`` long) of a segment. Tensors
    that shared a storage name the same ``offset`` and share it again, as ``torch.save``
    keeps them; ``parameter`` restores an ``nn.Parameter``."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool
    stride: tuple[int, ...] | None = None
    storage_offset: int = 0
    parameter: bool = False


@dataclass(frozen=True, slots=True)
class FileRecord:
    """A written (and, if durable, fsynced) file: its size, xxh3-64 and write time."""

    path: str
    nbytes: int
    xxh3_64: str
    seconds: float


@dataclass(frozen=True, slots=True)
class WriteFile(Call[FileRecord]):
    """Write ``path`` from the skeleton and the tensors staged in ``segment``.

    The skeleton (the state pickled with a persistent id per tensor) lies at
    ``skeleton_offset``, ``skeleton_nbytes`` long: it holds every non-tensor value of
    the state, so it can be large, and like the tensors it travels through staging
    memory, never through the pipe. ``root`` is the checkpoint directory: ``path`` lies
    below it and is opened without following a link below it.
    """

    path: str
    segment: str
    skeleton_offset: int
    skeleton_nbytes: int
    tensors: tuple[TensorRecord, ...]
    root: str = ""


@dataclass(frozen=True, slots=True)
class SyncTree(Call[None]):
    """Fsync ``root`` and every directory below it."""

    root: str


@dataclass(frozen=True, slots=True)
class WatchRank(Call[None]):
    """If the trainer dies before it disarms this (``keys=()``), tell the other ranks.

    A distributed engine's writer outlives a SIGKILLed trainer by a moment (it sees its
    request pipe close): it then sets each of ``keys`` in the commit store at
    ``host:port`` to ``value`` unless a verdict is there already, so the peers'
    ``commit()`` raises at once instead of after ``commit_timeout``. The trainer's side
    chooses the keys (the outcomes of its next commits) and the words.
    """

    host: str = ""
    port: int = 0
    keys: tuple[str, ...] = ()
    value: str = ""


@dataclass(frozen=True, slots=True)
class LoadedFile:
    """A file loaded by a worker: its state's skeleton, and the ``/dev/shm`` files it names.

    The skeleton is the state pickled with a persistent id per tensor and per large
    ``bytes`` value: ``("tensor", offset, nbytes, dtype, shape, stride, storage_offset,
    requires_grad, is_parameter)`` names a storage by where it lies in the file (the
    trainer maps the file itself), ``("bytes", path, nbytes)`` a ``/dev/shm`` file the
    trainer reads and removes.
    """

    skeleton: bytes
    blobs: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class LoadFile(Call[LoadedFile]):
    """Load ``path`` with ``torch.load(weights_only=True)`` and describe it (:class:`LoadedFile`);
    ``safe_globals`` are the trainer's ``torch.serialization.get_safe_globals()``."""

    path: str
    safe_globals: tuple[Any, ...] = ()
