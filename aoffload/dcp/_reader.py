"""``StorageReader``: DCP's reader over aoffload's checkpoint directories, verified.

DCP calls it in this order (``torch.distributed.checkpoint.StorageReader``): on every
rank ``reset`` (when ``dcp.load`` gets a ``checkpoint_id``), ``read_metadata``,
``set_up_storage_reader``, ``prepare_local_plan``; on the coordinator
``prepare_global_plan``; on every rank ``read_data``. DCP's planner (not this reader)
decides which slice of which saved chunk each rank reads, so a state saved on N ranks
loads on M; the reader only reads the byte ranges the planner asks for.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import uuid
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, cast
from urllib.parse import urlparse

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader as _DcpStorageReader
from torch.futures import Future

from .._errors import CheckpointError, CorruptCheckpointError
from ..checkpoint.remote.url import RemoteTag
from ._location import METADATA, Checkpoint, locate
from ._metadata import StorageInfo, load_metadata

__all__ = ["StorageReader"]

MAX_METADATA_BYTES = 1 << 30
"""The largest ``.metadata`` read; a larger one is corrupt."""


@dataclasses.dataclass(frozen=True)
class _Source:
    """What each rank's local plan carries: the checkpoint directory it resolved."""

    path: str


class _Slice(io.RawIOBase):
    """``length`` bytes of the file ``fd`` from ``offset``, read with ``pread`` (the
    descriptor is the caller's; closing the slice leaves it open)."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        super().__init__()
        self._fd, self._start, self._length, self._position = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        self._position = max(0, base + position)
        return self._position

    def readinto(self, buffer: Any) -> int:
        count = min(len(buffer), self._length - self._position)
        if count <= 0:
            return 0
        with memoryview(buffer) as view:
            got = os.preadv(self._fd, [view[:count]], self._start + self._position)
        self._position += got
        return got


def _where(directory_or_url: str | os.PathLike[str]) -> Path | str:
    """A local directory (a ``file://`` URL included), or a remote tier's URL."""
    text = os.fspath(directory_or_url)
    parsed = urlparse(text)
    if parsed.scheme == "file":
        return Path(parsed.path)
    return text if "://" in text else Path(text)


class StorageReader(_DcpStorageReader):
    """DCP's ``StorageReader`` for an aoffload checkpoint directory, verified before it is read.

    ``directory_or_url`` is an aoffload checkpoint directory (its ``latest`` is read, or
    ``tag``), one committed tag's directory, a plain DCP checkpoint directory (read
    without verification, which is logged at WARNING naming the directory), or the URL
    of a remote tier (``s3://bucket/run``, reached with ``storage_options`` as the engine's
    ``remote=`` is): each rank then downloads the files it reads, verified against the
    remote manifest, into a temporary directory removed once DCP has read them. Use it with
    ``dcp.load(state_dict, storage_reader=StorageReader("ckpt"))``; DCP's planners then
    load a state saved on N ranks into M.

    Before DCP reads a file, the file is checked against the tag's manifest (size and
    xxh3-64): a mismatch, a missing file, or a file DCP's metadata names that the manifest
    lacks is a :class:`~aoffload.CorruptCheckpointError` naming it. The checkpoint is
    resolved and its ``.metadata`` read and checked when the reader is made (or reset by
    ``dcp.load(checkpoint_id=...)``), so those errors raise there; a damaged data file is
    found as DCP reads it, and DCP raises its own ``CheckpointException`` whose
    ``failures[rank]`` holds the error. A tag directory without a manifest (a save that
    never committed) is refused.

    ``.metadata`` is unpickled with an allow-list of DCP's metadata classes, and non-tensor
    values are loaded with ``torch.load(weights_only=True)`` before DCP's planner sees them,
    so a hostile directory cannot run code. ``weights_only=False`` is the explicit opt-in
    for a checkpoint you trust that holds other objects (DCP's own reader unpickles
    everything). If another process commits while the ranks resolve ``latest``, they may
    resolve different tags: the load then fails on every rank, and ``tag=`` avoids it.
    """

    def __init__(
        self,
        directory_or_url: str | os.PathLike[str],
        tag: str | None = None,
        *,
        weights_only: bool = True,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self._location = _where(directory_or_url)
        self._tag = tag
        self.weights_only = weights_only
        self._storage_options = storage_options
        self._remote: RemoteTag | None = None
        self.storage_data: dict[MetadataIndex, StorageInfo] = {}
        self.load_id = str(uuid.uuid4())
        self._metadata: Metadata | None
        self._checkpoint, self._metadata = self._prepare()

    def _prepare(self) -> tuple[Checkpoint, Metadata]:
        # Done where the reader is made (or reset), not in read_metadata: DCP turns any
        # error of its metadata step into an AssertionError of its own, while a missing,
        # damaged or hostile checkpoint should raise its own error, naming the file.
        self.close()
        location = self._location
        if isinstance(location, str):  # a remote tier: its files are fetched as they are read
            remote = RemoteTag(location, self._tag, self._storage_options)
            self._remote = remote
            weakref.finalize(self, remote.close)
            try:
                remote.fetch(METADATA)
                checkpoint = locate(remote.root, remote.tag)
            except BaseException:
                self.close()
                raise
        else:
            checkpoint = locate(location, self._tag)
        data = checkpoint.read(METADATA, MAX_METADATA_BYTES)
        metadata = load_metadata(data, checkpoint.path / METADATA, weights_only=self.weights_only)
        return checkpoint, metadata

    def close(self) -> None:
        """Stop fetching from the remote tier and remove what was downloaded (after
        ``read_data``, which does it itself). Idempotent; nothing for a local directory."""
        remote, self._remote = self._remote, None
        if remote is not None:
            remote.close()

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new read; a ``checkpoint_id`` (from ``dcp.load``) replaces the location
        and the tag (it names one checkpoint as ``directory_or_url`` does)."""
        if checkpoint_id:
            self._location, self._tag = _where(checkpoint_id), None
        self.storage_data = {}
        self.load_id = str(uuid.uuid4())
        self._checkpoint, self._metadata = self._prepare()

    @property
    def checkpoint_id(self) -> Path | str:
        """The checkpoint: a committed tag's directory, the plain DCP directory, or the
        remote tier's tag (``URL/tag``)."""
        if isinstance(self._location, str):
            return f"{self._location.rstrip('/')}/{self._checkpoint.relative}"
        return self._checkpoint.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a local directory, or a URL, this reader can try."""
        where = _where(checkpoint_id)
        return isinstance(where, str) or where.is_dir()

    # ``**options``, not ``**kwargs``: DCP retries a failed read as a rank-local one when
    # this method has a parameter named ``kwargs``, and reports its own error instead.
    def read_metadata(self, *args: Any, **options: Any) -> Metadata:
        """DCP's metadata of the checkpoint, verified and unpickled with the allow-list
        (read when the reader was made or reset; a reader used again reads it again)."""
        metadata = self._metadata
        if metadata is None:
            self._checkpoint, metadata = self._prepare()
        self._metadata = None
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Keep where each item lies (checked by :meth:`read_metadata`)."""
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Tag the plan with the checkpoint this rank resolved."""
        return dataclasses.replace(plan, storage_data=_Source(str(self.checkpoint_id)))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Refuse a load whose ranks resolved different checkpoints."""
        sources = sorted({str(getattr(p.storage_data, "path", None)) for p in plans})
        if len(sources) > 1:
            raise CheckpointError(
                f"the ranks resolved different checkpoints ({', '.join(sources)}): a commit "
                "moved 'latest' while they read it; pass tag= so that every rank reads the same"
            )
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Verify each file the plan reads, then read its items into the planner's tensors
        (from a remote tier: download it first; the downloads go once all are read)."""
        checkpoint = self._checkpoint
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self._info(item).relative_path, []).append(item)
        try:
            for name, items in per_file.items():
                if self._remote is not None:
                    self._remote.fetch(name)
                fd = checkpoint.open(name)
                try:
                    size = os.fstat(fd).st_size
                    for item in sorted(items, key=lambda i: self._info(i).offset):
                        self._read_item(fd, size, checkpoint.path / name, item, planner)
                finally:
                    os.close(fd)
        finally:
            self.close()
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _info(self, item: ReadItem) -> StorageInfo:
        try:
            return self.storage_data[item.storage_index]
        except KeyError:
            raise CorruptCheckpointError(
                f"{self.checkpoint_id}: DCP's metadata does not say where "
                f"{item.storage_index.fqn!r} lies"
            ) from None

    def _read_item(
        self, fd: int, size: int, path: Path, item: ReadItem, planner: LoadPlanner
    ) -> None:
        info = self._info(item)
        fqn = item.storage_index.fqn
        end = info.offset + info.length
        if end > size:
            raise CorruptCheckpointError(
                f"{path}: {fqn!r} lies at bytes {info.offset}-{end}, past the file's {size} bytes"
            )
        view = _Slice(fd, info.offset, info.length)
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, self._value(view.read(), path, fqn))
            return
        tensor = _tensor(view, path, fqn)
        offsets, lengths = tuple(item.storage_offsets), tuple(item.lengths)
        shape = tuple(tensor.shape)
        if not (len(offsets) == len(lengths) == len(shape)) or any(
            o < 0 or o + n > size for o, n, size in zip(offsets, lengths, shape, strict=True)
        ):
            raise CorruptCheckpointError(
                f"{path}: {fqn!r} of shape {tuple(tensor.shape)} holds no slice at {offsets} "
                f"of {lengths}"
            )
        for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
            if length < tensor.size(dim):
                tensor = tensor.narrow(dim, offset, length)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise CorruptCheckpointError(
                f"{path}: {fqn!r} is {tuple(tensor.shape)} there, {tuple(target.shape)} in the "
                "state being loaded"
            )
        target.copy_(tensor)
        planner.commit_tensor(item, target)

    def _value(self, data: bytes, path: Path, fqn: str) -> io.BytesIO:
        if not self.weights_only:
            return io.BytesIO(data)
        try:
            value = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            why = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise CheckpointError(
                f"{path}: the value of {fqn!r} holds objects that weights_only=True does not "
                f"load ({why}); allow their classes with torch.serialization.add_safe_globals, "
                "or pass weights_only=False only for a checkpoint you trust"
            ) from None
        except Exception as exc:  # a malformed record, whatever torch raises for it
            raise CorruptCheckpointError(f"{path}: the value of {fqn!r} cannot be read") from exc
        # DCP's planner unpickles what it is given without restriction: give it a fresh
        # record of what the safe load produced, never the bytes from the directory.
        fresh = io.BytesIO()
        torch.save(value, fresh)
        fresh.seek(0)
        return fresh


def _tensor(view: _Slice, path: Path, fqn: str) -> torch.Tensor:
    try:
        tensor = torch.load(cast(IO[bytes], view), map_location="cpu", weights_only=True)
    except Exception as exc:  # a malformed record, whatever torch raises for it
        raise CorruptCheckpointError(f"{path}: the tensor {fqn!r} cannot be read") from exc
    if not isinstance(tensor, torch.Tensor):
        raise CorruptCheckpointError(f"{path}: {fqn!r} holds a {type(tensor).__name__}")
    return tensor
