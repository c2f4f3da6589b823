"""Reading a committed checkpoint without an engine: :func:`load_checkpoint` and
:func:`load_metadata`, for a directory or a remote tier's URL.

Both return a :class:`~aoffload.Handle` at once; the work runs on a thread of its own (a
URL's through an uploader started for the call, wired by the assembler).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._errors import CorruptCheckpointError
from .._runtime.handle import Handle, in_thread
from ._assemble import load_url, metadata_url
from .core.load import MapLocation, load_file, temporary_loader
from .format import read
from .format.layout import is_url

__all__ = ["load_checkpoint", "load_metadata"]


def load_checkpoint(
    directory: str | os.PathLike[str],
    name: str,
    tag: str | None = None,
    *,
    map_location: MapLocation = "cpu",
    verify: bool = True,
    weights_only: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> Handle[Any]:
    """Load file ``name`` of a committed checkpoint in ``directory``, without an engine.

    Returns at once with a :class:`~aoffload.Handle` of the loaded object: ``await`` it in
    asyncio code, or call ``.result()``.

    ``directory`` may be a remote tier's URL (``s3://bucket/run``, reached with
    ``storage_options``): the file is then downloaded by a worker started for the call,
    verified against the remote manifest, and loaded.

    ``tag=None`` reads the checkpoint ``latest`` names. The file's size and xxh3-64 are
    checked against the manifest (``verify=False`` skips that), then it is loaded with
    ``torch.load(..., weights_only=True, map_location=map_location)`` on a thread of its
    own (in a worker process started for the call when the file holds large non-tensor
    values, so that unpickling them does not stall the loop). ``weights_only=False`` is
    your explicit opt-in, as with ``torch.load``, for a file **you trust** that holds
    other objects (a numpy RNG state): unpickling it can run arbitrary code. Raises
    :class:`CorruptCheckpointError` naming the file on a mismatch or a missing file, and
    :class:`CheckpointError` for an unknown tag or name. An abandoned wait abandons the
    wait only; the load ends on its thread.
    """
    if is_url(directory):
        return in_thread(
            load_url, directory, name, tag, storage_options, map_location, verify,
            weights_only, name="aoffload-load",
        )  # fmt: skip
    return in_thread(
        load_file,
        Path(directory),
        name,
        tag,
        map_location,
        verify,
        temporary_loader,
        weights_only,
        name="aoffload-load",
    )


def load_metadata(
    directory: str | os.PathLike[str],
    tag: str | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
) -> Handle[dict[str, Any]]:
    """The metadata committed with checkpoint ``tag`` of ``directory``, without an engine.

    Returns at once with a :class:`~aoffload.Handle` of the mapping: ``await`` it in
    asyncio code, or call ``.result()``.

    ``tag=None`` reads the checkpoint ``latest`` names. Returns ``{}`` for a checkpoint
    committed without metadata. The manifest is read on a thread of its own. ``directory``
    may be a remote tier's URL (reached with ``storage_options``), read by a worker started
    for the call. Raises :class:`CheckpointError` for an unknown tag (or none committed),
    :class:`CorruptCheckpointError` for an unreadable manifest.
    """
    if is_url(directory):
        return in_thread(metadata_url, directory, tag, storage_options, name="aoffload-load")

    def read_metadata() -> dict[str, Any]:
        _, manifest = read.find_tag(Path(directory), tag)
        metadata = manifest.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise CorruptCheckpointError(f"{directory}: the manifest's metadata is not a mapping")
        return metadata

    return in_thread(read_metadata, name="aoffload-load")
