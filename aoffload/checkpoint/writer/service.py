"""The checkpoint writer: a worker service that turns staged bytes into durable files.

It maps each staging segment once (:class:`~.calls.MapSegment`); per file it receives a
:class:`~.calls.WriteRecords`: the file name and its records, each naming where its bytes
lie in staging memory, or that they will be streamed in (:class:`~.calls.FeedFile`, one
piece of staging memory after another, each free again once the reply is sent). It
writes each record as it is (:mod:`.stream`): a :class:`~.calls.TorchRecord` as
``torch.save``'s zip archive (:mod:`.archive`) around the pickle the trainer made, a
:class:`~.calls.RawRecord` as its bytes, into a :class:`~.sink.Sink` that hashes
everything (xxh3-64 of the whole file) and writes large blocks, with ``O_DIRECT`` where
the filesystem supports it, then fsyncs. Nothing of the state is unpickled here, and the
write path needs no torch. It also loads a file for the trainer when its pickle is large
(:mod:`.loader`, with torch).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import mmap
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..._runtime.protocol import Call
from ..._runtime.serve import Handler, Service
from ..._runtime.threads import DaemonThreadExecutor, background_policy
from .calls import (
    AbortFile,
    Data,
    FeedFile,
    FileRecord,
    LoadedFile,
    LoadFile,
    MapSegment,
    Streamed,
    SyncTree,
    UnmapSegment,
    WatchRank,
    WriterConfig,
    WriteRecords,
)
from .sink import BOUNCE_BYTES, Sink, bounce_bytes, open_for_write
from .stream import FileStream, records_nbytes
from .watch import announce_death

__all__ = ["WriterService"]

logger = logging.getLogger(__name__)


class StreamAborted(Exception):
    """A streamed file was abandoned before its last byte (:class:`~.calls.AbortFile`)."""


@dataclass
class _Open:
    """A file being written: its descriptor, sink and stream, and its answer to come."""

    path: str
    root: str
    fd: int
    sink: Sink
    bounce: mmap.mmap | None
    busy: float  # seconds spent on it in this process
    stream: FileStream | None = None
    answer: concurrent.futures.Future[FileRecord] | None = None


class WriterService(Service):
    """Serves the writer's calls, one at a time, in order."""

    config_type = WriterConfig

    def __init__(self, config: WriterConfig) -> None:
        self._config = config
        self._segments: dict[str, tuple[mmap.mmap, memoryview]] = {}
        self._bounces: list[mmap.mmap] = []  # O_DIRECT buffers, one pair per open file
        self._open: dict[str, _Open] = {}  # streamed files waiting for their bytes
        self._blobs: list[str] = []  # /dev/shm files made by loads, until the trainer reads them
        self._watch = WatchRank()  # armed (keys) while a distributed trainer may die
        background_policy()  # persisting is background work: the trainer's cores come first
        self._io_thread = DaemonThreadExecutor("aoffload-writer-io")  # inherits the policy

    def handlers(self) -> Mapping[type[Call[Any]], Handler]:
        """Map a segment; write, feed or abort a file; fsync a tree; load; watch."""
        return {
            MapSegment: self._map,
            UnmapSegment: self._unmap,
            WriteRecords: self._write,
            FeedFile: self._feed,
            AbortFile: self._abort,
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

    def _unmap(self, message: UnmapSegment) -> None:
        mapped = self._segments.pop(message.path, None)
        if mapped is not None:
            mapping, view = mapped
            view.release()
            mapping.close()

    def _bytes(self, data: Data) -> memoryview:
        if isinstance(data, bytes):
            return memoryview(data)
        if isinstance(data, Streamed):  # pragma: no cover - the stream never asks
            raise TypeError("streamed bytes are fed, not read")
        view = self._segments[data.segment][1]
        if not 0 <= data.offset <= data.offset + data.nbytes <= len(view):
            raise ValueError(f"{data} lies outside its segment ({len(view)} bytes)")
        return view[data.offset : data.offset + data.nbytes]

    # -- files --------------------------------------------------------------------------

    def _write(self, message: WriteRecords) -> FileRecord | concurrent.futures.Future[FileRecord]:
        started = time.perf_counter()
        size = bounce_bytes(records_nbytes(message.records), message.staging_cap)
        if size > BOUNCE_BYTES and any(
            o.bounce is not None and len(o.bounce) >= 2 * size for o in self._open.values()
        ):
            size = BOUNCE_BYTES  # the cap kept room for one large pair (calls.staging_room)
        bounce = self._bounce(size)
        fd, buffers, bounce = open_for_write(
            message.path, self._config.direct_io, bounce, message.root, size
        )
        sink = Sink(fd, buffers, self._io_thread)
        opened = _Open(message.path, message.root, fd, sink, bounce, 0.0)
        try:
            opened.stream = FileStream(message.records, opened.sink, self._bytes)
            opened.busy += time.perf_counter() - started
            if opened.stream.done:
                return self._finish(opened)
        except BaseException:
            self._discard(opened)
            raise
        opened.answer = concurrent.futures.Future()
        self._open[message.path] = opened
        return opened.answer

    def _bounce(self, size: int) -> mmap.mmap | None:
        """A kept pair of bounce buffers of at least ``size`` bytes each, the smallest;
        ``None`` when none is that large (the smaller ones kept are let go: a file that
        needs larger buffers makes them, and they are kept in their place)."""
        fitting = [bounce for bounce in self._bounces if len(bounce) >= 2 * size]
        if not fitting:
            self._bounces.clear()
            return None
        chosen = min(fitting, key=len)
        self._bounces.remove(chosen)
        return chosen

    def _feed(self, message: FeedFile) -> None:
        opened = self._open.get(message.path)
        if opened is None or opened.stream is None or opened.answer is None:
            return  # it failed or was aborted: its staging memory is free all the same
        started = time.perf_counter()
        try:
            for span in message.spans:
                opened.stream.feed(self._bytes(span))
            opened.busy += time.perf_counter() - started
            if opened.stream.done:
                del self._open[message.path]
                opened.answer.set_result(self._finish(opened))
        except BaseException as exc:  # noqa: BLE001 - the file's answer carries it
            if self._open.pop(message.path, None) is not None:
                self._discard(opened)
            if not opened.answer.done():
                opened.answer.set_exception(exc)

    def _abort(self, message: AbortFile) -> None:
        opened = self._open.pop(message.path, None)
        if opened is not None and opened.answer is not None:
            self._discard(opened)
            opened.answer.set_exception(StreamAborted(f"{message.path}: {message.reason}"))

    def _finish(self, opened: _Open) -> FileRecord:
        """The file's last bytes and its fsync; its record. Discards the file on failure."""
        started = time.perf_counter()
        try:
            opened.sink.finish()
            if self._config.durable:
                os.fsync(opened.fd)
        except BaseException:
            self._discard(opened)
            raise
        os.close(opened.fd)
        self._give_back(opened)
        stream, sink = opened.stream, opened.sink
        seconds = opened.busy + time.perf_counter() - started
        spans = tuple(stream.spans) if stream is not None else ()
        return FileRecord(opened.path, sink.nbytes, sink.hash.hexdigest(), seconds, spans)

    def _discard(self, opened: _Open) -> None:
        """Close and remove a file that failed, and the directories its opening made that
        are empty now (below ``root``: a failed tag leaves no directory behind)."""
        with contextlib.suppress(OSError):
            opened.sink.wait()  # never close the fd under a write in flight
        os.close(opened.fd)
        with contextlib.suppress(OSError):
            os.unlink(opened.path)
        self._give_back(opened)
        if opened.root:
            root, directory = Path(opened.root), Path(opened.path).parent
            while directory != root and root in directory.parents:
                try:
                    os.rmdir(directory)  # only an empty one; a link is never followed
                except OSError:
                    break
                directory = directory.parent

    def _give_back(self, opened: _Open) -> None:
        bounce, opened.bounce = opened.bounce, None
        if bounce is not None:
            self._bounces.append(bounce)

    def _sync(self, message: SyncTree) -> None:
        if not self._config.durable:
            return
        for directory, _, _ in os.walk(message.root):
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    # -- the end ------------------------------------------------------------------------

    def quiesce(self) -> None:
        """Abandon the streamed files still open: their bytes can no longer come (every
        request the trainer sent is served by now), and their answers are owed."""
        for path in list(self._open):
            self._abort(AbortFile(path, "the writer is closing"))

    def close(self) -> None:
        """Unmap every staging segment; remove what loads left that the trainer never read;
        if the trainer died with its rank's watch armed, tell the other ranks first."""
        if self._watch.keys:  # the trainer went without disarming it: it died
            announce_death(self._watch)
        for path in list(self._open):  # the trainer is gone: nobody waits for the answers
            self._discard(self._open.pop(path))
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
        for bounce in self._bounces:
            with contextlib.suppress(BufferError):
                bounce.close()
