"""Staging memory of the DCP route: shared-memory segments that torch shares by descriptor
and aoffload's writer maps by name.

A :class:`Segment` is a file in ``/dev/shm`` named by its owner (as the engine's staging
segments are: ``aoffload-<pid>-<start>-<n>``, so a dead owner's are swept by the next
engine start), exposed to torch as one shared storage over the file's descriptor
(``UntypedStorage._new_shared_fd_cpu``): tensors staged into it are views of that storage,
so DCP's PROCESS mode sends them to its daemon as the descriptor (torch's own reduction,
no copy), and the daemon maps the same pages. The name stays while the segment lives, so
that the engine's writer process maps it by name; :meth:`Segment.close` unlinks it and
tells every engine that mapped it (:func:`watch`) to unmap it.

:class:`Locator` finds where a tensor's bytes lie: in a segment of this process (by the
storage's address), or in a segment another process made and this one maps (DCP's daemon
receiving the trainer's staged state), from ``/proc/self/maps``.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import mmap
import os
import re
import secrets
import shutil
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .._errors import CheckpointError
from ..checkpoint.format import shm

__all__ = ["ALIGN", "Locator", "Segment", "aligned", "is_segment_path", "watch"]

logger = logging.getLogger(__name__)

ALIGN = 64
"""Byte alignment of every storage inside a segment (fits every dtype, and AVX-512)."""
_MIN_SEGMENT = 1 << 20
_NAME = re.compile(r"aoffload-\d+-\d+-\d+")
_lock = threading.Lock()
_by_address: dict[int, Segment] = {}
_watchers: weakref.WeakSet[_Watcher] = weakref.WeakSet()


class _Watcher:
    """Something that mapped segments elsewhere (an engine's writer) and must let go."""

    def __init__(self, forget: Callable[[str], None]) -> None:
        self.forget = forget


def watch(forget: Callable[[str], None]) -> object:
    """Call ``forget(path)`` whenever a segment of this process closes, while the returned
    token is alive (an engine's DCP service: it has its writer unmap the path)."""
    watcher = _Watcher(forget)
    with _lock:
        _watchers.add(watcher)
    return watcher


def aligned(nbytes: int, to: int = ALIGN) -> int:
    """``nbytes`` rounded up to a multiple of ``to``."""
    return (nbytes + to - 1) // to * to


def is_segment_path(path: str) -> bool:
    """Whether ``path`` names a staging segment of aoffload's (a plain name in /dev/shm)."""
    directory, name = os.path.split(path)
    return directory == shm.SHM_DIR and _NAME.fullmatch(name) is not None


class Segment:
    """One shared-memory file, and the torch storage over all of it."""

    def __init__(self, size: int) -> None:
        self.size = aligned(max(size, _MIN_SEGMENT), mmap.PAGESIZE)
        if not os.path.isdir(shm.SHM_DIR):
            raise OSError("aoffload needs /dev/shm (a tmpfs) for checkpoint staging memory")
        prefix = os.path.join(shm.SHM_DIR, shm.segment_prefix())
        while True:  # numbered apart from the engine's own segments, by chance
            self.path = f"{prefix}{secrets.randbelow(10**15) + 10**15}"
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                break
            except FileExistsError:
                continue
        try:
            os.ftruncate(fd, self.size)
            try:
                # Reserve the pages: on a full tmpfs, touching an unbacked page is a SIGBUS.
                os.posix_fallocate(fd, 0, self.size)
            except OSError as exc:
                free = shutil.disk_usage(shm.SHM_DIR).free
                raise CheckpointError(
                    f"checkpoint staging needs {self.size / 2**20:.0f} MiB of shared memory in "
                    f"{shm.SHM_DIR}, which has {free / 2**20:.0f} MiB free ({exc.strerror}); "
                    "enlarge it (e.g. `docker run --shm-size=...`) or stage less at a time"
                ) from exc
            shared: torch.UntypedStorage = torch.UntypedStorage._new_shared_fd_cpu(  # type: ignore[attr-defined]
                fd, self.size
            )
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)  # the storage keeps a descriptor of its own
        self.storage: torch.UntypedStorage | None = shared
        self.address: int = shared.data_ptr()
        self._pinned = False
        with _lock:
            _by_address[self.address] = self

    def busy(self) -> bool:
        """Whether a tensor staged into it is still alive (in this process)."""
        storage = self.storage
        if storage is None:
            return True
        return int(torch._C._storage_Use_Count(storage._cdata)) > 1

    def bytes(self, offset: int, nbytes: int) -> torch.Tensor:
        """A flat ``uint8`` view of ``nbytes`` at ``offset``."""
        return self.tensor(offset, torch.uint8, (nbytes,), (1,))

    def tensor(
        self, offset: int, dtype: torch.dtype, size: tuple[int, ...], stride: tuple[int, ...]
    ) -> torch.Tensor:
        """A view of the segment: ``dtype`` elements from byte ``offset`` (a multiple of
        the element size), with ``size`` and ``stride``."""
        if self.storage is None:
            raise CheckpointError("this staging memory was released (the stager was closed)")
        view = torch.empty((0,), dtype=dtype)
        return view.set_(self.storage, offset // dtype.itemsize, size, stride)

    def pin(self) -> None:
        """Page-lock it for CUDA, so device-to-host copies into it run asynchronously."""
        if self._pinned or self.storage is None:
            return
        result = torch.cuda.cudart().cudaHostRegister(self.address, self.size, 0)  # type: ignore[no-untyped-call]
        if int(result) != 0:
            raise OSError(f"cudaHostRegister of {self.size} bytes of staging memory failed")
        self._pinned = True

    def close(self) -> None:
        """Unlink it, have every engine that mapped it unmap it, and drop the storage: its
        pages go once no tensor staged into it is alive (torch owns that mapping)."""
        with _lock:
            _by_address.pop(self.address, None)
            watchers = list(_watchers)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        for watcher in watchers:
            try:
                watcher.forget(self.path)
            except Exception:  # the engine's own failure surfaces there
                logger.warning("could not unmap staging segment %s", self.path, exc_info=True)
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self.address)  # type: ignore[no-untyped-call]
            self._pinned = False
        self.storage = None


