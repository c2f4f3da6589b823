"""The roles the core plugs in: who takes part in a commit, and what a second tier adds.

The core (:class:`~.engine.EngineCore`) is the engine of one process writing one local
directory. Two roles change what it does, and it reaches them only through these
protocols, as DCP's save flow reaches storage through ``StorageWriter``:

- a :class:`Coordinator` decides who takes part in each commit: this process alone
  (:class:`~.alone.Alone`, the default), or every rank of a ``torch.distributed`` job
  (``ranks/``);
- a :class:`Tier` is what stands behind the local directory: nothing
  (:class:`~.alone.LocalTier`, the default), or a remote tier that uploads each committed
  tag (``remote/``).

The assembler (``checkpoint/_assemble.py``) picks them from the engine's options and hands
them to the core; nothing in ``core/`` imports a role. Each protocol's docstring states the
order of its calls, who makes each one, and on which thread.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..._runtime.core import WorkerCore
    from ..format.layout import FileEntry, Scan
    from .catalog import Catalog
    from .result import CommitResult
    from .tags import OpenTag

__all__ = ["Coordinator", "Follower", "Owner", "Parts", "Published", "Resolve", "Tier"]


@dataclass(frozen=True, slots=True)
class Parts:
    """What the assembler hands the core: the ``writer`` process (``None``: a replica), the
    ``catalog`` of its directory, the ``coordinator`` and the ``tier``."""

    writer: WorkerCore | None
    catalog: Catalog
    coordinator: Coordinator
    tier: Tier


@dataclass(frozen=True, slots=True)
class Published:
    """One commit that succeeded, as its coordinator saw it.

    ``result`` is what the commit's handle gives; ``number`` counts the commits of this
    run (every rank numbers them alike); ``files`` are the files of the tag this process
    holds, and so uploads (its own and those it adopted; on rank 0, those no other rank
    reported).
    """

    result: CommitResult
    number: int
    files: Mapping[str, FileEntry]


Resolve = Callable[["Published | None", "BaseException | None"], None]
"""Hands a commit's outcome to the core: the publication, or the error."""


class Coordinator(Protocol):
    """Who takes part in a commit, and how the directory is shared.

    The core calls, in this order:

    1. :meth:`join`, once, at start, on the thread that starts the engine (a collective
       across ranks): take the directory's locks, scan it (removing a crash's leftovers
       where nobody else can be using them); every process starts from the scan it returns;
    2. :meth:`arm`, once, at start, when the writer runs;
    3. :meth:`commit`, once per commit, on the engine's commit thread, one at a time in the
       order ``commit()`` was called, after the tag stopped taking files;
    4. at close, on the closing thread, once no commit runs: :meth:`disarm` before the
       writer stops, :meth:`leave` after it stopped, :meth:`release` last of all.

    ``together`` says whether a process takes part in a commit without files of its own
    (a rank does: the commit is collective).
    """

    together: bool

    def join(self) -> Scan:
        """Lock and scan the directory (blocking); what every process starts from."""

    def arm(self) -> None:
        """The writer runs: what must be said if this process dies, it can say now."""

    def commit(self, open_tag: OpenTag, started: float, latest: bool, resolve: Resolve) -> None:
        """Commit ``open_tag`` (blocking, the commit thread): wait for its files, publish it
        (with ``latest``), retire old tags. Call ``resolve`` as soon as the outcome is known
        everywhere; a failed tag's directory is removed before this returns, once its
        writes have ended."""

    def disarm(self) -> None:
        """An orderly close: the writer is about to stop; it speaks for nobody any more."""

    def leave(self, unfinished: str | None) -> None:
        """The writer stopped: tell the others this process is gone (``unfinished`` says
        what it leaves undone: a tag saved and not committed, an exception leaving the
        engine, commits still running), never waiting on a dead one."""

    def release(self) -> None:
        """Release the directory's locks: nothing of this engine writes any more."""


class Owner(Protocol):
    """The owner of the engine's background futures (:class:`~.tags.Tags`)."""

    def own(self, future: concurrent.futures.Future[Any]) -> None:
        """Raise ``future``'s failure from the engine's next call, unless it was seen."""

    def commit_seen(self, future: concurrent.futures.Future[Any]) -> None:
        """``future``'s failure is (or will be) raised to a caller: not again."""


class Follower(Protocol):
    """What a tier does with one commit; made by :meth:`Tier.follow`. The commit thread
    calls :meth:`early` first, then :meth:`committed` or :meth:`failed` once."""

    def early(self) -> None:
        """Before the commit runs: start what may start before it ends."""

    def committed(self, published: Published) -> None:
        """The commit succeeded everywhere."""

    def failed(self, error: BaseException) -> None:
        """The commit failed (``error`` is the commit's)."""


class Tier(Protocol):
    """What stands behind the local directory.

    The core calls, in this order:

    1. at start, on the starting thread: :meth:`spawn` before the coordinator joins (its
       process starts meanwhile), :meth:`join` after, with the local scan: it returns the
       scan of both tiers, which the engine starts from;
    2. :meth:`follow` on the caller's thread when a commit starts, before the commit runs;
       the commit thread then calls the :class:`Follower`;
    3. at any time while the engine runs: :meth:`holding` (the catalog's retention, on the
       commit thread), :meth:`source` (the load thread), :meth:`uploaded` (the caller's
       thread);
    4. :meth:`close`, at close, first of all, on the closing thread.
    """

    def spawn(self) -> None:
        """Start what the tier runs (it starts while the directory is scanned)."""

    def join(self, local: Scan) -> Scan:
        """Both tiers' tags as one scan (blocking), given the local one."""

    def follow(self, open_tag: OpenTag, latest: bool, owner: Owner) -> Follower:
        """Follow the commit of ``open_tag`` (``latest``: it moves ``latest``)."""

    def holding(self, tag: str) -> concurrent.futures.Future[Any] | None:
        """What still reads local ``tag`` (retention waits for it), or ``None``."""

    def source(
        self, name: str, tag: str | None, latest: str | None, known: list[str]
    ) -> tuple[Path, str | None, bool]:
        """Where to load file ``name`` of ``tag`` from (blocking, the load thread): the
        directory, the tag (``None``: what the directory's ``latest`` names), and
        whether the file was just downloaded and verified. ``latest`` is the engine's,
        ``known`` its tags."""

    def uploaded(self, tag: str | None) -> concurrent.futures.Future[CommitResult]:
        """The future of ``tag``'s publication in this tier (default: the newest commit)."""

    def close(self) -> None:
        """Finish or abandon what is in flight (bounded), stop what the tier runs."""
