"""The checkpoint writer: a worker service that turns staged tensors into durable files.

It maps each staging segment once (:class:`MapSegment`); per file it receives only a
:class:`WriteFile`: the file name, the pickled non-tensor skeleton of the state and
one :class:`TensorRecord` per tensor. It rebuilds the tensors as views on the shared
memory and calls :func:`torch.save` on them (so the file is a plain ``torch.save``
file), with torch's per-record CRC32 turned off (the manifest's xxh3-64 of the whole
file, computed while writing, replaces it) into a sink that writes large blocks,
with ``O_DIRECT`` where the filesystem supports it, then fsyncs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import io
import logging
import mmap
import os
import pickle
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from .._runtime.protocol import Call
from .._runtime.serve import Handler, Service, target
from .._runtime.threads import DaemonThreadExecutor, background_policy
from ._load import LoadedFile, LoadFile, load_in_worker, unlink_all

__all__ = [
    "TARGET",
    "FileRecord",
    "MapSegment",
    "SyncTree",
    "TensorRecord",
    "WriteFile",
    "WriterConfig",
]

logger = logging.getLogger(__name__)

_BOUNCE_BYTES = 16 << 20
_DIRECT_ALIGN = 4096


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
    """One contiguous tensor in a staging segment."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool


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
    memory, never through the pipe.
    """

    path: str
    segment: str
    skeleton_offset: int
    skeleton_nbytes: int
    tensors: tuple[TensorRecord, ...]


@dataclass(frozen=True, slots=True)
class SyncTree(Call[None]):
    """Fsync ``root`` and every directory below it."""

    root: str


_GIL_FREE_COPY = 1 << 16


def _copy(target: memoryview, source: memoryview) -> None:
    """``target[:] = source``, without holding the GIL for large blocks.

    A slice assignment holds the GIL for the whole memcpy, which stalls the I/O thread
    waiting to return from its ``write``; ``ctypes.memmove`` releases it.
    """
    if len(source) < _GIL_FREE_COPY:
        target[:] = source
        return
    destination = np.frombuffer(target, dtype=np.uint8)
    origin = np.frombuffer(source, dtype=np.uint8)
    ctypes.memmove(destination.ctypes.data, origin.ctypes.data, len(source))


class _Sink(io.RawIOBase):
    """A write-only stream that hashes everything and writes large blocks to ``fd``.

    With ``buffers`` (two aligned buffers) the file is open with ``O_DIRECT``: data is
    gathered into whole aligned blocks, and while one buffer is being written to disk on
    ``io_thread`` the other is being filled, so copying and hashing overlap the disk.
    The padding of the last block is cut off by :meth:`finish` with ``ftruncate``.
    """

    def __init__(
        self,
        fd: int,
        buffers: tuple[memoryview, memoryview] | None,
        io_thread: concurrent.futures.Executor,
    ) -> None:
        super().__init__()
        self._fd = fd
        self._buffers = buffers
        self._io_thread = io_thread
        self._current = 0
        self._fill = 0
        self._in_flight: concurrent.futures.Future[None] | None = None
        self.nbytes = 0
        self.hash = xxhash.xxh3_64()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.hash.update(view)
        self.nbytes += len(view)
        if self._buffers is None:
            self._write_all(view)
            return len(view)
        done = 0
        while done < len(view):
            bounce = self._buffers[self._current]
            take = min(len(bounce) - self._fill, len(view) - done)
            _copy(bounce[self._fill : self._fill + take], view[done : done + take])
            self._fill += take
            done += take
            if self._fill == len(bounce):
                self._submit(bounce)
        return len(view)

    def _submit(self, block: memoryview) -> None:
        self.wait()  # the other buffer's write must be done before it is refilled
        self._in_flight = self._io_thread.submit(self._write_all, block)
        self._current ^= 1
        self._fill = 0

    def wait(self) -> None:
        """Wait for the block being written, raising its error (ENOSPC, EIO) if any."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.result()

    def _write_all(self, view: memoryview) -> None:
        written = 0
        while written < len(view):
            written += os.write(self._fd, view[written:])

    def finish(self) -> None:
        """Write the last, padded block and wait until every block is written."""
        if self._buffers is not None and self._fill:
            bounce = self._buffers[self._current]
            padded = (self._fill + _DIRECT_ALIGN - 1) // _DIRECT_ALIGN * _DIRECT_ALIGN
            bounce[self._fill : padded] = bytes(padded - self._fill)
            self._submit(bounce[:padded])
        self.wait()
        if self._buffers is not None:
            os.ftruncate(self._fd, self.nbytes)


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, tensors: list[torch.Tensor]) -> None:
        super().__init__(io.BytesIO(data))
        self._tensors = tensors

    def persistent_load(self, pid: Any) -> torch.Tensor:
        return self._tensors[int(pid)]


