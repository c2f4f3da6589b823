"""The checkpoint writer: a worker service that turns staged tensors into durable files.

It maps each staging segment once (:class:`~.calls.MapSegment`); per file it receives only
a :class:`~.calls.WriteFile`: the file name, where the pickled non-tensor skeleton of the
state lies and one :class:`~.calls.TensorRecord` per tensor. It rebuilds the tensors as
views on the shared memory and calls :func:`torch.save` on them (so the file is a plain
``torch.save`` file), with torch's per-record CRC32 turned off (the manifest's xxh3-64 of
the whole file, computed while writing, replaces it) into a :class:`~.sink.Sink` that
writes large blocks, with ``O_DIRECT`` where the filesystem supports it, then fsyncs. It
also loads a file for the trainer when its pickle is large (:mod:`.loader`).
"""

from __future__ import annotations

import contextlib
import io
import logging
import mmap
import os
import pickle
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..._runtime.protocol import Call
from ..._runtime.serve import Handler, Service
from ..._runtime.threads import DaemonThreadExecutor, background_policy
from .calls import (
    FileRecord,
    LoadedFile,
    LoadFile,
    MapSegment,
    SyncTree,
    TensorRecord,
    WatchRank,
    WriteFile,
    WriterConfig,
)
from .loader import load_in_worker, unlink_all
from .sink import Sink, open_for_write
from .watch import announce_death

__all__ = ["WriterService"]

logger = logging.getLogger(__name__)


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
        self._watch = WatchRank()  # armed (keys) while a distributed trainer may die
        background_policy()  # persisting is background work: the trainer's cores come first
        self._io_thread = DaemonThreadExecutor("aoffload-writer-io")  # inherits the policy
        torch.serialization.set_crc32_options(False)

    def handlers(self) -> Mapping[type[Call[Any]], Handler]:
        """Map a segment, write a file, fsync a tree, load a file, watch the trainer."""
        return {
            MapSegment: self._map,
            WriteFile: self._write,
            SyncTree: self._sync,
            LoadFile: self._load,
            WatchRank: self._arm,
        }

    def _arm(self, message: WatchRank) -> None:
        self._watch = message

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

    @staticmethod
    def _tensor(
        array: np.ndarray[Any, Any],
        record: TensorRecord,
        storages: dict[int, torch.UntypedStorage],
    ) -> torch.Tensor:
        if record.nbytes == 0:  # an empty storage takes no room: it has no offset of its own
            storage = torch.empty((0,), dtype=torch.uint8).untyped_storage()
        elif (found := storages.get(record.offset)) is not None:
            storage = found
        else:
            flat = torch.from_numpy(array[record.offset : record.offset + record.nbytes])
            storage = storages[record.offset] = flat.untyped_storage()
        stride = record.stride
        if stride is None:  # a contiguous tensor of its own
            stride = torch.empty(record.shape, device="meta").stride()
        tensor = torch.empty((0,), dtype=record.dtype).set_(
            storage, record.storage_offset, record.shape, stride
        )
        if record.parameter:
            return torch.nn.Parameter(tensor, requires_grad=record.requires_grad)
        return tensor.requires_grad_() if record.requires_grad else tensor

    def _write(self, message: WriteFile) -> FileRecord:
        started = time.perf_counter()
        _, array = self._segments[message.segment]
        storages: dict[int, torch.UntypedStorage] = {}
        tensors = [self._tensor(array, record, storages) for record in message.tensors]
        start = message.skeleton_offset
        skeleton = array[start : start + message.skeleton_nbytes].tobytes()
        state = _Unpickler(skeleton, tensors).load()
        fd, buffers, self._bounce = open_for_write(
            message.path, self._config.direct_io, self._bounce, message.root
        )
        sink = Sink(fd, buffers, self._io_thread)
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
        """Unmap every staging segment; remove what loads left that the trainer never read;
        if the trainer died with its rank's watch armed, tell the other ranks first."""
        if self._watch.keys:  # the trainer went without disarming it: it died
            announce_death(self._watch)
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
