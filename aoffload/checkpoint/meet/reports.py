"""What the ranks tell each other through the commit store: dataclasses, JSON at the store.

A rank's :class:`Report` of its durable files, a :class:`Failure` (the verdict of a rank
that failed, or that saw another go), rank 0's :class:`Answer`, a rank's
:class:`Uploaded` files. They cross the store as JSON, encoded by :func:`encode` and read
back by each class's ``decode``; nothing else here touches a string. :func:`merge_reports`
and :func:`warn_differing` are rank 0's reading of every rank's report.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from ..._errors import CheckpointError
from ..format import metadata as _metadata
from ..format.layout import FileEntry

__all__ = [
    "UPLOADED",
    "WRITTEN",
    "Answer",
    "Failure",
    "Report",
    "Uploaded",
    "Written",
    "encode",
    "merge_reports",
    "verdict",
    "warn_differing",
]

logger = logging.getLogger(__name__)

WRITTEN = "written"
"""The outcome of a commit whose files are durable on every rank."""
UPLOADED = "uploaded"
"""The outcome of an upload every rank finished."""


class _Json:
    """What crosses the store as a JSON object of the dataclass's fields."""

    __slots__ = ()

    @classmethod
    def decode(cls, text: str) -> Self:
        """The value ``text`` holds."""
        return cls(**json.loads(text))


@dataclass(frozen=True, slots=True)
class Written:
    """One file a rank wrote: its size, xxh3-64, and the writer's time on it."""

    bytes: int
    xxh3_64: str
    seconds: float


@dataclass(frozen=True, slots=True)
class Report:
    """A rank's files of a commit, durable: in ``dir`` (its temporary directory)."""

    tag: str
    dir: str
    files: dict[str, Written]
    metadata: dict[str, Any] | None = None

    @classmethod
    def decode(cls, text: str) -> Report:
        """The report ``text`` holds."""
        data = json.loads(text)
        files = {name: Written(**written) for name, written in data["files"].items()}
        return cls(data["tag"], data["dir"], files, data["metadata"])


@dataclass(frozen=True, slots=True)
class Failure(_Json):
    """Why an exchange failed: ``rank`` failed (or was found gone), saying ``error``."""

    rank: int
    error: str


@dataclass(frozen=True, slots=True)
class Answer(_Json):
    """Rank 0's answer: ``ok`` (the tag was published as ``sequence`` with ``files`` and
    ``metadata``; the ``away`` ranks publish their own files), or why not (``error``)."""

    ok: bool
    error: str = ""
    sequence: int = 0
    files: dict[str, int] = field(default_factory=dict)
    away: list[int] = field(default_factory=list)
    metadata: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Uploaded:
    """A rank's files of a tag, uploaded."""

    files: dict[str, FileEntry]

    @classmethod
    def decode(cls, text: str) -> Uploaded:
        """The report ``text`` holds."""
        data = json.loads(text)
        return cls({name: FileEntry(**entry) for name, entry in data["files"].items()})


def encode(value: Report | Failure | Answer | Uploaded) -> str:
    """``value`` as the store holds it."""
    return json.dumps(dataclasses.asdict(value))


def verdict(text: str, done: str) -> Failure | None:
    """The outcome ``text`` of an exchange: ``None`` when it says ``done``, else the failure."""
    return None if text == done else Failure.decode(text)


def merge_reports(
    tag: str, reports: list[Report], directory: Path
) -> tuple[dict[str, FileEntry], dict[Path, list[str]]]:
    """Every rank's files as manifest entries, and the peers' directories to gather."""
    entries: dict[str, FileEntry] = {}
    owner: dict[str, int] = {}
    sources: dict[Path, list[str]] = {}
    for rank, report in enumerate(reports):
        if report.tag != tag:
            raise CheckpointError(
                f"rank {rank} committed tag {report.tag!r} while rank 0 committed "
                f"{tag!r}: every rank must commit the same tags in the same order"
            )
        for name, written in report.files.items():
            if name in owner:
                raise CheckpointError(
                    f"checkpoint {tag!r}: file {name!r} was saved by rank {owner[name]} "
                    f"and by rank {rank}; file names must be unique across ranks "
                    "(put the rank in the name)"
                )
            owner[name] = rank
            entries[name] = FileEntry(written.bytes, written.xxh3_64)
        if rank != 0 and report.files:
            sources[directory / report.dir] = list(report.files)
    return entries, sources


def warn_differing(tag: str, kept: _metadata.Metadata | None, reports: list[Report]) -> None:
    """Rank 0: log the ranks whose commit metadata differs from rank 0's (which is kept)."""
    differ = {
        rank: keys
        for rank, report in enumerate(reports)
        if (keys := _metadata.differing(kept, report.metadata))
    }
    if differ:
        logger.warning(
            "checkpoint %r: the commit metadata of rank(s) %s differs from rank 0's (keys: "
            "%s); rank 0's is kept. Pass the same metadata to commit() on every rank",
            tag,
            sorted(differ),
            sorted(set().union(*differ.values())),
        )
