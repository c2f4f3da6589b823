"""The writer's calls: what the trainer asks of its writer process, and the answers.

Pure data, imported by both sides (the trainer's pipeline and commit, and the writer's
service); no torch. Tensors never cross the pipe: a :class:`WriteRecords` names where
their bytes lie in the staging segments both processes map (:class:`Span`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..._runtime.protocol import Call, Wire

TARGET = "aoffload.checkpoint.writer.service:WriterService"
"""The name a bridge spawns the writer by (a name: importing the calls imports no service)."""

__all__ = [
    "LARGE_BUFFERS",
    "LARGE_CAP",
    "TARGET",
    "Blob",
    "Data",
    "FileRecord",
    "LoadFile",
    "LoadedFile",
    "MapSegment",
    "AbortFile",
    "FeedFile",
    "RawRecord",
    "Record",
    "Span",
    "Streamed",
    "SyncTree",
    "TorchRecord",
    "UnmapSegment",
    "WatchRank",
    "WriteRecords",
    "WriterConfig",
    "staging_room",
]

LARGE_CAP = 512 << 20
"""The smallest staging cap that pays for the writer's large write buffers: its large files
(:data:`~.sink.LARGE_FILE` or more) are then written in 64 MiB writes, and the engine
keeps :data:`LARGE_BUFFERS` of its cap for them (at most a quarter of it). A smaller cap
says memory is scarce: the writer keeps its 16 MiB buffers, outside the cap."""
LARGE_BUFFERS = 128 << 20
"""The writer's pair of 64 MiB write buffers (:data:`~.sink.LARGE_BOUNCE_BYTES`), which one
file at a time may use."""


def staging_room(cap: int) -> int:
    """What an engine's staging cap leaves for its staging chunks: the cap less the
    writer's large buffers where the cap pays for them (:data:`LARGE_CAP`), else all of it."""
    return cap - LARGE_BUFFERS if cap >= LARGE_CAP else cap


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
class UnmapSegment(Call[None]):
    """Unmap the staging segment at ``path`` (as a :class:`MapSegment` named it), if
    mapped: its memory can go once its owner drops it (the DCP route's stagers)."""

    path: str


@dataclass(frozen=True, slots=True)
class Span(Wire):
    """``nbytes`` bytes at ``offset`` of the staging segment at ``segment`` (its path, as
    in the :class:`MapSegment` that mapped it)."""

    segment: str
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Streamed(Wire):
    """``nbytes`` bytes that arrive later, through :class:`FeedFile` calls for the file."""

    nbytes: int


Data = Span | bytes | Streamed
"""A record's bytes: a span of staging memory, bytes carried in the call (small ones), or
bytes streamed in later (:class:`FeedFile`)."""


@dataclass(frozen=True, slots=True)
class Blob(Wire):
    """A ``bytes`` value of the state that the writer encodes into a pickle.

    ``data`` is the value itself; it goes at offset ``at`` of the record's pickle
    (counted in the pickle as sent), encoded as ``torch.save`` (pickle protocol 2) encodes
    a ``bytes`` value: ``_codecs.encode(<its latin-1 text>, "latin1")``.
    """

    at: int
    data: Data


@dataclass(frozen=True, slots=True)
class TorchRecord(Wire):
    """One ``torch.save`` archive: its pickle and its storages, written as ``torch.save``
    writes them (``writer/archive.py``), so that ``torch.load`` reads it.

    ``pickle`` is ``data.pkl``: the state pickled with protocol 2 and a persistent id
    ``("storage", <storage type>, "<i>", <location>, <numel>)`` for storage ``i``, whose
    bytes are ``storages[i]`` (``archive/data/<i>``). ``blobs`` are inserted into the
    pickle (in order of ``at``). The trainer's side makes all of it
    (``core/pickler.py``); the writer loads none of it.
    """

    pickle: Data
    storages: tuple[Data, ...] = ()
    blobs: tuple[Blob, ...] = ()


@dataclass(frozen=True, slots=True)
class RawRecord(Wire):
    """Bytes written as they are (a DCP data file's non-tensor item)."""

    data: Data


Record = TorchRecord | RawRecord
"""One record of a file."""


@dataclass(frozen=True, slots=True)
class FileRecord(Wire):
    """A written (and, if durable, fsynced) file: its size, xxh3-64 and write time, and
    where each of its records lies in it (``spans``: ``(offset, length)``, in order)."""

    path: str
    nbytes: int
    xxh3_64: str
    seconds: float
    spans: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class WriteRecords(Call[FileRecord]):
    """Write the file ``path`` as ``records``, one after the other; fsync it if durable.

    The writer's one call for a file: an engine's file is one :class:`TorchRecord` (a
    plain ``torch.save`` file); a DCP data file is a sequence of them and of
    :class:`RawRecord` s. The bytes come from staging memory (or the call) and go to the
    file through the sink: hashed (xxh3-64 of the whole file) and written as they pass,
    with ``O_DIRECT`` where the filesystem supports it, never read back; nothing is
    unpickled. ``root`` is the checkpoint directory: ``path`` lies below it and is
    opened without following a link below it. ``staging_cap`` (the sending engine's) bounds
    the writer's buffers for the file (:func:`~.sink.bounce_bytes`). The answer says where
    each record landed.

    Parts given as :class:`Streamed` arrive later, through :class:`FeedFile` calls: the
    writer writes each piece as it arrives (the file is open from this call on), and
    answers this call when the last streamed byte is written and the file fsynced. A
    file of spans and bytes only is written at once.
    """

    path: str
    records: tuple[Record, ...]
    root: str = ""
    staging_cap: int = 0
    plain = True


@dataclass(frozen=True, slots=True)
class FeedFile(Call[None]):
    """The next bytes of the :class:`Streamed` parts of the file ``path`` (a
    :class:`WriteRecords` sent earlier): ``spans``, in order, continue them where the last
    feed stopped (the streamed parts of all records, in record order, as one stream). The
    reply comes once the writer has taken the bytes (copied into its buffers or written):
    the spans' staging memory is free again. The feed that completes the file also ends it
    (fsync), and the :class:`WriteRecords` is answered then. A feed for a file that is no
    longer being written (it failed, or was aborted) is dropped."""

    path: str
    spans: tuple[Span, ...]
    plain = True


@dataclass(frozen=True, slots=True)
class AbortFile(Call[None]):
    """Stop writing the streamed file ``path``: remove it, and fail its
    :class:`WriteRecords` with ``reason``. Nothing happens for a file not being written."""

    path: str
    reason: str = "its staging failed"
    plain = True


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
