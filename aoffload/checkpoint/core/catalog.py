"""The catalog: the committed tags of one directory, and their publication and retention.

:class:`Catalog` is the engine's view of the directory (committed tags in commit order,
``latest``, the last sequence number, the results of its own commits and each tag's
metadata). The commit thread changes it (:meth:`Catalog.publish`, :meth:`Catalog.remove`)
and any thread reads it. Retention is a policy it asks after each publication
(:mod:`.retention`); a retired tag is renamed out of the listing at once, and its files
are deleted on a thread of its own, once nothing reads them any more.
"""

from __future__ import annotations

import concurrent.futures
import copy
import functools
import logging
import threading
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._errors import CheckpointError
from ..._runtime.threads import DaemonThreadExecutor
from ..format import layout, write

if TYPE_CHECKING:
    from ..format.metadata import Metadata
    from .result import CommitResult
    from .retention import Retention

__all__ = ["Catalog"]

logger = logging.getLogger(__name__)


def _suffix() -> str:
    return uuid.uuid4().hex[:8]


class Catalog:
    """The committed tags of one directory, as of the engine's start and its own commits.

    The commit thread changes it; any thread reads it.
    """

    def __init__(self, directory: Path, *, durable: bool, retention: Retention) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._tags: list[str] = []
        self.latest: str | None = None
        self.sequence = 0
        self._results: dict[str, CommitResult] = {}
        self._metadata: dict[str, Metadata] = {}
        self._durable = durable
        self._retention = retention
        self._trash: DaemonThreadExecutor | None = None
        self._deletions: set[concurrent.futures.Future[None]] = set()

    @property
    def tags(self) -> list[str]:
        """Committed tags, oldest first."""
        with self._lock:
            return list(self._tags)

    def found(self, scan: layout.Scan) -> None:
        """Take what a scan of the directory found."""
        with self._lock:
            self._tags, self.sequence, self.latest = list(scan.tags), scan.sequence, scan.latest
            self._metadata = {tag: scan.metadata[tag] for tag in scan.tags if tag in scan.metadata}

    def committed(self, tag: str) -> bool:
        """Whether ``tag`` is committed (and so cannot be saved into again)."""
        with self._lock:
            return tag in self._results or tag in self._tags

    def metadata(self, tag: str | None) -> Metadata:
        """A copy of committed ``tag``'s metadata (``{}`` if it has none; ``None``: the
        tag ``latest`` names); :class:`CheckpointError` if it is not committed."""
        with self._lock:
            if tag is None and self.latest is None:
                raise CheckpointError(f"{self.directory} holds no committed checkpoint")
            tag = self.latest if tag is None else tag
            if tag not in self._tags:
                known = ", ".join(self._tags) or "none"
                raise CheckpointError(
                    f"{self.directory} has no committed checkpoint {tag!r} (it has: {known})"
                )
            return copy.deepcopy(self._metadata.get(tag, {}))

    def result(self, tag: str) -> CommitResult | None:
        """The result of this engine's commit of ``tag``, if it made one."""
        with self._lock:
            return self._results.get(tag)

    def publish(
        self,
        tmpdir: Path,
        tag: str,
        files: Mapping[str, layout.FileEntry],
        result: Callable[[Mapping[str, layout.FileEntry]], CommitResult],
        metadata: Metadata | None,
        *,
        latest: bool = True,
        sequence: int | None = None,
    ) -> CommitResult:
        """Publish ``tmpdir`` as ``tag`` (its manifest holding ``metadata``) and (with
        ``latest``) move ``latest``; then retire.

        ``result(files)`` builds the :class:`CommitResult` from every published file.
        ``sequence`` is the tag's (default: one above the last). Raises
        :class:`CheckpointError` (``latest`` unchanged) if publishing failed.
        """
        sequence = self.sequence + 1 if sequence is None else sequence
        publish = functools.partial(
            write.publish,
            tmpdir,
            self.directory,
            tag,
            sequence,
            files,
            durable=self._durable,
            latest=latest,
            metadata=metadata,
        )
        try:
            published = publish()
        except OSError as exc:
            raise CheckpointError(
                f"could not publish checkpoint {tag!r} in {self.directory}: {exc}; "
                f"{layout.LATEST!r} still names {self.latest!r}"
            ) from exc
        done = result(published)
        self.record(tag, sequence, done, latest=latest)
        logger.info(
            "checkpoint %s committed: %d files, %.3f GB, staged in %.3f s, written in "
            "%.3f s (%.2f GB/s), commit %.3f s",
            tag,
            len(done.files),
            done.bytes / 1e9,
            done.stage_seconds,
            done.write_seconds,
            done.write_gb_per_second,
            done.commit_seconds,
        )
        self._retire()
        return done

    def record(self, tag: str, sequence: int, done: CommitResult, *, latest: bool) -> None:
        """Take note that ``tag`` was published as ``sequence`` (by this engine or rank 0)."""
        with self._lock:
            self.sequence = sequence
            self._tags.append(tag)
            if latest:
                self.latest = tag
            self._results[tag] = done
            if done.metadata:
                self._metadata[tag] = copy.deepcopy(done.metadata)

    def forget_old(self) -> list[str]:
        """Retire from this view the tags retention retires, and return them (oldest
        first): their files are deleted by :meth:`publish`, or by rank 0 for a rank's view."""
        with self._lock:
            old = self._retention.retired(self._tags)
            for tag in old:
                self._tags.remove(tag)
                self._results.pop(tag, None)
                self._metadata.pop(tag, None)
            return old

    def _retire(self) -> None:
        for tag in self.forget_old():
            try:
                self._delete(tag)
            except OSError:
                logger.exception("retention could not delete checkpoint %r; left in place", tag)

    def _delete(self, tag: str) -> None:
        """Rename ``tag`` out of the listing, then delete it in the background; a tag that
        something still reads (its upload: retention's :meth:`~.retention.Retention.held`)
        goes once that ends."""
        if not (self.directory / tag).is_dir():
            return  # only in the remote tier
        held = self._retention.held(tag)
        # Deleting GiBs takes a while: on a thread of its own, off the commit's path;
        # close() waits for it.
        if self._trash is None:
            self._trash = DaemonThreadExecutor("aoffload-checkpoint-trash")
        if held is None:
            trash = write.retire(self.directory, tag, _suffix())
            deletion = self._trash.submit(write.remove_tree, trash)
        else:
            deletion = self._trash.submit(self._retire_after, tag, held)
        self._deletions.add(deletion)
        deletion.add_done_callback(self._deleted)

    def remove_after(
        self,
        tag: str,
        earlier: list[concurrent.futures.Future[Any]],
        before: Callable[[], None] | None,
    ) -> bool:
        """:meth:`remove` ``tag`` unless one of the ``earlier`` commits (ended by now: the
        commit thread runs this after them) failed; ``before()`` runs first."""
        failed = [f.exception() for f in earlier if f.done() and f.exception() is not None]
        if failed:
            logger.warning("checkpoint %r is kept: a newer commit failed (%s)", tag, failed[0])
            return False
        if not self.committed(tag):
            return False
        if before is not None:
            before()
        return self.remove(tag)

    def remove(self, tag: str) -> bool:
        """Delete committed ``tag`` now (the commit thread); whether it was committed.

        Where ``latest`` names it, ``latest`` first moves (atomically) to the newest other
        committed tag, or goes: it never names a tag being deleted.
        """
        with self._lock:
            if tag not in self._tags:
                return False
            self._tags.remove(tag)
            self._results.pop(tag, None)
            self._metadata.pop(tag, None)
            moved = self.latest == tag
            if moved:
                self.latest = self._tags[-1] if self._tags else None
        if moved:
            write.point_latest(self.directory, self.latest, durable=self._durable)
        self._delete(tag)
        return True

    def _retire_after(self, tag: str, held: concurrent.futures.Future[Any]) -> None:
        concurrent.futures.wait([held])
        write.remove_tree(write.retire(self.directory, tag, _suffix()))

    def _deleted(self, deletion: concurrent.futures.Future[None]) -> None:
        self._deletions.discard(deletion)
        if deletion.exception() is not None:
            logger.error(
                "retention could not delete an old checkpoint; a later start removes it",
                exc_info=deletion.exception(),
            )

    def close(self) -> None:
        """Wait for the deletions retention started, then stop their thread (blocking)."""
        concurrent.futures.wait(list(self._deletions))
        if self._trash is not None:
            self._trash.shutdown(wait=True)
