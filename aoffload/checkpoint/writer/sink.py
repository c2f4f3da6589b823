"""The writer's file sink: everything a file's records hold is hashed and written in large
aligned blocks, with ``O_DIRECT`` where the filesystem supports it, double-buffered so that
copying and hashing overlap the disk."""

from __future__ import annotations

import concurrent.futures
import ctypes
import io
import logging
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from ... import _paths
from .calls import LARGE_CAP

__all__ = [
    "BOUNCE_BYTES",
    "LARGE_BOUNCE_BYTES",
    "LARGE_FILE",
    "Sink",
    "bounce_bytes",
    "open_for_write",
]

logger = logging.getLogger(__name__)

BOUNCE_BYTES = 16 << 20
"""Bytes per bounce buffer (two of them) for ``O_DIRECT`` writes of a file under
:data:`LARGE_FILE`; each write to the disk is one buffer."""
LARGE_BOUNCE_BYTES = 64 << 20
"""Bytes per bounce buffer of a large file (:func:`bounce_bytes`). A disk can take one
64 MiB write at a time faster than four of 16 MiB: on the virtual disk of the host these
figures come from, a 4 GiB save was durable in 0.81x the time (``docs/performance.md``).
The price is 96 MiB more of the writer's memory once such a file has been written (the
buffers are kept for the next one), which the engine keeps out of its staging cap
(:func:`~.calls.staging_room`)."""
LARGE_FILE = 512 << 20
"""A file of this many bytes or more may be written through :data:`LARGE_BOUNCE_BYTES`
buffers: their 128 MiB are at most a quarter of it."""
_DIRECT_ALIGN = 4096
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


class Sink(io.RawIOBase):
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


def bounce_bytes(nbytes: int, staging_cap: int = 0) -> int:
    """Bytes per bounce buffer (one write to the disk) for a file of ``nbytes`` bytes from
    an engine whose staging cap is ``staging_cap`` (0: not known, no bound)."""
    roomy = staging_cap == 0 or staging_cap >= LARGE_CAP
    return LARGE_BOUNCE_BYTES if nbytes >= LARGE_FILE and roomy else BOUNCE_BYTES


def open_for_write(
    path: str, direct_io: bool, bounce: mmap.mmap | None, root: str = "", size: int = BOUNCE_BYTES
) -> tuple[int, tuple[memoryview, memoryview] | None, mmap.mmap | None]:
    """Open ``path`` for writing, with ``O_DIRECT`` when asked and supported.

    With ``root`` (the checkpoint directory), ``path`` lies below it and is opened, its
    missing directories made, without following a link below ``root``. ``size`` is each
    bounce buffer's (:func:`bounce_bytes`); ``bounce`` is used when it is large enough.
    Returns the fd, the two bounce buffers (``None`` without ``O_DIRECT``) and the mapping
    that holds them (``bounce``, or one made here, for the caller to keep).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC

    def opener(extra: int) -> int:
        if not root:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            return os.open(path, flags | extra, 0o644)
        relative = Path(path).relative_to(root).as_posix()
        return _paths.open_file(Path(root), relative, flags | extra, 0o644, parents=True)

    direct = getattr(os, "O_DIRECT", 0)
    if direct_io and direct:
        try:
            fd = opener(direct)
        except _paths.UnsafePathError:
            raise
        except OSError:
            logger.debug("O_DIRECT is not supported for %s; writing through the page cache", path)
        else:
            if bounce is None or len(bounce) < 2 * size:
                bounce = mmap.mmap(-1, 2 * size)
            both = memoryview(bounce)
            return fd, (both[:size], both[size : 2 * size]), bounce
    return opener(0), None, bounce
