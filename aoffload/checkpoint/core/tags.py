"""The one owner of the tags in flight: their states, their files, their staging slots.

Every tag from its first ``stage()`` to the end of its commit is an :class:`OpenTag` held
by :class:`Tags`, and every change to one goes through a method of :class:`Tags`, under
its one lock, from whatever thread makes it (the caller's ``stage()`` and ``commit()``,
the stage thread, the copy threads, the commit thread)::

    OPEN --commit requested--> COMMITTING --published--> (gone: the catalog has it)
      |                             \\--failed----------> (gone: directory removed)
      \\--every file failed, each failure seen--> (gone)

A tag holds one of the ``max_pending`` staging slots from its first ``stage()`` to the
end of its commit. A new tag takes a free slot, or, while another tag is being committed,
queues for the next slot a commit frees; with every slot held by tags that nobody is
committing, ``stage()`` raises at once (nothing would ever free one). The stage thread
waits for its tag's slot on this module's condition: backpressure never waits for the
event loop.
"""

from __future__ import annotations

import collections
import concurrent.futures
import enum
import threading
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._errors import CheckpointError, ClosedError, InvalidStateError
from ..._runtime.threads import mark_retrieved, running_future
from ..format.layout import TMP_PREFIX

if TYPE_CHECKING:
    from ..writer.calls import FileRecord
    from .plan import Plan, Structure
    from .staging import Slot, SlotPool

__all__ = ["FileJob", "OpenTag", "TagState", "Tags"]


class TagState(enum.Enum):
    """Where a tag in flight is."""

    OPEN = "open"
    """Files may be staged into it; their copies and writes run."""
    COMMITTING = "committing"
    """A commit was requested: no more files; the commit thread owns it."""
    PUBLISHED = "published"
    FAILED = "failed"


class FileJob:
    """One ``stage()`` call: the copy of one file, then its write.

    ``staged`` resolves when every tensor is copied into staging memory and checked
    (what ``await staged`` waits for); ``written`` when the writer has written (and, if
    durable, fsynced) the file. A staging failure fails both. ``plan`` is the planned
    state (its tensors and their version counters as of ``stage()``), kept for the
    fence's check, with ``structure`` (the state's dicts' keys and lists' lengths as of
    ``stage()``); ``sealed`` is that check's outcome once the fence ran.
    """

    __slots__ = ("name", "open_tag", "plan", "sealed", "staged", "structure", "written")

    def __init__(self, name: str, open_tag: OpenTag) -> None:
        self.name = name
        self.open_tag = open_tag
        self.plan: Plan | None = None
        self.structure: Structure = []
        self.sealed: BaseException | bool = False
        self.staged: concurrent.futures.Future[None] = running_future()
        self.written: concurrent.futures.Future[FileRecord] = running_future()
        self.written.add_done_callback(mark_retrieved)  # the commit raises it


@dataclass(eq=False)
class OpenTag:
    """A tag with files staged or being written, not yet published."""

    tag: str
    tmpdir: Path
    state: TagState = TagState.OPEN
    files: dict[str, FileJob] = field(default_factory=dict)
    failures: dict[str, BaseException] = field(default_factory=dict)
    """Staging failures nobody has seen (``await staged`` did not raise them)."""
    slot: Slot | None = None
    stage_seconds: float = 0.0
    staging_bytes: int = 0
    """The engine's staging memory when the tag's last file was staged (bytes)."""
    staging_peak: int = 0
    """The most staging memory in use at once, up to then (bytes)."""
    commit: concurrent.futures.Future[Any] | None = None
    poison: BaseException | None = None
    """A file of the tag was modified before its fence: the tag cannot be published."""
    metadata: dict[str, Any] | None = None
    """What the commit stores in the manifest (set when the commit is requested)."""

    def raise_failures(self) -> None:
        """Raise why the tag cannot be published: a staging failure nobody has seen, or
        a file modified before its fence (called by the commit)."""
        if self.poison is not None:
            raise CheckpointError(
                f"checkpoint {self.tag!r} is discarded: {self.poison}"
            ) from self.poison
        if self.failures:
            name, exc = next(iter(self.failures.items()))
            self.failures.clear()
            raise CheckpointError(
                f"file {name!r} of checkpoint {self.tag!r} could not be staged ({exc}); "
                "the checkpoint is discarded"
            ) from exc


