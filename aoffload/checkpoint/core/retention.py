"""Retention: which committed tags are kept, as policies the catalog asks.

As Orbax's preservation policies do, a policy answers two questions, and the catalog
(:mod:`.catalog`) and the remote tier ask them after each publication: which of the
committed tags (oldest first) to retire now (:meth:`Retention.retired`), and what still
reads a retired tag, so that its files are deleted only once that ends
(:meth:`Retention.held`). :class:`KeepLast` is ``keep_last``; :class:`KeepUntil` adds
"keep the files until their upload ended" to another policy.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["KeepLast", "KeepUntil", "Retention"]


class Retention(Protocol):
    """What the catalog asks on the commit thread, after each publication."""

    def retired(self, tags: Sequence[str]) -> list[str]:
        """The tags of ``tags`` (committed, oldest first) to retire now, oldest first."""

    def held(self, tag: str) -> concurrent.futures.Future[Any] | None:
        """What still reads retired ``tag`` (its files go once it ends), or ``None``."""


@dataclass(frozen=True, slots=True)
class KeepLast:
    """Keep the ``count`` newest tags (``None``: every tag)."""

    count: int | None

    def retired(self, tags: Sequence[str]) -> list[str]:
        """Every tag but the ``count`` newest."""
        if self.count is None or len(tags) <= self.count:
            return []
        return list(tags[: len(tags) - self.count])

    def held(self, tag: str) -> concurrent.futures.Future[Any] | None:
        """Nothing holds a tag: its files go at once."""
        return None


@dataclass(frozen=True, slots=True)
class KeepUntil:
    """``policy``'s choice of tags; a retired tag's files stay while ``reading(tag)`` (the
    future of its upload, say) has not ended."""

    policy: Retention
    reading: Callable[[str], concurrent.futures.Future[Any] | None]

    def retired(self, tags: Sequence[str]) -> list[str]:
        """What ``policy`` retires."""
        return self.policy.retired(tags)

    def held(self, tag: str) -> concurrent.futures.Future[Any] | None:
        """What still reads ``tag``."""
        return self.reading(tag)
