"""DCP's ``.metadata`` unpickled with an allow-list, then checked before anything uses it.

DCP's own reader calls ``pickle.load`` on ``.metadata``, so a checkpoint directory from
someone else can run any code on load. Here the unpickler resolves only the classes that
``FileSystemWriter`` puts there (DCP's metadata dataclasses, ``torch.Size``, dtypes and
layouts, the path of ``checkpoint_id``); any other global is refused before it is
imported. The object is then checked for the shape the reader relies on: every storage
entry names a plain file and a non-negative byte range. ``weights_only=False`` is the
caller's explicit opt-in to DCP's own ``pickle.load``, for a directory it trusts.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
import torch.serialization
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from .._errors import CorruptCheckpointError

__all__ = ["ALLOWED", "StorageInfo", "load_metadata"]

StorageInfo = _StorageInfo
"""Where ``FileSystemWriter`` put one item: a file, an offset and a length in bytes."""

_DCP_CLASSES = (
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "Metadata",
    "MetadataIndex",
    "StorageMeta",
    "TensorProperties",
    "TensorStorageMetadata",
    "_MEM_FORMAT_ENCODING",
)


def _allowed() -> dict[tuple[str, str], Any]:
    allowed: dict[tuple[str, str], Any] = {
        ("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
        for name in _DCP_CLASSES
    }
    allowed["torch.distributed.checkpoint.filesystem", "_StorageInfo"] = _StorageInfo
    allowed["torch", "Size"] = torch.Size
    allowed["torch.serialization", "_get_layout"] = torch.serialization._get_layout
    allowed["collections", "OrderedDict"] = OrderedDict
    for module in ("pathlib", "pathlib._local"):
        for name in ("PosixPath", "PurePosixPath"):
            allowed[module, name] = getattr(pathlib, name)
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype):
            allowed["torch", name] = value
    return allowed


ALLOWED: dict[tuple[str, str], Any] = _allowed()
"""Every global ``.metadata`` may name: ``(module, name) -> object``."""


class _Refused(pickle.UnpicklingError):
    def __init__(self, module: str, name: str) -> None:
        super().__init__(f"{module}.{name}")
        self.global_name = f"{module}.{name}"


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return ALLOWED[module, name]
        except KeyError:
            raise _Refused(module, name) from None


def load_metadata(data: bytes, path: Path, *, weights_only: bool) -> Metadata:
    """The :class:`Metadata` in ``data`` (read from ``path``), checked; with
    ``weights_only`` (the default of the reader) unpickled with :data:`ALLOWED` only."""
    try:
        # weights_only=False: the caller trusts this directory, as DCP's own reader does
        loaded = _Unpickler(io.BytesIO(data)).load() if weights_only else pickle.loads(data)
    except _Refused as exc:
        raise CorruptCheckpointError(
            f"{path}: DCP's metadata refers to {exc.global_name}, which is none of DCP's "
            "metadata classes, so it is not unpickled (a hostile file could run code that "
            "way). Pass weights_only=False only for a checkpoint you trust"
        ) from None
    except Exception as exc:  # any error of a malformed pickle, whatever its type
        raise CorruptCheckpointError(
            f"{path}: DCP's metadata cannot be read ({type(exc).__name__}: {exc})"
        ) from exc
    return _checked(loaded, path)


def _checked(loaded: object, path: Path) -> Metadata:
    def corrupt(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{path}: not DCP metadata of the expected shape: {why}")

    if not isinstance(loaded, Metadata):
        raise corrupt(f"it holds a {type(loaded).__name__}")
    entries = loaded.state_dict_metadata
    if not isinstance(entries, dict) or not all(
        isinstance(key, str) and isinstance(value, TensorStorageMetadata | BytesStorageMetadata)
        for key, value in entries.items()
    ):
        raise corrupt("state_dict_metadata is not a mapping of names to tensor or bytes entries")
    storage = loaded.storage_data
    if not isinstance(storage, dict):
        raise corrupt("storage_data is not a mapping (a StorageWriter other than DCP's?)")
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise corrupt(
                f"storage_data maps {type(index).__name__} to {type(info).__name__}, not "
                "MetadataIndex to FileSystemWriter's _StorageInfo"
            )
        if not isinstance(info.relative_path, str) or any(
            type(n) is not int or n < 0 for n in (info.offset, info.length)
        ):
            raise corrupt(f"the storage entry of {index.fqn!r} is {info!r}")
        if info.transform_descriptors:
            raise corrupt(
                f"{index.fqn!r} was written through DCP's stream extensions "
                f"({info.transform_descriptors}), which aoffload.dcp does not read"
            )
    if loaded.storage_meta is not None and not isinstance(loaded.storage_meta, StorageMeta):
        raise corrupt(f"storage_meta is a {type(loaded.storage_meta).__name__}")
    return loaded
