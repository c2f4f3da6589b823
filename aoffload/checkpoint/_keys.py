"""The store keys of a distributed commit, and rank 0's merge of every rank's report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .._errors import CheckpointError
from . import _store

__all__ = ["Keys", "first_line", "merge_reports"]


def first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


class Keys:
    """The store keys of commit ``n`` of run ``run``."""

    def __init__(self, run: str, n: int) -> None:
        self.run, self.n = run, n
        self.prefix = f"aoffload/{run}/{n}/"
        self.outcome = self.prefix + "outcome"
        self.count = self.prefix + "count"
        self.result = self.prefix + "result"

    def report(self, rank: int) -> str:
        return f"{self.prefix}report/{rank}"

    def ack(self, rank: int) -> str:
        return f"{self.prefix}ack/{rank}"


def merge_reports(
    tag: str, reports: list[dict[str, Any]], directory: Path
) -> tuple[dict[str, _store.FileEntry], dict[Path, list[str]]]:
    """Every rank's files as manifest entries, and the peers' directories to gather."""
    entries: dict[str, _store.FileEntry] = {}
    owner: dict[str, int] = {}
    sources: dict[Path, list[str]] = {}
    for rank, report in enumerate(reports):
        if report["tag"] != tag:
            raise CheckpointError(
                f"rank {rank} committed tag {report['tag']!r} while rank 0 committed "
                f"{tag!r}: every rank must commit the same tags in the same order"
            )
        for name, (nbytes, xxh3, _) in report["files"].items():
            if name in owner:
                raise CheckpointError(
                    f"checkpoint {tag!r}: file {name!r} was saved by rank {owner[name]} "
                    f"and by rank {rank}; file names must be unique across ranks "
                    "(put the rank in the name)"
                )
            owner[name] = rank
            entries[name] = _store.FileEntry(nbytes, xxh3)
        if rank != 0 and report["files"]:
            sources[directory / report["dir"]] = list(report["files"])
    return entries, sources
