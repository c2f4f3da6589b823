"""``StorageWriter``: DCP's writer through an aoffload engine: verified, published, ``latest``.

DCP calls it in this order (``torch.distributed.checkpoint.StorageWriter``), on DCP's
thread (``dcp.save``, ``async_save`` in ``THREAD`` mode) or in DCP's daemon
(``PROCESS`` mode, which pickles the writer: it then reaches its engine through the
engine's door, :mod:`._door`):

0. every rank: ``reset(checkpoint_id)`` when ``dcp.save`` gets one (it names the tag);
1. every rank: ``set_up_storage_writer``, then ``prepare_local_plan``;
2. the coordinator: ``prepare_global_plan``: rank *i*'s file is ``__<i>_0.distcp``, as
   DCP's ``FileSystemWriter`` names it;
3. every rank: ``write_data``: each item's record (a tensor: its ``torch.save`` pickle and
   its bytes as a span of staging memory, no copy when a :class:`~aoffload.dcp.Stager`
   staged it; any other value: the planner's bytes) goes to the engine's writer process in
   one call per file; it returns once the file is durable, and the rank has started the
   engine's commit of the tag (:mod:`._service`);
4. the coordinator: ``finish``: DCP's ``.metadata``, written through the writer, then the
   commit awaited: the manifest with every file's checksum, the atomic publication of the
   tag, ``latest``, retention, the remote tier. A failure on any rank raises on every rank.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    DEFAULT_SUFFIX,
    _StorageInfo,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter as _DcpStorageWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .._errors import CheckpointError
from ..checkpoint import _running
from ..checkpoint.format import layout
from ..checkpoint.writer.calls import FileRecord, RawRecord, Record, Span, TorchRecord
from ._door import DoorAddress, call
from ._memory import Locator
from ._records import dense, tensor_pickle
from ._service import Finish, Release, Service, WriteRank
from ._stager import Stager

if TYPE_CHECKING:
    from ._waves import Waves

__all__ = ["StorageWriter"]


class StorageWriter(_DcpStorageWriter):
    """DCP's ``StorageWriter`` that saves through a running :class:`~aoffload.CheckpointEngine`.

    ::

        with aoffload.CheckpointEngine("ckpt", distributed=True, keep_last=3) as engine:
            ...
            dcp.async_save(state_dict, async_stager=stager,
                           storage_writer=StorageWriter("ckpt", tag=f"step-{step}"))

    ``directory_or_url`` names the engine's directory (or its ``remote=`` URL); the engine
    running on it in this process is used, or pass ``engine=``. ``tag`` names the
    checkpoint (or ``dcp.save(..., checkpoint_id=tag)``); ``metadata`` (JSON values) is
    stored in its manifest, as ``commit(metadata=...)`` stores it. Every item goes through
    the engine's writer process (``O_DIRECT``, xxh3-64, fsync); ``finish`` commits: DCP's
    ``.metadata`` plus aoffload's manifest with every file's checksum, published
    atomically, ``latest`` moved, old tags retired, the remote tier uploaded. A save killed
    at any point leaves ``latest`` on the last good tag. The tag is a plain DCP checkpoint
    directory too (``FileSystemReader`` reads it); :class:`~aoffload.dcp.StorageReader`
    reads it verified. On several ranks open the engine with ``distributed=True``.

    Tensors staged by :class:`~aoffload.dcp.Stager` are written from its staging memory;
    any other tensor is copied into staging memory first. Works with ``dcp.save`` and
    ``dcp.async_save`` in ``THREAD`` and ``PROCESS`` modes (it pickles the engine's door:
    DCP's daemon writes through the trainer's engine, on the same host).
    """

    def __init__(
        self,
        directory_or_url: str | os.PathLike[str],
        tag: str | None = None,
        *,
        engine: Any = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self._location = os.fspath(directory_or_url)
        self._local = not layout.is_url(self._location)
        self.tag = None if tag is None else layout.validate_tag(tag)
        self.metadata = None if metadata is None else dict(metadata)
        self.is_coordinator = False
        self.save_id = str(uuid.uuid4())
        self._engine = engine
        self._door: DoorAddress | None = None
        self.refuse: BaseException | None = None
        """Set (by ``engine.dcp``) when this rank's staging failed: the save fails at its
        first step, on every rank, with this error."""
        self.waves: Waves | None = None
        """Set (by ``engine.dcp``) for a state larger than the engine's staging cap: the
        items are staged here, in waves, each written as a file (:mod:`._waves`)."""

    # -- where it writes ------------------------------------------------------------------

    def _service(self) -> Service:
        engine = self._engine
        if engine is None:
            engine = _running.running(self._location)
        if engine is None:
            raise CheckpointError(
                f"no aoffload CheckpointEngine is running on {self._location} in this process: "
                "open one there (distributed=True on several ranks) before saving through "
                "aoffload.dcp.StorageWriter, or pass engine="
            )
        service: Service = engine.dcp.service
        return service

    def _link(self) -> Callable[[object], Any]:
        door = self._door
        if door is not None:
            return lambda request: call(door, request)
        return self._service().serve

    def __getstate__(self) -> dict[str, Any]:
        """DCP's PROCESS mode pickles the writer: it carries its engine's door, not the engine."""
        state = self.__dict__.copy()
        if state["_door"] is None:
            state["_door"] = self._service().door()
        state["_engine"] = None
        state["waves"] = None  # only engine.dcp sets it, and never pickles its writer
        return state

    @property
    def checkpoint_id(self) -> str | Path:
        """The checkpoint's location: its tag's directory (or URL) once the tag is known."""
        base = self._location.rstrip("/") if not self._local else Path(self._location)
        if self.tag is None:
            return base
        return base / self.tag if isinstance(base, Path) else f"{base}/{self.tag}"

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` can name a tag (a tag, or a path or URL ending in one)."""
        try:
            layout.validate_tag(os.fspath(checkpoint_id).rstrip("/").rsplit("/", 1)[-1])
        except CheckpointError:
            return False
        return True

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new save; a ``checkpoint_id`` names its tag: the tag itself, or the tag's
        path (or URL) under this writer's directory."""
        self.save_id = str(uuid.uuid4())
        if not checkpoint_id:
            return
        text = os.fspath(checkpoint_id).rstrip("/")
        parent, _, name = text.rpartition("/")
        if parent:
            same = (
                Path(parent).resolve() == Path(self._location).resolve()
                if self._local
                else parent == self._location.rstrip("/")
            )
            if not same:
                raise CheckpointError(
                    f"checkpoint_id {text!r} is not a tag of {self._location}: pass the tag's "
                    "name, or a path under the writer's directory"
                )
        self.tag = layout.validate_tag(name)

    def storage_meta(self) -> StorageMeta:
        """What DCP records of this save: its location and id."""
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    # -- the save ----------------------------------------------------------------------------

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Take this rank's role; refuse what the writer cannot do, before anything is written."""
        self.is_coordinator = is_coordinator
        if self.refuse is not None:
            raise self.refuse
        if kwargs.get("use_collectives", True) is False:
            raise CheckpointError(
                "aoffload.dcp.StorageWriter needs DCP's collectives (rank-local metadata, "
                "use_collectives=False, is not supported)"
            )
        if self.tag is None:
            raise CheckpointError(
                "name the checkpoint: StorageWriter(directory, tag=...), or "
                "dcp.save(..., checkpoint_id=tag)"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """The plan as it is."""
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Rank *i* writes ``__<i>_0.distcp``, as ``FileSystemWriter`` names it."""
        return [
            dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{i}_"))
            for i, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items as one file through the engine; durable on return."""
        tag = self.tag
        if tag is None:  # pragma: no cover - set_up_storage_writer refused it
            raise CheckpointError("no tag")
        prefix = plan.storage_data.prefix if isinstance(plan.storage_data, _StoragePrefix) else ""
        future: Future[list[WriteResult]] = Future()
        if self.waves is not None:
            results = self.waves.write(self._service(), tag, prefix or "__0_", plan, planner,
                                       self.is_coordinator, self.metadata)  # fmt: skip
            future.set_result(results)
            return future
        name = f"{prefix or '__0_'}0{DEFAULT_SUFFIX}"
        link = self._link()
        scratch: list[Stager] = []
        refused: Exception | None = None
        try:
            try:
                done, segments = _records(plan, planner, scratch)
                request = WriteRank(tag, ((name, done),), segments, self.is_coordinator,
                                    self.metadata)  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - raised once this rank's commit started
                refused = exc
                request = WriteRank(tag, ((name, ()),), (), self.is_coordinator, self.metadata,
                                    f"{type(exc).__name__}: {exc}")  # fmt: skip
            try:
                [written] = link(request)
            except BaseException:
                if refused is not None:
                    raise refused from None
                raise
        finally:
            for stager in scratch:
                paths = tuple(segment.path for segment in stager._segments)
                try:
                    link(Release(paths))
                finally:
                    stager.close()
        future.set_result(_results(plan, name, written))
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Write DCP's ``.metadata`` and commit the tag (the coordinator; see the module)."""
        if self.tag is None:  # pragma: no cover - set_up_storage_writer refused it
            raise CheckpointError("no tag")
        metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
        metadata.storage_meta = self.storage_meta()
        metadata.version = CURRENT_DCP_VERSION
        self._link()(Finish(self.tag, pickle.dumps(metadata)))


def _records(
    plan: SavePlan, planner: SavePlanner, scratch: list[Stager]
) -> tuple[tuple[Record, ...], tuple[str, ...]]:
    """The rank's records, and the staging segments their spans name. Tensors not in
    aoffload's staging memory are copied there by a scratch stager, appended to
    ``scratch`` (the caller releases it)."""
    locator = Locator()
    records: list[Record | None] = []
    copies: dict[str, torch.Tensor] = {}
    for index, item in enumerate(plan.items):
        data: Any = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            records.append(RawRecord(bytes(data.getbuffer())))
            continue
        tensor: torch.Tensor = data.detach()
        record = _tensor_record(tensor, locator)
        if record is None:
            copies[str(index)] = tensor if dense(tensor) else tensor.contiguous()
        records.append(record)
    if copies:
        stager = Stager()
        scratch.append(stager)
        for key, staged in stager.stage(copies).result().items():
            records[int(key)] = _tensor_record(staged, locator)
    done = tuple(r for r in records if r is not None)
    if len(done) != len(records):  # pragma: no cover - a staged tensor is found
        raise CheckpointError("a staged tensor was not found in staging memory")
    segments = sorted({s.segment for r in done if isinstance(r, TorchRecord) for s in _spans(r)})
    return done, tuple(segments)


def _spans(record: TorchRecord) -> list[Span]:
    return [s for s in record.storages if isinstance(s, Span)]


def _tensor_record(tensor: torch.Tensor, locator: Locator) -> TorchRecord | None:
    """``tensor``'s record, if its bytes lie in aoffload's staging memory (or it has none)."""
    if tensor.numel() == 0:
        return TorchRecord(tensor_pickle(tensor.contiguous()), (b"",))
    if not dense(tensor):
        return None
    found = locator.find(tensor)
    if found is None:
        return None
    path, offset = found
    span = Span(path, offset, tensor.numel() * tensor.element_size())
    return TorchRecord(tensor_pickle(tensor), (span,))


def _results(plan: SavePlan, name: str, written: FileRecord) -> list[WriteResult]:
    """Each item's ``WriteResult``: where DCP's readers find its record."""
    if len(written.spans) != len(plan.items):
        raise CheckpointError(
            f"{written.path}: the writer wrote {len(written.spans)} records of "
            f"{len(plan.items)} items"
        )
    return [
        WriteResult(
            index=item.index, size_in_bytes=length, storage_data=_StorageInfo(name, offset, length)
        )
        for item, (offset, length) in zip(plan.items, written.spans, strict=True)
    ]
