"""Staging memory for checkpoints: shared-memory chunks the trainer fills and the writer drains.

A :class:`Segment` is a file in ``/dev/shm`` mapped by the trainer; the writer maps it
once (a MAP request) and the trainer unlinks the name as soon as the writer has it
mapped, so from then on nothing in ``/dev/shm`` can outlive the two processes. Until
then the trainer unlinks it on close and on every failure path.

:class:`StagingPool` is all of an engine's staging memory: segments cut into
:class:`Chunk` s of :attr:`StagingPool.chunk` bytes, at most ``staging_bytes`` in all
(the cap), shared by every tag in flight. A file streams through it: the stage thread
takes a free chunk for each piece of the file (:meth:`StagingPool.take`, which blocks
while every chunk holds data the writer has not written yet: backpressure), a copy
thread fills it, the writer writes it and the chunk is given back
(:meth:`StagingPool.give`) for the next piece. The pool grows a segment only when no
chunk is free and the cap leaves room, by what the file still needs, so a state that
fits under the cap stages whole, as it did before the cap; the chunks are reused
checkpoint after checkpoint (a warm copy into mapped pages runs several times faster
than into fresh ones) and the pool never shrinks, so its memory stays flat over a long
run. It counts the bytes in use (holding data not yet written) and their peak.

A :class:`Slot` is a tag's place among the ``max_pending`` tags in flight (which tag
holds which, and who waits for one, is :mod:`.tags`'s); it holds no memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import mmap
import os
import shutil
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..._errors import CheckpointError, ClosedError
from ..format import shm
from ..writer.calls import staging_room

__all__ = ["MIN_STAGING", "Chunk", "Segment", "Slot", "SlotPool", "StagingPool", "default_cap"]

logger = logging.getLogger(__name__)

_MAX_SEGMENT = 1 << 30  # bytes a pool grows by at most at once
_MAX_CHUNK = 8 << 20
_MIN_CHUNK = 64 << 10
MIN_STAGING = 1 << 20
"""The smallest ``staging_bytes`` an engine takes."""
_names = itertools.count()


def _round_up(nbytes: int, to: int) -> int:
    return -(-nbytes // to) * to


_pinning = threading.Lock()

# libc's mmap, madvise and munmap through ctypes, which releases the GIL around each call:
# unmapping a GiB segment takes 70-180 ms, and Python's mmap.close() holds the GIL for all
# of it. munmap also holds the process's mmap lock for writing while it clears the page
# tables (50-60 ms of a GiB), blocking every other thread's malloc that maps memory, the
# event loop's too; madvise(MADV_DONTNEED) clears them first under the lock read-held.
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _map_shared(fd: int, size: int) -> int:
    """Map ``size`` bytes of ``fd`` read-write and shared, without the GIL; the address."""
    address = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if address is None or address == _MAP_FAILED:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mmap of {size} bytes of staging memory: {os.strerror(errno)}")
    return int(address)


class Segment:
    """One shared-memory file mapped read-write in the trainer."""

    def __init__(self, size: int) -> None:
        self.size = _round_up(max(size, mmap.PAGESIZE), mmap.PAGESIZE)
        directory = shm.SHM_DIR if os.path.isdir(shm.SHM_DIR) else None
        if directory is None:
            raise OSError("aoffload needs /dev/shm (a tmpfs) for checkpoint staging memory")
        # named by its owner (pid and start time): a later start sweeps a dead one's (_shm)
        self.path = os.path.join(directory, f"{shm.segment_prefix()}{next(_names)}")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.size)
            try:
                # Reserve the pages now: on a full tmpfs a mapped page that cannot be backed
                # kills the process with SIGBUS when touched, far from any useful message.
                os.posix_fallocate(fd, 0, self.size)
            except OSError as exc:
                free = shutil.disk_usage(directory).free
                raise CheckpointError(
                    f"checkpoint staging needs {self.size / 2**20:.0f} MiB of shared memory in "
                    f"{directory}, which has {free / 2**20:.0f} MiB free ({exc.strerror}); "
                    "enlarge it (e.g. `docker run --shm-size=...`) or lower the engine's "
                    "staging_bytes (a larger state streams through it)"
                ) from exc
            # No MAP_POPULATE: the pages are reserved above, and the first copy (a
            # GIL-free memmove) faults them in on the copy threads.
            self._address: int | None = _map_shared(fd, self.size)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self._linked = True
        self._pinned = False
        buffer = np.ctypeslib.as_array((ctypes.c_uint8 * self.size).from_address(self._address))
        # Every view of the array keeps ``buffer`` alive through the storage's deleter:
        # while this reference is live the mapping must stay.
        self._views = weakref.ref(buffer)
        self.array: torch.Tensor | None = torch.from_numpy(buffer)

    def unlink(self) -> None:
        """Remove the name from ``/dev/shm`` (idempotent; the mappings stay valid)."""
        if self._linked:
            self._linked = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def pin(self) -> None:
        """Page-lock the segment for CUDA so device-to-host copies into it run asynchronously."""
        with _pinning:
            self._pin()

    def _pin(self) -> None:
        if self._pinned or self.array is None:
            return
        result = torch.cuda.cudart().cudaHostRegister(  # type: ignore[no-untyped-call]
            self.array.data_ptr(), self.size, 0
        )
        if int(result) != 0:
            raise OSError(f"cudaHostRegister of {self.size} bytes of staging memory failed")
        self._pinned = True

    def close(self) -> None:
        """Unlink and unmap. The caller must hold no views of :attr:`array` any more."""
        self.unlink()
        array, self.array = self.array, None
        if self._pinned and array is not None:
            torch.cuda.cudart().cudaHostUnregister(array.data_ptr())  # type: ignore[no-untyped-call]
        del array
        if self._address is None:
            return
        if self._views() is not None:
            # a view outlives the engine: unmapping would turn its next access into a
            # SIGSEGV, so the mapping stays until the process exits
            logger.warning("staging segment %s is still referenced; it stays mapped", self.path)
            return
        address, self._address = self._address, None
        # the pages stay in the (shared) file: this only drops this mapping's page tables
        _libc.madvise(address, self.size, mmap.MADV_DONTNEED)
        if _libc.munmap(address, self.size) != 0:
            errno = ctypes.get_errno()
            logger.warning("munmap of staging segment %s: %s", self.path, os.strerror(errno))


def default_cap(ranks: bool = False) -> int:
    """The staging cap of an engine that names none: a quarter of the machine's RAM, and
    at most half of what ``/dev/shm`` has free (a data loader's workers need it too); with
    ``ranks``, shared among this node's ranks (torchrun's ``LOCAL_WORLD_SIZE``)."""
    try:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if ranks else 1
    except ValueError:
        local_ranks = 1
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        info = os.statvfs(shm.SHM_DIR)
        free = info.f_bavail * info.f_frsize
    except OSError:
        free = ram
    share = min(ram // 4, free // 2) // max(1, local_ranks)
    return max(MIN_STAGING, share // mmap.PAGESIZE * mmap.PAGESIZE)


@dataclass(frozen=True, slots=True)
class Chunk:
    """``nbytes`` of staging memory at ``offset`` of ``segment``."""

    segment: Segment
    offset: int
    nbytes: int


class StagingPool:
    """An engine's staging memory: at most :attr:`room` bytes of chunks, what the engine's
    staging cap ``cap`` leaves beside the writer's large buffers (see the module).

    ``mapped(segment)`` is called (on the thread that grows the pool, before any chunk of
    the segment is handed out) for each new segment: the writer must map it. Thread-safe.
    """

    def __init__(self, cap: int, mapped: Callable[[Segment], None]) -> None:
        self.cap = cap
        self.room = staging_room(cap)
        """The most bytes of chunks: ``cap`` less the writer's large buffers, if it pays for
        them (:func:`~aoffload.checkpoint.writer.calls.staging_room`)."""
        room = self.room
        self.chunk = max(_MIN_CHUNK, min(_MAX_CHUNK, room // 8 // _MIN_CHUNK * _MIN_CHUNK))
        self._mapped = mapped
        self._cond = threading.Condition()
        self._free: list[Chunk] = []
        self._segments: list[Segment] = []
        self._size = 0
        self._in_use = 0
        self.peak = 0
        """The most bytes in use at once since the pool was made."""
        self._closed = False

    @property
    def size(self) -> int:
        """Bytes of shared memory the pool holds (mapped), never more than :attr:`room`."""
        return self._size

    @property
    def in_use(self) -> int:
        """Bytes in chunks that hold data the writer has not written yet."""
        return self._in_use

    def take(self, wanted: int) -> Chunk:
        """A free chunk; ``wanted`` is what the file still needs (how much to grow by).

        Blocks while every chunk is in use and the pool is at its cap (backpressure);
        raises :class:`ClosedError` once the pool is closed.
        """
        with self._cond:
            while not self._free:
                if self._closed:
                    raise ClosedError("the checkpoint engine closed while staging waited")
                if self._size + self.chunk <= self.room:
                    self._grow(wanted)
                    break
                self._cond.wait()
            if self._closed:
                raise ClosedError("the checkpoint engine closed while staging waited")
            chunk = self._free.pop()
            self._in_use += chunk.nbytes
            self.peak = max(self.peak, self._in_use)
            return chunk

    def _grow(self, wanted: int) -> None:
        room = (self.room - self._size) // self.chunk * self.chunk
        nbytes = min(room, _MAX_SEGMENT, max(self.chunk, _round_up(wanted, self.chunk)))
        segment = Segment(nbytes)  # its size may round up to a page: use what was asked
        try:
            self._mapped(segment)
        except BaseException:
            segment.close()
            raise
        self._segments.append(segment)
        self._size += nbytes
        # the lowest offsets last: they are taken first, and stay the warm ones
        self._free.extend(
            Chunk(segment, offset, self.chunk) for offset in reversed(range(0, nbytes, self.chunk))
        )
        logger.debug(
            "staging grew by %.0f MiB to %.0f MiB (%.0f MiB of the cap's %.0f for chunks)",
            nbytes / 2**20,
            self._size / 2**20,
            self.room / 2**20,
            self.cap / 2**20,
        )

    def give(self, chunk: Chunk) -> None:
        """``chunk``'s data is written (or abandoned): it is free for the next piece."""
        with self._cond:
            self._in_use -= chunk.nbytes
            self._free.append(chunk)
            self._cond.notify()

    def interrupt(self) -> None:
        """Wake every waiter, and every later one: they raise :class:`ClosedError`."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def close(self) -> None:
        """:meth:`interrupt`, then unlink and unmap every segment: nothing may copy into
        the pool's chunks any more (the writer's own mappings stay valid)."""
        self.interrupt()
        with self._cond:
            segments, self._segments, self._free = self._segments, [], []
        for segment in segments:
            segment.close()


class Slot:
    """A tag's place among the ``max_pending`` tags in flight (no memory of its own)."""

    def __init__(self, index: int) -> None:
        self.index = index


class SlotPool:
    """``max_pending`` slots. Not thread-safe: :class:`~.tags.Tags` owns it under its lock."""

    def __init__(self, count: int) -> None:
        self.slots = [Slot(i) for i in range(count)]
        self._free = list(reversed(self.slots))

    def take(self) -> Slot | None:
        """A free slot, or ``None``."""
        return self._free.pop() if self._free else None

    def give(self, slot: Slot) -> None:
        """Make ``slot`` free again."""
        self._free.append(slot)

    def close(self) -> None:
        """Nothing to release (the staging memory is the :class:`StagingPool`'s)."""
