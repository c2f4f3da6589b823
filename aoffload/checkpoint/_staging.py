"""Staging memory for checkpoints: shared-memory segments the trainer fills and the writer reads.

A :class:`Segment` is a file in ``/dev/shm`` mapped by the trainer; the writer maps it
once (a MAP request) and the trainer unlinks the name as soon as the writer has it
mapped, so from then on nothing in ``/dev/shm`` can outlive the two processes. Until
then the trainer unlinks it on close and on every failure path.

A :class:`Slot` holds the segments of one staged-not-yet-durable checkpoint. Slots are
reused checkpoint after checkpoint (a warm copy into mapped pages runs several times
faster than into fresh ones); a slot grows a segment only when a file does not fit in
the space it already has. ``max_pending`` slots bound the engine's memory; which tag holds
which slot, and who waits for one, is :mod:`._tags`'s.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import shutil
from dataclasses import dataclass

import numpy as np
import torch

from .._errors import CheckpointError
from ._shm import segment_prefix

__all__ = ["ALIGN", "Region", "Segment", "Slot", "SlotPool", "aligned"]

logger = logging.getLogger(__name__)

ALIGN = 64
"""Byte alignment of every tensor inside a staging segment (fits every dtype and AVX-512)."""

_SHM_DIR = "/dev/shm"
_MIN_SEGMENT = 1 << 20
_names = itertools.count()


def aligned(nbytes: int, to: int = ALIGN) -> int:
    """``nbytes`` rounded up to a multiple of ``to``."""
    return (nbytes + to - 1) // to * to


class Segment:
    """One shared-memory file mapped read-write in the trainer."""

    def __init__(self, size: int) -> None:
        self.size = aligned(max(size, _MIN_SEGMENT), mmap.PAGESIZE)
        directory = _SHM_DIR if os.path.isdir(_SHM_DIR) else None
        if directory is None:
            raise OSError("aoffload needs /dev/shm (a tmpfs) for checkpoint staging memory")
        # named by its owner (pid and start time): a later start sweeps a dead one's (_shm)
        self.path = os.path.join(directory, f"{segment_prefix()}{next(_names)}")
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
            # No MAP_POPULATE: mmap() holds the GIL, and populating 256 MiB took 127 ms
            # of it. The pages are reserved above; the first copy (a GIL-free memmove)
            # faults them in.
            self._mmap: mmap.mmap | None = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self._linked = True
        self._pinned = False
        self.used = 0
        self.array: torch.Tensor | None = torch.from_numpy(
            np.frombuffer(self._mmap, dtype=np.uint8)
        )

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
        if self._mmap is not None:
            mapping, self._mmap = self._mmap, None
            try:
                mapping.close()
            except BufferError:
                logger.warning("staging segment %s is still referenced; unmapped later", self.path)


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
    """``max_pending`` slots. Not thread-safe: :class:`~._tags.Tags` owns it under its lock."""

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
