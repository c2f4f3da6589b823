"""Uploads that start before the commit ends: each file as soon as it is durable.

Without this, a tag's upload would start once its commit has published it locally, and the
commit's time would add to the upload's. Instead, when a commit is asked for, every file of
the tag is watched: the moment the writer reports it written and fsynced, a hard link to it
is made in ``directory/.tmp-upload-<tag>-<id>/`` and the uploader starts sending it. The link
keeps the file's data whatever happens to its name (the commit renames the tag into place;
retention may delete it); the directory is removed once the upload has ended, and a crash's
leftover is cleaned like any ``.tmp-*`` entry.

Nothing is published early: the manifest and ``latest`` are written only once the commit
succeeded and every file is uploaded. A file that could not be linked (the tag was already
renamed, or the filesystem has no hard links) is sent after the commit, from the tag. If the
commit fails, what was sent is removed (:meth:`EarlyFiles.abandon`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._errors import AoffloadError
from ..format import layout, write
from .worker.calls import AwaitFiles, Discard, StartFiles

if TYPE_CHECKING:
    from ..._runtime.core import WorkerCore
    from ..core.tags import FileJob, OpenTag
    from ..writer.calls import FileRecord

__all__ = ["EarlyFiles"]

logger = logging.getLogger(__name__)


class EarlyFiles:
    """The files of one tag sent to the uploader before its commit ended."""

    def __init__(self, directory: Path, open_tag: OpenTag, uploader: WorkerCore) -> None:
        self.tag = open_tag.tag
        self.root = directory / f"{layout.TMP_PREFIX}upload-{self.tag}-{uuid.uuid4().hex[:8]}"
        self._tmpdir = open_tag.tmpdir
        self._uploader = uploader
        self._lock = threading.Lock()
        self._closed = False
        self.names: set[str] = set()
        """The files whose upload has started."""

    def watch(self, jobs: list[FileJob]) -> None:
        """Start each file's upload once it is written (on the thread that reports it)."""
        for job in jobs:
            job.written.add_done_callback(self._written(job.name))

    def _written(self, name: str) -> Callable[[Any], None]:
        def start(future: Any) -> None:
            if future.exception() is None:
                self._start(name, future.result())

        return start

    def _start(self, name: str, record: FileRecord) -> None:
        target = self.root / name
        with self._lock:
            if self._closed:
                return
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                os.link(self._tmpdir / name, target)
            except OSError:  # renamed into the tag already, or no hard links here
                return
            try:
                self._uploader.submit(StartFiles(self.tag, ((str(target), name, record.nbytes),)))
            except AoffloadError:  # the uploader is gone: the upload after the commit says so
                return
            self.names.add(name)

    def close(self) -> set[str]:
        """No more early starts; the files whose upload started."""
        with self._lock:
            self._closed = True
            return set(self.names)

    def upload(self, files: tuple[tuple[str, str, int], ...], call: Callable[..., Any]) -> None:
        """Send the files not started yet, then wait for every file of the tag (blocking)."""
        started = self.close()
        rest = tuple(f for f in files if f[1] not in started)
        try:
            if rest:
                call(StartFiles(self.tag, rest), f"could not upload {self.tag!r}")
            call(AwaitFiles(self.tag), f"could not upload {self.tag!r}")
        finally:
            self.remove()

    def abandon(self) -> None:
        """The commit failed: wait for what was sent, remove it remotely, then the links."""
        started = self.close()
        try:
            if started:
                try:
                    self._uploader.request(AwaitFiles(self.tag))
                except AoffloadError:
                    return  # a failed upload removed what it had sent (or the uploader died)
                with contextlib.suppress(AoffloadError):
                    self._uploader.request(Discard(self.tag, tuple(sorted(started))))
        finally:
            self.remove()

    def remove(self) -> None:
        """Remove the links (the data stays in the tag, if it was published)."""
        write.remove_tree(self.root)