@dataclass(frozen=True, slots=True)
class _Mapping:
    start: int
    end: int
    offset: int
    path: str


class Locator:
    """Where tensors' bytes lie in aoffload's staging segments, as ``(path, offset)``.

    ``/proc/self/maps`` is read once, on the first tensor that is not in one of this
    process's segments.
    """

    def __init__(self) -> None:
        self._maps: list[_Mapping] | None = None
        self._starts: list[int] = []

    def find(self, tensor: torch.Tensor) -> tuple[str, int] | None:
        """The segment path and byte offset of ``tensor``'s first element, if its bytes
        (``numel * itemsize`` from there) lie in one; else ``None``."""
        if tensor.device.type != "cpu":
            return None
        storage = tensor.untyped_storage()
        base, start = storage.data_ptr(), tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        with _lock:
            segment = _by_address.get(base)
        if segment is not None:
            return (segment.path, start - base) if end <= base + segment.size else None
        if self._maps is None:
            self._maps = _read_maps()
            self._starts = [m.start for m in self._maps]
        index = bisect.bisect_right(self._starts, start) - 1
        if index < 0:
            return None
        found = self._maps[index]
        if not found.start <= start <= end <= found.end:
            return None
        return found.path, start - found.start + found.offset


def _read_maps() -> list[_Mapping]:
    """This process's shared mappings of aoffload's segments (not unlinked ones)."""
    found: list[_Mapping] = []
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or fields[1][3:4] != "s":
                continue
            path = fields[5].rstrip("\n")
            if not is_segment_path(path):
                continue  # not one of ours, or unlinked (" (deleted)"): not mappable by name
            low, high = (int(part, 16) for part in fields[0].split("-"))
            found.append(_Mapping(low, high, int(fields[2], 16), path))
    found.sort(key=lambda m: m.start)
    return found
