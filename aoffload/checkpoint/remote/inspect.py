"""What the command line shows of a remote tier: ``aoffload ls|verify|inspect URL``.

The same functions as ``format/inspect.py``, for a URL instead of a directory. They read
the remote tier through :class:`~.worker.store.RemoteStore` on threads (the command line is
not a trainer: no uploader process is needed), with credentials from the environment and
fsspec's configuration. ``verify`` streams each file through xxh3-64 without storing it;
``inspect`` downloads a file (verified) into a temporary directory to load it.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..._errors import CheckpointError, CorruptCheckpointError
from ..format.inspect import FileCheck, FileSummary, TagInfo, pick, summarise, verify_each
from .worker.store import RemoteStore

__all__ = ["inspect_tag", "leftovers", "list_tags", "resolve_tags", "verify_tags"]

_stores: dict[str, RemoteStore] = {}


def _store(url: str) -> RemoteStore:
    store = _stores.get(url)
    if store is None:
        store = _stores[url] = RemoteStore(url)
    return store


async def list_tags(url: str) -> tuple[list[TagInfo], str | None]:
    """The published tags of ``url`` (by sequence, oldest first) and ``latest``.

    Raises :class:`CheckpointError` when ``url`` cannot be reached (a missing bucket, no
    credentials, access denied: at once) or holds no published checkpoint: an object store
    has no empty folders, so a prefix with nothing of aoffload's under it is either a wrong
    URL or a tier nothing was uploaded to yet.
    """
    store = await asyncio.to_thread(_store, url)
    scan = await asyncio.to_thread(store.scan)
    if not scan.manifests and scan.latest is None:
        raise CheckpointError(
            f"{store.url} holds no published checkpoint (no 'latest', no tag with a "
            "manifest): a wrong URL, or nothing was uploaded there yet"
        )
    infos = []
    for tag, manifest in scan.manifests.items():
        try:
            infos.append(
                TagInfo(
                    tag,
                    int(manifest["sequence"]),
                    dict(manifest["files"]),
                    float(manifest["created"]),
                    metadata=dict(manifest.get("metadata") or {}),
                )
            )
        except (KeyError, TypeError, ValueError) as exc:
            infos.append(TagInfo(tag, -1, {}, None, f"unreadable manifest: {exc}"))
    infos.sort(key=lambda info: (info.sequence, info.tag))
    return infos, scan.latest


async def resolve_tags(url: str, tag: str | None, every: bool) -> list[TagInfo]:
    """The tags a command acts on: ``tag``, every published tag, or the latest one."""
    infos, latest = await list_tags(url)
    return pick(infos, latest, tag, every, _store(url).url, "published")


async def verify_tags(
    url: str, infos: list[TagInfo], progress: Callable[[int], object] | None = None
) -> list[FileCheck]:
    """Check every remote file of ``infos`` against its manifest, streamed, one by one."""
    store = _store(url)

    def check(info: TagInfo, name: str, entry: dict[str, Any]) -> str | None:
        try:
            found = store.hash_remote(info.tag, name)
        except CheckpointError as exc:
            error = str(exc)
        else:
            if found.bytes == int(entry["bytes"]) and found.xxh3_64 == entry["xxh3_64"]:
                return None
            error = (
                f"{found.bytes} bytes, the manifest says {entry['bytes']}"
                if found.bytes != int(entry["bytes"])
                else "checksum mismatch (xxh3-64); the file is corrupt"
            )
        return f"{store.url}/{info.tag}/{name}: {error}"

    return await verify_each(infos, check, progress)


def _summarise_remote(
    store: RemoteStore, info: TagInfo, name: str, weights_only: bool
) -> FileSummary:
    with tempfile.TemporaryDirectory(prefix="aoffload-inspect-") as scratch:
        target = Path(scratch) / info.tag / name
        target.parent.mkdir(parents=True)
        try:
            store.fetch(info.tag, name, info.files[name], str(target))
        except (CheckpointError, CorruptCheckpointError) as exc:
            return FileSummary(name, error=str(exc))
        # fetch() verified the download against the manifest: no second read of it
        return summarise(Path(scratch), info, name, weights_only, verify=False)


async def inspect_tag(url: str, info: TagInfo, *, weights_only: bool = True) -> list[FileSummary]:
    """A :class:`FileSummary` of every file of ``info``, each downloaded and loaded
    (``weights_only=False``: the caller trusts the files)."""
    store = _store(url)
    return [
        await asyncio.to_thread(_summarise_remote, store, info, name, weights_only)
        for name in info.files
    ]


def leftovers(url: str) -> list[tuple[Path, int]]:
    """A remote tier has no leftovers the command line removes (it only reads there)."""
    return []
