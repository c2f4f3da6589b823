"""The checkpoint writer: a worker service that turns staged bytes into durable files.

It maps each staging segment once (:class:`~.calls.MapSegment`); per file it receives only
a :class:`~.calls.WriteRecords`: the file name and its records, each naming where its bytes
lie in staging memory. It writes each record as it is: a :class:`~.calls.TorchRecord` as
``torch.save``'s zip archive (:mod:`.archive`) around the pickle the trainer made, a
:class:`~.calls.RawRecord` as its bytes, into a :class:`~.sink.Sink` that hashes
everything (xxh3-64 of the whole file) and writes large blocks, with ``O_DIRECT`` where
the filesystem supports it, then fsyncs. Nothing of the state is unpickled here, and the
write path needs no torch. It also loads a file for the trainer when its pickle is large
(:mod:`.loader`, with torch).
"""

from __future__ import annotations

import codecs
import contextlib
import logging
import mmap
import os
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..._runtime.protocol import Call
from ..._runtime.serve import Handler, Service
from ..._runtime.threads import DaemonThreadExecutor, background_policy
from .archive import Archive
from .calls import (
    Data,
    FileRecord,
    LoadedFile,
    LoadFile,
    MapSegment,
    RawRecord,
    SyncTree,
    TorchRecord,
    WatchRank,
    WriterConfig,
    WriteRecords,
)
from .sink import Sink, open_for_write
from .watch import announce_death

__all__ = ["WriterService"]

logger = logging.getLogger(__name__)


_ENCODE_CHUNK = 16 << 20  # bytes of a blob encoded at a time
_BLOB_HEAD = b"c_codecs\nencode\nX"  # GLOBAL _codecs.encode, BINUNICODE <length> ...
_BLOB_TAIL = b"X\x06\x00\x00\x00latin1\x86R"  # ... BINUNICODE "latin1", TUPLE2, REDUCE


def _utf8_nbytes(data: memoryview) -> int:
    """Bytes of ``data``'s latin-1 text in UTF-8: one per byte, two from 0x80 on."""
    array = np.frombuffer(data, dtype=np.uint8)
    high = sum(
        int(np.count_nonzero(array[at : at + _ENCODE_CHUNK] >= 0x80))
        for at in range(0, len(array), _ENCODE_CHUNK)
    )
    return len(array) + high


class WriterService(Service):
    """Serves the writer's calls, one at a time, in order."""

    config_type = WriterConfig

    def __init__(self, config: WriterConfig) -> None:
        self._config = config
        self._segments: dict[str, tuple[mmap.mmap, memoryview]] = {}
        self._bounce: mmap.mmap | None = None
        self._blobs: list[str] = []  # /dev/shm files made by loads, until the trainer reads them
        self._watch = WatchRank()  # armed (keys) while a distributed trainer may die
        background_policy()  # persisting is background work: the trainer's cores come first
        self._io_thread = DaemonThreadExecutor("aoffload-writer-io")  # inherits the policy

    def handlers(self) -> Mapping[type[Call[Any]], Handler]:
        """Map a segment, write a file, fsync a tree, load a file, watch the trainer."""
        return {
            MapSegment: self._map,
            WriteRecords: self._write,
            SyncTree: self._sync,
            LoadFile: self._load,
            WatchRank: self._arm,
        }

    def _arm(self, message: WatchRank) -> None:
        self._watch = message

    def _load(self, message: LoadFile) -> LoadedFile:
        from .loader import load_in_worker  # torch: only a load needs it

        self._blobs = [blob for blob in self._blobs if os.path.exists(blob)]
        return load_in_worker(message, self._blobs)

    def _map(self, message: MapSegment) -> None:
        fd = os.open(message.path, os.O_RDWR)
        try:
            mapping = mmap.mmap(fd, message.size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self._segments[message.path] = (mapping, memoryview(mapping))

    def _bytes(self, data: Data) -> memoryview:
        if isinstance(data, bytes):
            return memoryview(data)
        view = self._segments[data.segment][1]
        if not 0 <= data.offset <= data.offset + data.nbytes <= len(view):
            raise ValueError(f"{data} lies outside its segment ({len(view)} bytes)")
        return view[data.offset : data.offset + data.nbytes]

    def _write(self, message: WriteRecords) -> FileRecord:
        started = time.perf_counter()
        fd, buffers, self._bounce = open_for_write(
            message.path, self._config.direct_io, self._bounce, message.root
        )
        sink = Sink(fd, buffers, self._io_thread)
        spans: list[tuple[int, int]] = []
        try:
            for record in message.records:
                start = sink.nbytes
                if isinstance(record, TorchRecord):
                    self._archive(sink, record)
                elif isinstance(record, RawRecord):
                    sink.write(self._bytes(record.data))
                else:
                    raise TypeError(f"not a record: {record!r}")
                spans.append((start, sink.nbytes - start))
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
        seconds = time.perf_counter() - started
        return FileRecord(message.path, sink.nbytes, sink.hash.hexdigest(), seconds, tuple(spans))

    def _archive(self, sink: Sink, record: TorchRecord) -> None:
        """``record`` as ``torch.save`` writes it (:mod:`.archive`)."""
        archive = Archive(sink)
        pickle = self._bytes(record.pickle)
        blobs = [(blob.at, self._bytes(blob.data)) for blob in record.blobs]
        encoded = [_utf8_nbytes(data) for _, data in blobs]
        if any(nbytes > 0xFFFFFFFF for nbytes in encoded):
            raise OverflowError(
                "a bytes value of the state is too large for torch.save's pickle protocol "
                "2 (over 4 GiB once encoded); save it as a uint8 tensor"
            )
        size = len(pickle) + sum(len(_BLOB_HEAD) + 4 + n + len(_BLOB_TAIL) for n in encoded)
        archive.begin("data.pkl", size)
        taken = 0
        for (at, data), nbytes in zip(blobs, encoded, strict=True):
            if not taken <= at <= len(pickle):
                raise ValueError(f"a blob at {at} of a {len(pickle)}-byte pickle, after {taken}")
            sink.write(pickle[taken:at])
            sink.write(_BLOB_HEAD + nbytes.to_bytes(4, "little"))
            for start in range(0, len(data), _ENCODE_CHUNK):
                text = codecs.latin_1_decode(data[start : start + _ENCODE_CHUNK])[0]
                sink.write(text.encode("utf-8"))
            sink.write(_BLOB_TAIL)
            taken = at
        sink.write(pickle[taken:])
        archive.end()
        archive.preamble()
        for number, storage in enumerate(record.storages):
            data = self._bytes(storage)
            archive.begin(f"data/{number}", len(data))
            sink.write(data)
            archive.end()
        archive.close()

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
        for blob in self._blobs:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(blob)
        while self._segments:
            _, (mapping, view) = self._segments.popitem()
            with contextlib.suppress(BufferError):
                view.release()
            with contextlib.suppress(BufferError):
                mapping.close()
        self._io_thread.shutdown(wait=True)
        if self._bounce is not None:
            with contextlib.suppress(BufferError):
                self._bounce.close()
