"""Which commit a ``commit()`` call starts, and in what order the commits run.

:class:`Committer` resolves the tag that :meth:`~._engine.CheckpointEngine.commit` or
``commit_soon()`` means (``None``: the single open tag), and starts one task per tag: a
second call for the same tag gets the same task, a committed tag its result. The tasks run
one after another, in the order they were requested; each waits for its tag's staging,
then commits it alone (:func:`._commit.commit_one`) or with every rank
(:class:`._distributed.Ranks`). The phases of a commit themselves are in :mod:`._commit`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

from .._errors import InvalidStateError
from .._runtime.bridge import Bridge
from .._runtime.threads import mark_retrieved
from . import _store
from ._commit import Catalog, CommitResult, RunIO, commit_one
from ._distributed import Ranks
from ._stager import OpenTag, Stager

__all__ = ["Committer"]


class Committer:
    """Starts the commits of one engine: one task per tag, run in commit order."""

    def __init__(
        self,
        directory: Path,
        stager: Stager,
        catalog: Catalog,
        bridge: Bridge | None,
        ranks: Ranks | None,
        run_io: RunIO,
    ) -> None:
        self._directory = directory
        self._stager = stager
        self._open_tags = stager.open_tags
        self._catalog = catalog
        self._bridge = bridge
        self._ranks = ranks
        self._run_io = run_io
        self._last: asyncio.Task[CommitResult] | None = None

    def request(self, tag: str | None, latest: bool) -> CommitResult | asyncio.Task[CommitResult]:
        """The commit of ``tag``: its result once committed, else its task (started now).

        Raises :class:`InvalidStateError` for a bad tag, when ``tag`` is ``None`` and not
        exactly one tag is open, or when nothing was saved under ``tag``.
        """
        if self._bridge is None and self._ranks is None:
            resolved = _store.validate_tag(tag) if tag is not None else ""
            return CommitResult(resolved, self._directory / resolved, (), 0, 0.0, 0.0, 0.0)
        if tag is None:
            if len(self._open_tags) != 1:
                raise InvalidStateError(
                    f"commit() without a tag needs exactly one open checkpoint; open: "
                    f"{sorted(self._open_tags)}"
                )
            tag = next(iter(self._open_tags))
        tag = _store.validate_tag(tag)
        if tag in self._catalog.results:
            return self._catalog.results[tag]
        open_tag = self._open_tags.get(tag)
        if open_tag is None and self._ranks is not None:  # this rank has no files in it
            tmpdir = self._directory / f"{_store.TMP_PREFIX}{tag}-{uuid.uuid4().hex[:8]}"
            open_tag = self._open_tags[tag] = OpenTag(tag, tmpdir)
            open_tag.idle.set()
        if open_tag is None:
            raise InvalidStateError(f"nothing was saved under tag {tag!r}; nothing to commit")
        if open_tag.commit is None:
            open_tag.commit = asyncio.create_task(self._commit(open_tag, self._last, latest))
            open_tag.commit.add_done_callback(mark_retrieved)
            self._last = open_tag.commit
        return open_tag.commit

    async def _commit(
        self, open_tag: OpenTag, previous: asyncio.Task[CommitResult] | None, latest: bool
    ) -> CommitResult:
        started = time.perf_counter()
        if previous is not None and not previous.done():
            await asyncio.wait([previous])  # publish in commit order; its errors are its own
        await open_tag.idle.wait()
        args = (open_tag, self._bridge, self._catalog, self._run_io, started, latest)
        if self._ranks is not None:  # one commit across every rank
            return await self._ranks.commit(*args, self._stager.release)
        return await commit_one(*args, self._stager.release)
