"""The uploader process as the trainer sees it, and what the remote tier reads through it.

:class:`Uploader` starts the uploader process (``worker/``), runs its calls (mapping their
errors to :class:`~aoffload.CheckpointError`) and keeps what the remote tier holds: each
published tag's manifest and ``latest``.

Resume anywhere: at start, the tags of both tiers make one catalog (:func:`merge`),
ordered by the manifests' sequence numbers. A file that is not in the local directory is
downloaded by the uploader, verified against the remote manifest (size and xxh3-64), and
kept in ``directory/.remote-cache/<tag>/`` (laid out as a checkpoint directory of its own,
with the remote manifest), so the next load reads the disk (:meth:`Uploader.source`). Only
the files loaded are downloaded: each rank of a resuming job fetches its own shard.
Everything here blocks: it runs on the engine's threads, never on the event loop.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..._errors import CheckpointError, CorruptCheckpointError, RemoteError
from ..._runtime.core import WorkerCore
from ..._runtime.protocol import Call
from ..format import layout, read, write
from .worker.calls import TARGET, Fetch, GetManifest, RemoteScan, ScanRemote, UploaderConfig

__all__ = ["CACHE", "Uploader", "merge"]

logger = logging.getLogger(__name__)

CACHE = ".remote-cache"
"""Where downloaded files are kept, laid out as a checkpoint directory of its own."""


def merge(local: layout.Scan, remote: RemoteScan) -> layout.Scan:
    """The tags of both tiers, oldest first by sequence; ``latest`` the newer of the two."""
    sequences = remote.sequences()
    for tag in local.tags:
        if tag in local.sequences:
            sequences[tag] = local.sequences[tag]
        else:
            sequences.setdefault(tag, 0)
    tags = [tag for _, tag in sorted((s, t) for t, s in sequences.items())]
    candidates = [t for t in (local.latest, remote.latest) if t is not None and t in sequences]
    latest = max(candidates, key=lambda t: sequences[t], default=local.latest)
    metadata = {t: dict(m["metadata"]) for t, m in remote.manifests.items() if m.get("metadata")}
    metadata.update(local.metadata)
    highest = max([local.sequence, *sequences.values()])
    return layout.Scan(tags, highest, latest, metadata, local.quarantined, sequences)


class Uploader:
    """The uploader process of one remote tier (``url``), and what that tier holds.

    ``spawn()``, then :meth:`join` (waits for the uploader, scans the remote tier);
    :meth:`close` at the end. The calls block: the engine's threads make them.
    """

    def __init__(
        self, directory: Path, config: UploaderConfig, url: str, close_timeout: float
    ) -> None:
        self.directory = directory
        self.url = url
        self.core = WorkerCore(
            TARGET, config, name="checkpoint-uploader", close_timeout=close_timeout
        )
        self._lock = threading.Lock()
        self._manifests: dict[str, dict[str, Any]] = {}
        self.latest: str | None = None
        """The tag the remote ``latest`` names, as of the scan and this engine's uploads."""

    def spawn(self) -> None:
        """Start the uploader process (its start overlaps the writer's)."""
        self.core.spawn()

    def join(self, timeout: float) -> RemoteScan:
        """Wait for the uploader, check that the remote tier can be listed and written,
        scan it (blocking); what it holds. Raises :class:`CheckpointError` naming the URL
        (without credentials) when it cannot be used."""
        try:
            self.core.ready.result(timeout)
        except concurrent.futures.TimeoutError:
            raise self.core.startup_timeout(timeout) from None
        scan: RemoteScan = self.call(
            ScanRemote(probe=True), f"the remote tier {self.url} cannot be used"
        )
        with self._lock:
            self._manifests, self.latest = dict(scan.manifests), scan.latest
        return scan

    def call(self, call: Call[Any], what: str) -> Any:
        """Run ``call`` in the uploader (blocking); its errors as :class:`CheckpointError`."""
        try:
            return self.core.request(call)
        except RemoteError as exc:
            kind = CorruptCheckpointError if "Corrupt" in exc.remote_type else CheckpointError
            raise kind(f"{what}: {exc.remote_message}") from None

    def close(self, *, kill: bool = False) -> None:
        """Stop the uploader (``kill``: at once, it may hang on a dead endpoint)."""
        if kill:
            self.core.kill()
        self.core.stop()
        self.core.release()

    # -- what the remote tier holds ----------------------------------------------------------

    def published(self, tag: str, manifest: dict[str, Any], latest: bool) -> None:
        """Take note that ``tag`` is published (with ``manifest``; ``latest``: it names it)."""
        with self._lock:
            self._manifests[tag] = manifest
            if latest:
                self.latest = tag

    def forget(self, tags: list[str]) -> None:
        """Take note that ``tags`` were removed from the remote tier."""
        with self._lock:
            for tag in tags:
                self._manifests.pop(tag, None)

    def manifests(self) -> dict[str, dict[str, Any]]:
        """Each published tag's manifest, as known here."""
        with self._lock:
            return dict(self._manifests)

    def manifest(self, tag: str) -> dict[str, Any]:
        """The remote manifest of ``tag`` (read from the remote tier if not known here)."""
        with self._lock:
            manifest = self._manifests.get(tag)
        if manifest is None:
            manifest = self.call(GetManifest(tag), f"could not read checkpoint {tag!r}")
        return manifest

    # -- downloads -----------------------------------------------------------------------------

    def source(self, name: str, tag: str, known: list[str] | None = None) -> tuple[Path, bool]:
        """The directory to load file ``name`` of ``tag`` from, and whether it was just
        downloaded (and verified). Local first; else the file is downloaded into the cache
        (verified against the remote manifest), once; cached tags not in ``known`` (the
        engine's tags, retention applied) are removed then. Blocking: the load thread."""
        local = self.directory / tag / layout.MANIFEST
        if local.is_file() and name in read.read_manifest(local)["files"]:
            return self.directory, False
        cache = self.directory / CACHE
        manifest = self.manifest(tag)
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
            logger.info("downloading %s/%s from %s", tag, name, self.url)
            self.call(Fetch(tag, name, dict(entry), str(target)), f"could not download {tag!r}")
        _keep_manifest(cache, tag, manifest)
        return cache, fresh


def _keep_manifest(cache: Path, tag: str, manifest: Mapping[str, Any]) -> None:
    """Lay the cache out as a checkpoint directory: ``tag``'s remote manifest beside its files."""
    written = cache / tag / layout.MANIFEST
    if not written.is_file():
        partial = f"{tag}/.{layout.MANIFEST}.{os.getpid()}"
        write.write_below(cache, partial, json.dumps(manifest, indent=1), True)
        os.replace(cache / partial, written)
