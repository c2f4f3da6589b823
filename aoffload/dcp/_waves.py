"""``engine.dcp`` under the engine's staging cap: a state larger than the cap streams through it.

DCP's ``AsyncStager`` protocol hands the writer a whole staged state, so a
:class:`~aoffload.dcp.Stager` holds one full copy of it. When the tensors of a state
given to ``engine.dcp.async_save`` exceed the engine's staging cap (``staging_bytes``,
or the default cap), nothing is staged up front: DCP's save runs on the face's thread
with the live state, and ``StorageWriter.write_data`` copies the rank's items in
**waves** into one shared-memory segment of the cap's size (:class:`WaveMemory`, kept by
the face for its next saves, as a stager keeps its copy). Each wave fills one half of it
and becomes one file of the tag, ``__<rank>_<k>.distcp`` (as ``FileSystemWriter`` names
a rank's files when it writes several); the engine's writer makes it durable while the
next wave is copied into the other half, and a half is reused once its file is durable.
An item larger than half the cap takes the whole of it, alone; one larger than the cap
cannot be staged under it, and the save fails saying so.

Every tensor's version counter is recorded when ``async_save`` is called and compared
after its wave's copy: a tensor modified in place before its copy ended fails the save
on every rank, naming its key. The fence (``staging_completion``) resolves when the last
wave is copied, which is about when every file but the last is durable: a step longer
than that stalls nothing; a shorter one waits for the rest.
"""

from __future__ import annotations

import concurrent.futures
import mmap
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from .._errors import CheckpointError, InvalidStateError
from .._runtime.threads import running_future
from ..checkpoint.core.copy import CopyPool, Events
from ..checkpoint.core.plan import key_of
from ..checkpoint.writer.calls import RawRecord, Record, Span, TorchRecord
from ._memory import Segment, aligned
from ._records import dense, tensor_pickle
from ._stager import _Copy, _problem, _Recorded, _versions

if TYPE_CHECKING:
    from ..checkpoint.core.tags import FileJob
    from ._service import Service, Submit

__all__ = ["WaveMemory", "Waves", "state_bytes"]

_MIB = float(1 << 20)


def state_bytes(recorded: _Recorded) -> int:
    """The bytes of a state's tensors (each distinct tensor once)."""
    return sum(local.numel() * local.element_size() for _, local, _ in recorded)


