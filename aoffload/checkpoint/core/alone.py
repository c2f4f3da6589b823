"""The default roles: one process alone in its directory, and no tier behind it.

:class:`Alone` is the :class:`~.roles.Coordinator` of a single-process engine: it takes the
directory locks and scans the directory (removing a crash's leftovers when no other engine
is live there), commits with :func:`~.commit.commit_local`, and releases the locks last.
:class:`LocalTier` is the :class:`~.roles.Tier` of an engine without ``remote=``: loads
read the directory, and there is nothing to upload.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._errors import CheckpointError, InvalidStateError
from ..format import read
from ..format.lock import DirectoryLock, hold_shared
from .commit import commit_local

if TYPE_CHECKING:
    from ..._runtime.core import WorkerCore
    from ..format.layout import Scan
    from .catalog import Catalog
    from .result import CommitResult
    from .roles import Owner, Published, Resolve
    from .tags import OpenTag

__all__ = ["Alone", "LocalTier"]


class Alone:
    """A single process: it alone takes part in each commit (see :class:`~.roles.Coordinator`).

    A writer creates the directory and takes its locks (``format/lock.py``): the writer
    lock, which refuses a second live writer, and the shared lock, held while the engine
    lives. A replica (no ``writer``) only reads.
    """

    together = False

    def __init__(self, directory: Path, writer: WorkerCore | None, catalog: Catalog) -> None:
        self._directory = directory
        self._writer = writer
        self._catalog = catalog
        self._lock: DirectoryLock | None = None
        self._commits = 0

    def join(self) -> Scan:
        """Scan the directory; a writer first takes the locks (an OS error is a
        :class:`CheckpointError` naming it)."""
        directory = self._directory
        try:
            if self._writer is None:
                return read.scan(directory, clean=False)
            directory.mkdir(parents=True, exist_ok=True)
            self._lock, found = hold_shared(
                directory, lambda sole: read.scan(directory, clean=sole), writer=True
            )
        except OSError as exc:
            raise CheckpointError(
                f"cannot use {directory} as a checkpoint directory: {exc}"
            ) from exc
        return found

    def arm(self) -> None:
        """Nobody else to tell if this process dies."""

    def commit(self, open_tag: OpenTag, started: float, latest: bool, resolve: Resolve) -> None:
        """:func:`~.commit.commit_local`, resolved once it returns."""
        number, self._commits = self._commits, self._commits + 1
        try:
            published = commit_local(open_tag, self._writer, self._catalog, started, latest, number)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever awaits the commit
            resolve(None, exc)
        else:
            resolve(published, None)

    def disarm(self) -> None:
        """Nothing armed."""

    def leave(self, unfinished: str | None) -> None:
        """Nobody else to tell."""

    def release(self) -> None:
        """Release the directory locks (last: nothing of this engine writes any more)."""
        if self._lock is not None:
            self._lock.release()


class _NoUpload:
    """What a local tier does with a commit: nothing."""

    def early(self) -> None:
        """Nothing starts early."""

    def committed(self, published: Published) -> None:
        """Nothing to upload."""

    def failed(self, error: BaseException) -> None:
        """Nothing to undo."""


class LocalTier:
    """No second tier: the directory is all there is (see :class:`~.roles.Tier`)."""

    _follower = _NoUpload()

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def spawn(self) -> None:
        """Nothing to start."""

    def join(self, local: Scan) -> Scan:
        """The directory's scan, as it is."""
        return local

    def follow(self, open_tag: OpenTag, latest: bool, owner: Owner) -> _NoUpload:
        """Nothing follows a commit."""
        return self._follower

    def holding(self, tag: str) -> concurrent.futures.Future[Any] | None:
        """Nothing reads a committed tag."""
        return None

    def source(
        self, name: str, tag: str | None, latest: str | None, known: list[str]
    ) -> tuple[Path, str | None, bool]:
        """The directory (``tag=None``: what its ``latest`` names when the load reads it)."""
        return self.directory, tag, False

    def uploaded(self, tag: str | None) -> concurrent.futures.Future[CommitResult]:
        """Refused: there is no remote tier."""
        raise InvalidStateError("this engine has no remote tier (CheckpointEngine(remote=...))")

    def close(self) -> None:
        """Nothing to stop."""
