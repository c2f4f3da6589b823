"""What a commit published: :class:`CommitResult`, the value of every commit's handle.

A leaf: the commit (:mod:`.commit`), the catalog, the coordinators and the remote tier all
build or read it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..writer.calls import FileRecord
    from .tags import OpenTag

__all__ = ["CommitResult", "committed", "result_of"]


@dataclass(frozen=True, slots=True)
class CommitResult:
    """What one ``commit()`` published, and how long each phase took.

    ``stage_seconds``: time spent copying the tag's tensors into staging memory (on
    aoffload's threads); ``write_seconds``: the writer's time serialising and fsyncing the
    files; ``commit_seconds``: from the ``commit()`` call until the tag and ``latest``
    were durable and published. A replica (``writer=False``) gets zero files.
    ``metadata`` is the commit's metadata as stored in the manifest (rank 0's, on every
    rank of a distributed engine); empty when the commit had none.

    ``staging_bytes``: the shared staging memory this engine held when the tag was staged
    (never more than its ``staging_bytes=`` cap); ``staging_peak_bytes``: the most of it
    that held data not yet written, at once, since the engine started. Both are this
    process's; 0 for a tag this engine did not stage.
    """

    tag: str
    path: Path
    files: tuple[str, ...]
    bytes: int
    stage_seconds: float
    write_seconds: float
    commit_seconds: float
    metadata: dict[str, Any] = field(default_factory=dict)
    staging_bytes: int = 0
    staging_peak_bytes: int = 0

    @property
    def write_gb_per_second(self) -> float:
        """Durable write throughput of the writer, in GB/s (10**9 bytes)."""
        return self.bytes / self.write_seconds / 1e9 if self.write_seconds > 0 else 0.0

    @property
    def stage_gb_per_second(self) -> float:
        """Staging copy throughput, in GB/s (10**9 bytes)."""
        return self.bytes / self.stage_seconds / 1e9 if self.stage_seconds > 0 else 0.0


def committed(
    directory: Path,
    open_tag: OpenTag,
    records: Mapping[str, FileRecord],
    started: float,
    sizes: Mapping[str, int],
    metadata: Mapping[str, Any] | None,
) -> CommitResult:
    """The :class:`CommitResult` of ``open_tag``, published with the files in ``sizes``.

    ``records`` are this process's own writes (their time is ``write_seconds``);
    ``sizes`` lists every published file, other ranks' included; ``metadata`` is what
    the manifest holds.
    """
    return CommitResult(
        tag=open_tag.tag,
        path=directory / open_tag.tag,
        files=tuple(sizes),
        bytes=sum(sizes.values()),
        stage_seconds=open_tag.stage_seconds,
        write_seconds=sum(record.seconds for record in records.values()),
        commit_seconds=time.perf_counter() - started,
        metadata=dict(metadata or {}),
        staging_bytes=open_tag.staging_bytes,
        staging_peak_bytes=open_tag.staging_peak,
    )


def result_of(directory: Path, manifest: Mapping[str, Any]) -> CommitResult:
    """A :class:`CommitResult` for a tag this engine did not commit (from its manifest)."""
    files = {name: int(entry["bytes"]) for name, entry in manifest["files"].items()}
    tag = str(manifest["tag"])
    metadata = dict(manifest.get("metadata") or {})
    return CommitResult(
        tag, directory / tag, tuple(files), sum(files.values()), 0.0, 0.0, 0.0, metadata
    )
