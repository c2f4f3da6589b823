"""Resume anywhere: the remote tier as the engine's start, ``load()`` and
:func:`~aoffload.load_checkpoint` see it.

At start, the tags of both tiers make one catalog (:func:`merge`), ordered by the
manifests' sequence numbers. A file that is not in the local directory is downloaded by the
uploader, verified against the remote manifest (size and xxh3-64), and kept in
``directory/.remote-cache/<tag>/`` (laid out as a checkpoint directory of its own, with the
remote manifest), so the next load reads the disk (:func:`source`). Only the files loaded are
downloaded: each rank of a resuming job fetches its own shard. Everything here blocks: it
runs on the load thread, or on a thread of its own for :func:`load_url`.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._errors import CheckpointError
from ..core.commit import CommitResult
from ..core.load import MapLocation, Remote, load_file
from ..format import layout, read, write
from .worker.calls import Fetch
from .worker.store import RemoteScan

if TYPE_CHECKING:
    from .tier import RemoteTier

__all__ = ["CACHE", "load_either", "load_url", "merge", "metadata_url", "result_of", "source"]

logger = logging.getLogger(__name__)

CACHE = ".remote-cache"
"""Where downloaded files are kept, laid out as a checkpoint directory of its own."""
_LOADER_SECONDS = 120.0


def merge(local: layout.Scan, directory: Path, remote: RemoteScan) -> layout.Scan:
    """The tags of both tiers, oldest first by sequence; ``latest`` the newer of the two."""
    sequences = remote.sequences()
    for tag in local.tags:
        try:
            manifest = read.read_manifest(directory / tag / layout.MANIFEST)
            sequences[tag] = int(manifest["sequence"])
        except (OSError, CheckpointError, KeyError, ValueError):
            sequences.setdefault(tag, 0)
    tags = [tag for _, tag in sorted((s, t) for t, s in sequences.items())]
    candidates = [t for t in (local.latest, remote.latest) if t is not None and t in sequences]
    latest = max(candidates, key=lambda t: sequences[t], default=local.latest)
    metadata = {t: dict(m["metadata"]) for t, m in remote.manifests.items() if m.get("metadata")}
    metadata.update(local.metadata)
    return layout.Scan(tags, max([local.sequence, *sequences.values()]), latest, metadata)


def result_of(directory: Path, manifest: Mapping[str, Any]) -> CommitResult:
    """A :class:`CommitResult` for a tag this engine did not commit (from its manifest)."""
    files = {name: int(entry["bytes"]) for name, entry in manifest["files"].items()}
    tag = str(manifest["tag"])
    metadata = dict(manifest.get("metadata") or {})
    return CommitResult(
        tag, directory / tag, tuple(files), sum(files.values()), 0.0, 0.0, 0.0, metadata
    )


def source(
    tier: RemoteTier, name: str, tag: str, known: list[str] | None = None
) -> tuple[Path, bool]:
    """The directory to load file ``name`` of ``tag`` from, and whether it was just
    downloaded (and verified). Local first; else the file is downloaded into the cache
    (verified against the remote manifest), once; cached tags not in ``known`` (the
    engine's tags, retention applied) are removed then. Blocking: the load thread."""
    local = tier.directory / tag / layout.MANIFEST
    if local.is_file() and name in read.read_manifest(local)["files"]:
        return tier.directory, False
    cache = tier.directory / CACHE
    manifest = tier.manifest(tag)
    entry = manifest["files"].get(name)
    if entry is None:
        raise CheckpointError(
            f"checkpoint {tag!r} has no file {name!r}; it has {sorted(manifest['files'])}"
        )
    target = cache / tag / name
    fresh = not target.is_file()
    if fresh:
        if known is not None and cache.is_dir():
            for old in os.listdir(cache):
                if old not in known and old != tag:
                    write.remove_tree(cache / old)
        logger.info("downloading %s/%s from %s", tag, name, tier.url)
        tier.call(Fetch(tag, name, dict(entry), str(target)), f"could not download {tag!r}")
    written = cache / tag / layout.MANIFEST
    if not written.is_file():
        partial = f"{tag}/.{layout.MANIFEST}.{os.getpid()}"
        write.write_below(cache, partial, json.dumps(manifest, indent=1), True)
        os.replace(cache / partial, written)
    return cache, fresh


def load_either(
    tier: RemoteTier,
    name: str,
    tag: str | None,
    latest: str | None,
    known: list[str],
    map_location: MapLocation,
    verify: bool,
    loader: Remote,
    weights_only: bool = True,
) -> Any:
    """Load file ``name`` of ``tag`` (default: ``latest``, the newest of both tiers) from
    the local tier, or from the remote tier through the cache (blocking: the load thread).

    A file just downloaded was verified on its way in: it is not hashed twice.
    """
    name = layout.validate_name(name)
    tag = tag if tag is not None else latest
    if tag is None:
        raise CheckpointError(
            f"neither {tier.directory} nor {tier.url} holds a committed checkpoint"
        )
    root, fresh = source(tier, name, layout.validate_tag(tag), known)
    return load_file(root, name, tag, map_location, verify and not fresh, loader, weights_only)


def _temporary_tier(
    scratch: str, url: str, storage_options: Mapping[str, Any] | None
) -> RemoteTier:
    from .tier import RemoteTier

    tier = RemoteTier(
        Path(scratch),
        url,
        storage_options,
        keep_last=None,
        upload_timeout=_LOADER_SECONDS,
        close_timeout=_LOADER_SECONDS,
    )
    tier.spawn()
    return tier


def _published(tier: RemoteTier, tag: str | None) -> tuple[str, layout.Scan]:
    scan = tier.join(_LOADER_SECONDS, layout.Scan([], 0, None))
    tag = tag if tag is not None else scan.latest
    if tag is None:
        raise CheckpointError(f"{tier.url} holds no published checkpoint")
    tag = layout.validate_tag(tag)
    if tag not in scan.tags:
        known = ", ".join(scan.tags) or "none"
        raise CheckpointError(f"{tier.url} has no published checkpoint {tag!r} (it has: {known})")
    return tag, scan


def load_url(
    url: str,
    name: str,
    tag: str | None,
    storage_options: Mapping[str, Any] | None,
    map_location: MapLocation,
    verify: bool,
    weights_only: bool = True,
) -> Any:
    """:func:`~aoffload.load_checkpoint` of a URL (blocking, on its own thread).

    An uploader started for the call downloads the file, verified against the remote
    manifest, into a temporary directory that is removed once the file is loaded (its
    tensors map the file, which outlives its name).
    """
    name = layout.validate_name(name)
    with tempfile.TemporaryDirectory(prefix="aoffload-load-") as scratch:
        tier = _temporary_tier(scratch, url, storage_options)
        try:
            tag, _ = _published(tier, tag)
            root, fresh = source(tier, name, tag)
        finally:
            tier.close()
        return load_file(
            root, name, tag, map_location, verify and not fresh, weights_only=weights_only
        )


def metadata_url(
    url: str, tag: str | None, storage_options: Mapping[str, Any] | None
) -> dict[str, Any]:
    """:func:`~aoffload.load_metadata` of a URL (blocking): the remote manifest's metadata,
    read by an uploader started for the call."""
    with tempfile.TemporaryDirectory(prefix="aoffload-load-") as scratch:
        tier = _temporary_tier(scratch, url, storage_options)
        try:
            tag, scan = _published(tier, tag)
        finally:
            tier.close()
    return dict(scan.metadata.get(tag, {}))
