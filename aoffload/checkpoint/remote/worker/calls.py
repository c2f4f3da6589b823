"""The uploader's calls: what the trainer asks of its uploader process, and the answers.

Pure data, imported by both sides. Files never cross the pipe: a call names them by path
in the local tier, and the uploader reads or writes them there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...._runtime.protocol import Call

TARGET = "aoffload.checkpoint.remote.worker.service:UploaderService"
"""The name a bridge spawns the uploader by (a name: importing the calls imports no service)."""
RETRIES = 4
"""Retries of a failed transient operation (so five attempts), with backoff."""
BACKOFF = (0.5, 8.0)
"""The first delay between attempts, doubled each time up to the second (seconds)."""

__all__ = [
    "BACKOFF",
    "RETRIES",
    "TARGET",
    "Discard",
    "Fetch",
    "AwaitFiles",
    "StartFiles",
    "PutText",
    "GetManifest",
    "RemoteScan",
    "RemoveTags",
    "ScanRemote",
    "UploaderConfig",
    "redact_url",
]


def redact_url(url: str) -> str:
    """``url`` without its user information and query string (where credentials hide)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    host, slash, path = rest.partition("/")
    host = host.rpartition("@")[2]
    path = path.partition("?")[0]
    return f"{scheme}://{host}{slash}{path}"


@dataclass(frozen=True, slots=True)
class RemoteScan:
    """What a remote tier holds: each published tag's manifest, and ``latest``."""

    manifests: dict[str, dict[str, Any]]
    latest: str | None

    def sequences(self) -> dict[str, int]:
        """Every published tag's sequence number."""
        return {tag: int(m["sequence"]) for tag, m in self.manifests.items()}

    def tags(self) -> list[str]:
        """The published tags, oldest first (by sequence)."""
        return [tag for _, tag in sorted((s, t) for t, s in self.sequences().items())]


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

    def __post_init__(self) -> None:
        if not 0 <= self.backoff <= BACKOFF[1]:
            raise ValueError(
                f"upload_backoff must be between 0 and {BACKOFF[1]:g} seconds, not {self.backoff!r}"
            )

    def __repr__(self) -> str:  # never the options: they may hold credentials
        hidden = f"<{len(self.storage_options)} hidden>"
        return f"UploaderConfig(url={redact_url(self.url)!r}, storage_options={hidden})"


@dataclass(frozen=True, slots=True)
class ScanRemote(Call[RemoteScan]):
    """List the published tags (with their manifests) and ``latest``; with ``probe``,
    first check that the tier can be listed and written (a small object written, then
    deleted)."""

    probe: bool = False


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
class GetManifest(Call[dict[str, Any]]):
    """The manifest of published ``tag``."""

    tag: str