class WriterService(Service):
    """Serves the writer's calls, one at a time, in order."""

    config_type = WriterConfig

    def __init__(self, config: WriterConfig) -> None:
        self._config = config
        self._segments: dict[str, tuple[mmap.mmap, np.ndarray[Any, Any]]] = {}
        self._bounce: mmap.mmap | None = None
        self._blobs: list[str] = []  # /dev/shm files made by loads, until the trainer reads them
        background_policy()  # persisting is background work: the trainer's cores come first
        self._io_thread = DaemonThreadExecutor("aoffload-writer-io")  # inherits the policy
        torch.serialization.set_crc32_options(False)

    def handlers(self) -> Mapping[type[Call[Any]], Handler]:
        """Map a segment, write a file, fsync a tree, load a file for the trainer."""
        return {
            MapSegment: self._map,
            WriteFile: self._write,
            SyncTree: self._sync,
            LoadFile: self._load,
        }

    def _load(self, message: LoadFile) -> LoadedFile:
        self._blobs = [blob for blob in self._blobs if os.path.exists(blob)]
        return load_in_worker(message, self._blobs)

    def _map(self, message: MapSegment) -> None:
        fd = os.open(message.path, os.O_RDWR)
        try:
            mapping = mmap.mmap(fd, message.size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self._segments[message.path] = (mapping, np.frombuffer(mapping, dtype=np.uint8))

    def _tensor(self, array: np.ndarray[Any, Any], record: TensorRecord) -> torch.Tensor:
        if record.nbytes == 0:
            return torch.empty(record.shape, dtype=record.dtype)
        flat = torch.from_numpy(array[record.offset : record.offset + record.nbytes])
        tensor = flat.view(record.dtype).view(record.shape)
        return tensor.requires_grad_() if record.requires_grad else tensor

    def _write(self, message: WriteFile) -> FileRecord:
        started = time.perf_counter()
        _, array = self._segments[message.segment]
        tensors = [self._tensor(array, record) for record in message.tensors]
        start = message.skeleton_offset
        skeleton = array[start : start + message.skeleton_nbytes].tobytes()
        state = _Unpickler(skeleton, tensors).load()
        os.makedirs(os.path.dirname(message.path), exist_ok=True)
        fd, bounce = self._open(message.path)
        sink = _Sink(fd, bounce, self._io_thread)
        try:
            torch.save(state, sink)  # type: ignore[arg-type]  # a binary stream
            sink.finish()
            if self._config.durable:
                os.fsync(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                sink.wait()  # never close the fd under a write in flight
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(message.path)
            raise
        os.close(fd)
        digest = sink.hash.hexdigest()
        return FileRecord(message.path, sink.nbytes, digest, time.perf_counter() - started)

    def _open(self, path: str) -> tuple[int, tuple[memoryview, memoryview] | None]:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        direct = getattr(os, "O_DIRECT", 0)
        if self._config.direct_io and direct:
            try:
                fd = os.open(path, flags | direct, 0o644)
            except OSError:
                logger.debug(
                    "O_DIRECT is not supported for %s; writing through the page cache", path
                )
            else:
                if self._bounce is None:
                    self._bounce = mmap.mmap(-1, 2 * _BOUNCE_BYTES)
                both = memoryview(self._bounce)
                return fd, (both[:_BOUNCE_BYTES], both[_BOUNCE_BYTES:])
        return os.open(path, flags, 0o644), None

    def _sync(self, message: SyncTree) -> None:
        if not self._config.durable:
            return
        for directory, _, _ in os.walk(message.root):
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def close(self) -> None:
        """Unmap every staging segment; remove what loads left that the trainer never read."""
        unlink_all(self._blobs)
        while self._segments:
            _, (mapping, array) = self._segments.popitem()
            del array
            with contextlib.suppress(BufferError):
                mapping.close()
        self._io_thread.shutdown(wait=True)
        if self._bounce is not None:
            with contextlib.suppress(BufferError):
                self._bounce.close()


TARGET = target(WriterService)
"""The name a bridge spawns the service by."""
