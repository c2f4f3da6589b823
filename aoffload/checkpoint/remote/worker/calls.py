"""The uploader's calls: what the trainer asks of its uploader process, and the answers.

Pure data, imported by both sides. Files never cross the pipe: a call names them by path
in the local tier, and the uploader reads or writes them there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...._runtime.protocol import Call
from .store import BACKOFF, RETRIES, RemoteScan, redact_url

__all__ = [
    "Discard",
    "Fetch",
    "AwaitFiles",
    "StartFiles",
    "PutText",
    "ReadManifest",
    "RemoveTags",
    "ScanRemote",
    "UploaderConfig",
]


@dataclass(frozen=True, slots=True)
class UploaderConfig:
    """Where the remote tier is (an fsspec URL and its ``storage_options``), and how hard
    to try: ``retries`` per operation, the first ``backoff`` seconds apart (then twice as
    long each time), ``concurrency`` files in flight at once."""

    url: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    retries: int = RETRIES
    concurrency: int = 8
    backoff: float = BACKOFF[0]

    def __repr__(self) -> str:  # never the options: they may hold credentials
        hidden = f"<{len(self.storage_options)} hidden>"
        return f"UploaderConfig(url={redact_url(self.url)!r}, storage_options={hidden})"


@dataclass(frozen=True, slots=True)
class ScanRemote(Call[RemoteScan]):
    """List the published tags (with their manifests) and ``latest``."""


@dataclass(frozen=True, slots=True)
class StartFiles(Call[None]):
    """Start uploading ``files`` (local path, name in the tag, bytes per the manifest) into
    ``tag``, several at once; answered at once (:class:`AwaitFiles` waits for them)."""

    tag: str
    files: tuple[tuple[str, str, int], ...]


@dataclass(frozen=True, slots=True)
class AwaitFiles(Call[None]):
    """Wait until every upload started for ``tag`` has ended; raise the first failure
    (after removing what the others sent: nothing of a failed upload stays)."""

    tag: str


@dataclass(frozen=True, slots=True)
class PutText(Call[None]):
    """Write a small object at ``parts`` under the root (a manifest, ``latest``)."""

    parts: tuple[str, ...]
    text: str


@dataclass(frozen=True, slots=True)
class RemoveTags(Call[None]):
    """Remove published ``tags``, each manifest first."""

    tags: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Discard(Call[None]):
    """Remove files ``names`` of unpublished ``tag`` (an upload that failed elsewhere):
    once each, best effort; never raises."""

    tag: str
    names: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Fetch(Call[None]):
    """Download file ``name`` of ``tag`` to local ``target``, verified against ``entry``
    (its manifest entry: bytes and xxh3-64)."""

    tag: str
    name: str
    entry: dict[str, Any]
    target: str


@dataclass(frozen=True, slots=True)
class ReadManifest(Call[dict[str, Any]]):
    """The manifest of published ``tag``."""

    tag: str