class Tags:
    """The tags in flight of one engine, and the staging slots they hold."""

    def __init__(self, directory: Path, slots: SlotPool) -> None:
        self.directory = directory
        self._cond = threading.Condition()
        self._open: dict[str, OpenTag] = {}
        self._slots = slots
        self._queued: collections.deque[OpenTag] = collections.deque()
        self._closing = False
        self._background: list[tuple[concurrent.futures.Future[Any], BaseException]] = []
        # weak: a failure marked seen after it was settled leaves no entry behind
        self._seen: weakref.WeakSet[concurrent.futures.Future[Any]] = weakref.WeakSet()

    # -- files ---------------------------------------------------------------------------

    def add_file(self, tag: str, name: str, committed: Callable[[str], bool]) -> FileJob:
        """Reserve file ``name`` of ``tag`` for a ``stage()`` call (the caller's thread)."""
        with self._cond:
            if self._closing:
                raise ClosedError("the checkpoint engine is closing")
            open_tag = self._open.get(tag)
            if open_tag is not None and open_tag.poison is not None:
                raise InvalidStateError(
                    f"checkpoint {tag!r} is discarded ({open_tag.poison}); use a new tag"
                )
            if open_tag is None:
                if committed(tag):
                    raise InvalidStateError(
                        f"checkpoint {tag!r} is already committed; use a new tag"
                    )
                open_tag = self._new(tag)
                self._take_slot(open_tag)
                self._open[tag] = open_tag
            if open_tag.state is not TagState.OPEN:
                raise InvalidStateError(f"checkpoint {tag!r} is being committed; use a new tag")
            if name in open_tag.files:
                raise InvalidStateError(f"file {name!r} was already saved in checkpoint {tag!r}")
            job = open_tag.files[name] = FileJob(name, open_tag)
            return job

    def _new(self, tag: str) -> OpenTag:
        return OpenTag(tag, self.directory / f"{TMP_PREFIX}{tag}-{uuid.uuid4().hex[:8]}")

    def _take_slot(self, open_tag: OpenTag) -> None:
        open_tag.slot = self._slots.take()
        if open_tag.slot is not None:
            return
        if not any(t.state is TagState.COMMITTING for t in self._open.values()):
            held = sorted(t.tag for t in self._open.values() if t.slot is not None)
            raise CheckpointError(
                f"cannot stage checkpoint {open_tag.tag!r}: max_pending="
                f"{len(self._slots.slots)} checkpoints {held} are staged and none is being "
                "committed; commit one first (commit_soon() does it in the background) or "
                "raise max_pending"
            )
        self._queued.append(open_tag)

    def wait_slot(self, open_tag: OpenTag) -> Slot:
        """Block until ``open_tag`` holds a slot (the stage thread): backpressure."""
        with self._cond:
            while open_tag.slot is None:
                if self._closing:
                    raise ClosedError(
                        "the checkpoint engine closed while this file waited for room"
                    )
                self._cond.wait()
            return open_tag.slot

    def add_seconds(self, open_tag: OpenTag, seconds: float) -> None:
        """Count ``seconds`` of copying to ``open_tag`` (a copy thread)."""
        with self._cond:
            open_tag.stage_seconds += seconds

    def failed(self, job: FileJob, error: BaseException) -> None:
        """A file's staging failed: its name is free again; its error waits to be seen.

        Once the tag is being committed, the file stays listed: the commit raises its error;
        and once the engine is closing, too: the close names the tag it discards.
        """
        with self._cond:
            open_tag = job.open_tag
            if open_tag.state is TagState.OPEN and not self._closing:
                if open_tag.files.get(job.name) is job:
                    del open_tag.files[job.name]
                open_tag.failures[job.name] = error
        job.written.set_exception(error)
        job.staged.set_exception(error)

    def seen(self, job: FileJob, error: BaseException) -> None:
        """``error`` of ``job``'s staging was raised to its caller: the commit need not."""
        with self._cond:
            open_tag = job.open_tag
            if open_tag.failures.get(job.name) is error:
                del open_tag.failures[job.name]
            if open_tag.state is TagState.OPEN and not open_tag.files and not open_tag.failures:
                self._forget(open_tag)  # nothing of it reaches the writer: free its slot

    def poison(self, job: FileJob, error: BaseException) -> bool:
        """``job``'s file was modified before its fence: its tag can never be published.

        Returns whether the tag is still open (the caller then commits it, so that the
        commit discards it and frees its slot).
        """
        with self._cond:
            job.sealed = error
            open_tag = job.open_tag
            if open_tag.poison is None:
                open_tag.poison = error
            return open_tag.state is TagState.OPEN and self._open.get(open_tag.tag) is open_tag

    # -- commits -------------------------------------------------------------------------

    def begin_commit(
        self, tag: str | None, *, empty_ok: bool, metadata: dict[str, Any] | None = None
    ) -> tuple[OpenTag, bool]:
        """The tag a commit means, now COMMITTING, and whether this call started its commit.

        The caller that started it submits the commit (``open_tag.commit`` is its future,
        made here, and ``metadata`` its metadata); a second call for the same tag gets the
        same future, and may repeat the metadata but not change it. ``tag=None`` is the
        single open tag. ``empty_ok`` (a rank of a distributed engine) opens a tag without
        files. Raises :class:`InvalidStateError` otherwise.
        """
        with self._cond:
            if self._closing:
                raise ClosedError("the checkpoint engine is closing")
            if tag is None:
                if len(self._open) != 1:
                    raise InvalidStateError(
                        "commit() without a tag needs exactly one open checkpoint; open: "
                        f"{sorted(self._open)}"
                    )
                tag = next(iter(self._open))
            open_tag = self._open.get(tag)
            if open_tag is None:
                if not empty_ok:
                    raise InvalidStateError(
                        f"nothing was saved under tag {tag!r}; nothing to commit"
                    )
                open_tag = self._open[tag] = self._new(tag)
            if open_tag.commit is not None:
                changed = metadata is not None and metadata != open_tag.metadata
                if changed and open_tag.poison is None:  # a poisoned tag's commit fails
                    raise InvalidStateError(
                        f"checkpoint {tag!r} is already being committed with metadata "
                        f"{open_tag.metadata!r}; a second commit() of it cannot change that"
                    )
                return open_tag, False
            open_tag.metadata = metadata
            open_tag.state = TagState.COMMITTING
            open_tag.commit = running_future()
            self._cond.notify_all()
            return open_tag, True

    def end_commit(self, open_tag: OpenTag, *, published: bool) -> None:
        """The commit of ``open_tag`` ended (the commit thread): free its slot for the next."""
        with self._cond:
            open_tag.state = TagState.PUBLISHED if published else TagState.FAILED
            self._forget(open_tag)

    def _forget(self, open_tag: OpenTag) -> None:
        if self._open.get(open_tag.tag) is open_tag:
            del self._open[open_tag.tag]
        if open_tag in self._queued:
            self._queued.remove(open_tag)
        slot, open_tag.slot = open_tag.slot, None
        if slot is not None:
            self._slots.give(slot)
            while self._queued:
                waiting = self._queued.popleft()
                if waiting.slot is None and self._open.get(waiting.tag) is waiting:
                    waiting.slot = self._slots.take()
                    break
        self._cond.notify_all()

    # -- background commits ----------------------------------------------------------------

    def own(self, commit: concurrent.futures.Future[Any]) -> None:
        """Own ``commit``: a failure nobody sees is raised by :meth:`raise_background`."""

        def done(future: concurrent.futures.Future[Any]) -> None:
            error = future.exception()
            if error is not None:
                with self._cond:
                    if future in self._seen:
                        self._seen.discard(future)
                    else:
                        self._background.append((future, error))

        commit.add_done_callback(done)

    def commit_seen(self, commit: concurrent.futures.Future[Any]) -> None:
        """``commit``'s failure was (or will be) raised to its caller: not again.

        Called before the commit ended, it marks the failure it will end with as seen.
        """
        with self._cond:
            if any(future is commit for future, _ in self._background):
                self._background = [(f, e) for f, e in self._background if f is not commit]
            else:  # its done-callback has not run yet: it will find the mark
                self._seen.add(commit)

    def raise_background(self) -> None:
        """Raise (once) the failure of a commit that nobody saw fail, if any."""
        with self._cond:
            if not self._background:
                return
            _, error = self._background.pop(0)
        raise error

    # -- close ---------------------------------------------------------------------------

    def close(self) -> list[OpenTag]:
        """Refuse new work, wake the waiters; the tags still open (their commits first)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            return list(self._open.values())

    def release(self) -> None:
        """Forget every tag and unmap every slot (nothing copies or writes any more)."""
        with self._cond:
            self._open.clear()
            self._queued.clear()
        self._slots.close()

    def commits(self, tag: str | None = None) -> list[concurrent.futures.Future[Any]]:
        """The futures of the commits requested and not yet ended, oldest first (of
        ``tag`` only, when given)."""
        with self._cond:
            return [
                t.commit
                for t in self._open.values()
                if t.commit is not None and (tag is None or t.tag == tag)
            ]

    def open_tags(self) -> list[str]:
        """The tags in flight, in the order they were opened."""
        with self._cond:
            return list(self._open)