class WaveMemory:
    """One staging segment of the cap's size, in two halves, and the copy threads: a
    face's, reused by each of its capped saves (one at a time), freed by :meth:`close`."""

    def __init__(self, cap: int) -> None:
        self.cap = max(2 * mmap.PAGESIZE, cap // (2 * mmap.PAGESIZE) * 2 * mmap.PAGESIZE)
        self.half = self.cap // 2
        self._lock = threading.Lock()
        self._segment: Segment | None = None
        self._pool: CopyPool | None = None

    def parts(self) -> tuple[Segment, CopyPool]:
        """The segment and the copy pool (made on first use)."""
        with self._lock:
            if self._segment is None:
                self._segment = Segment(self.cap)
            if self._pool is None:
                self._pool = CopyPool()
            return self._segment, self._pool

    def close(self) -> None:
        """Free the segment and stop the copy threads. Idempotent."""
        with self._lock:
            segment, self._segment = self._segment, None
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown()
        if segment is not None:
            segment.close()


@dataclass(slots=True)
class _Item:
    """One write item of the rank's plan: a tensor to stage, or bytes as they are."""

    position: int  # in the plan
    fqn: str
    tensor: torch.Tensor | None
    raw: bytes = b""

    @property
    def nbytes(self) -> int:
        if self.tensor is None:
            return 0
        return aligned(self.tensor.numel() * self.tensor.element_size())


class _Bytes:
    """A CPU tensor's bytes, shaped as the storage a :class:`_Copy` copies from."""

    device = torch.device("cpu")

    def __init__(self, address: int, nbytes: int) -> None:
        self._address, self._nbytes = address, nbytes

    def data_ptr(self) -> int:
        return self._address

    def nbytes(self) -> int:
        return self._nbytes


class _Placed:
    """The sources of one wave and their offsets in the segment (what :class:`_Copy` reads)."""

    def __init__(self) -> None:
        self.storages: list[tuple[Any, int]] = []


class Waves:
    """One capped save of ``engine.dcp`` (see the module): the state's version counters,
    recorded at ``async_save``, the fence, and the waves ``write_data`` runs."""

    def __init__(
        self, memory: WaveMemory, state: dict[str, Any], recorded: _Recorded, events: Events
    ) -> None:
        self._memory = memory
        self._state = state
        self._events = events
        self._by_storage: dict[int, _Recorded] = {}
        for entry in recorded:
            self._by_storage.setdefault(entry[1].untyped_storage()._cdata, []).append(entry)
        self.fence: concurrent.futures.Future[None] = running_future()
        """Resolves when the last wave is copied (``staging_completion``), or fails."""

    def settle(self, error: BaseException | None) -> None:
        """The save ended: the fence resolves (with ``error``) if it has not yet."""
        if self.fence.done():
            return
        if error is not None:
            self.fence.set_exception(error)
        else:
            self.fence.set_result(None)

    # -- write_data ---------------------------------------------------------------------------

    def write(
        self,
        service: Service,
        tag: str,
        prefix: str,
        plan: SavePlan,
        planner: SavePlanner,
        coordinator: bool,
        metadata: Any,
    ) -> list[WriteResult]:
        """Stage and write the rank's ``plan`` in waves, one file each; durable on return.

        A failure before the first file (an item that cannot be staged) still goes through
        :meth:`Service.write_files`, so that this rank takes part in the tag's commit and
        every rank's commit fails at once instead of waiting for this one."""
        refused: BaseException | None = None
        try:
            items = [self._item(at, item, planner) for at, item in enumerate(plan.items)]
            waves = list(self._waves(items))
        except Exception as exc:  # noqa: BLE001 - raised by fill, once the file is reserved
            refused, waves = exc, [[]]
        names = [f"{prefix}{k}{DEFAULT_SUFFIX}" for k in range(len(waves))]

        def fill(jobs: list[FileJob], submit: Submit) -> None:
            if refused is not None:
                raise refused
            self._fill(service, jobs, submit, waves)

        written = service.write_files(tag, names, coordinator, metadata, fill)
        results: list[WriteResult] = []
        for name, wave, record in zip(names, waves, written, strict=True):
            if len(record.spans) != len(wave):
                raise CheckpointError(
                    f"{record.path}: the writer wrote {len(record.spans)} records of {len(wave)}"
                )
            results += [
                _result(plan, item.position, name, offset, length)
                for item, (offset, length) in zip(wave, record.spans, strict=True)
            ]
        return results

    def _item(self, position: int, item: Any, planner: SavePlanner) -> _Item:
        data: Any = planner.resolve_data(item)
        fqn = str(item.index.fqn)
        if item.type == WriteItemType.BYTE_IO:
            return _Item(position, fqn, None, bytes(data.getbuffer()))
        tensor: torch.Tensor = data.detach()
        problem = _problem(tensor)
        if problem is not None:
            raise InvalidStateError(f"cannot stage {fqn}: {problem}")
        found = _Item(position, fqn, tensor)
        if found.nbytes > self._memory.cap:
            raise CheckpointError(
                f"cannot stage {fqn} under the engine's staging cap: it holds "
                f"{found.nbytes / _MIB:.1f} MiB, the cap {self._memory.cap / _MIB:.1f} MiB. "
                "Open the engine with a larger staging_bytes, or shard the tensor"
            )
        return found

    def _waves(self, items: list[_Item]) -> Iterator[list[_Item]]:
        """The items in plan order, grouped into waves of at most half the cap each (an
        item larger than that alone); at least one wave, so that the rank writes a file."""
        wave: list[_Item] = []
        size = 0
        for item in items:
            if wave and size + item.nbytes > self._memory.half:
                yield wave
                wave, size = [], 0
            wave.append(item)
            size += item.nbytes
        yield wave

    def _fill(
        self, service: Service, jobs: list[FileJob], submit: Submit, waves: list[list[_Item]]
    ) -> None:
        memory = self._memory
        segment, pool = memory.parts()
        service.external.map(segment.path, segment.size)
        in_flight: list[tuple[FileJob, int, int]] = []  # (file, start, end) of the segment
        side = 0
        for number, (job, wave) in enumerate(zip(jobs, waves, strict=True)):
            nbytes = sum(item.nbytes for item in wave)
            start = 0 if nbytes > memory.half else side * memory.half
            end = start + max(nbytes, 1)
            side = 1 - side if nbytes <= memory.half else 0
            for entry in [e for e in in_flight if e[1] < end and start < e[2]]:
                entry[0].written.result()  # its part is free once its file is durable
                in_flight.remove(entry)
            records = self._copy(segment, pool, start, wave)
            if number == len(waves) - 1:
                self.fence.set_result(None)  # every tensor is copied and checked
            submit(job, records)
            in_flight.append((job, start, end))

    def _copy(
        self, segment: Segment, pool: CopyPool, start: int, wave: list[_Item]
    ) -> tuple[Record, ...]:
        """Copy ``wave`` into the segment from ``start``, check its version counters; its
        records."""
        placed = _Placed()
        keep: list[torch.Tensor] = []  # contiguous copies of views, alive until copied
        views: list[torch.Tensor | None] = []
        offset = start
        for item in wave:
            tensor = item.tensor
            if tensor is None:
                views.append(None)
                continue
            source = tensor if dense(tensor) else tensor.contiguous()
            nbytes = source.numel() * source.element_size()
            if nbytes and source.device.type == "cpu":
                placed.storages.append((_Bytes(source.data_ptr(), nbytes), offset))
            elif nbytes:  # CUDA: a storage of exactly its bytes, copied on a side stream
                storage = source.untyped_storage()
                if source.storage_offset() != 0 or storage.nbytes() != nbytes:
                    source = source.contiguous().clone()
                    storage = source.untyped_storage()
                placed.storages.append((storage, offset))
            keep.append(source)
            views.append(segment.tensor(offset, source.dtype, tuple(source.shape), source.stride()))
            offset += item.nbytes
        _Copy(segment, placed, self._events).run(pool)
        del keep
        self._check(wave)
        records: list[Record] = []
        offset = start
        for item, view in zip(wave, views, strict=True):
            if view is None:
                records.append(RawRecord(item.raw))
                continue
            nbytes = view.numel() * view.element_size()
            data = Span(segment.path, offset, nbytes) if nbytes else b""
            records.append(TorchRecord(tensor_pickle(view), (data,)))
            offset += item.nbytes
        return tuple(records)

    def _check(self, wave: list[_Item]) -> None:
        """Fail if a tensor of ``wave`` was modified in place since ``async_save``."""
        for item in wave:
            if item.tensor is None:
                continue
            for value, local, before in self._by_storage.get(
                item.tensor.untyped_storage()._cdata, ()
            ):
                after = _versions(value, local)
                moved = [(b, a) for b, a in zip(before, after, strict=True) if b not in (None, a)]
                if moved:
                    key = key_of(self._state, value) or item.fqn
                    (was, now), *_ = moved
                    raise CheckpointError(
                        f"cannot stage {key}: it was modified in place while it was being "
                        f"staged (its version counter moved from {was} to {now}); nothing of "
                        "this state is saved. Do not modify the state until the staging "
                        "completes (staging_completion)"
                    )


def _result(plan: SavePlan, position: int, name: str, offset: int, length: int) -> WriteResult:
    return WriteResult(
        index=plan.items[position].index,
        size_in_bytes=length,
        storage_data=_StorageInfo(name, offset, length),
    )
