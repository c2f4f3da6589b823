"""Staging memory for checkpoints: shared-memory segments the trainer fills and the writer reads.

A :class:`Segment` is a file in ``/dev/shm`` mapped by the trainer; the writer maps it
once (a MAP request) and the trainer unlinks the name as soon as the writer has it
mapped, so from then on nothing in ``/dev/shm`` can outlive the two processes. Until
then the trainer unlinks it on close and on every failure path.

A :class:`Slot` holds the segments of one staged-not-yet-durable checkpoint. Slots are
reused checkpoint after checkpoint (a warm copy into mapped pages runs several times
faster than into fresh ones); a slot grows a segment only when a file does not fit in
the space it already has. ``max_pending`` slots bound the engine's memory; which tag holds
which slot, and who waits for one, is :mod:`.tags`'s.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import mmap
import os
import shutil
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from ..._errors import CheckpointError
from ..format import shm
from .plan import aligned

__all__ = ["Region", "Segment", "Slot", "SlotPool"]

logger = logging.getLogger(__name__)

_MIN_SEGMENT = 1 << 20
_names = itertools.count()

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
        self.size = aligned(max(size, _MIN_SEGMENT), mmap.PAGESIZE)
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
                    "enlarge it (e.g. `docker run --shm-size=...`) or save smaller files"
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
        self.used = 0
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


@dataclass(frozen=True, slots=True)
class Region:
    """Where one file's tensors lie: ``segment`` bytes ``[offset, offset + nbytes)``."""

    segment: Segment
    offset: int
    nbytes: int


class Slot:
    """The staging memory of one pending checkpoint, reused after it is durable."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.segments: list[Segment] = []

    @property
    def nbytes(self) -> int:
        """Bytes of shared memory this slot holds."""
        return sum(segment.size for segment in self.segments)

    def allocate(self, nbytes: int) -> tuple[Region, Segment | None]:
        """Reserve ``nbytes``; also return the segment created for it, if one was needed."""
        for segment in self.segments:
            if segment.size - segment.used >= nbytes:
                region = Region(segment, segment.used, nbytes)
                segment.used += aligned(nbytes)
                return region, None
        segment = Segment(nbytes)
        self.segments.append(segment)
        segment.used = aligned(nbytes)
        return Region(segment, 0, nbytes), segment

    def reset(self) -> None:
        """Make all of the slot's memory free for the next checkpoint."""
        for segment in self.segments:
            segment.used = 0

    def close(self) -> None:
        """Unlink and unmap every segment."""
        segments, self.segments = self.segments, []
        for segment in segments:
            segment.close()


class SlotPool:
    """``max_pending`` slots. Not thread-safe: :class:`~.tags.Tags` owns it under its lock."""

    def __init__(self, count: int) -> None:
        self.slots = [Slot(i) for i in range(count)]
        self._free = list(reversed(self.slots))

    def take(self) -> Slot | None:
        """A free slot, or ``None``."""
        return self._free.pop() if self._free else None

    def give(self, slot: Slot) -> None:
        """Make ``slot`` free again (its memory is reused by the next checkpoint)."""
        slot.reset()
        self._free.append(slot)

    def close(self) -> None:
        """Unlink and unmap every slot's memory."""
        for slot in self.slots:
            slot.close()
