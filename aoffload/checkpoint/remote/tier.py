"""The remote tier of one engine: uploads the engine owns, in commit order.

``CheckpointEngine(directory, remote=URL)`` keeps ``directory`` as the fast tier: a commit
is durable there, as without a remote tier. Each committed tag is then uploaded in the
background, in commit order, by :class:`RemoteTier`, the engine's
:class:`~..core.roles.Tier`:

===================  ==============================================================
thread / process     work
===================  ==============================================================
the caller's         ``commit()``: :meth:`RemoteTier.follow` makes the upload's future
the commit thread    with ``early_uploads``, watches each file (:mod:`.early`); on a
                     successful commit, hands the tag to the upload thread
upload thread        one tag at a time: asks the uploader for the files, then the
                     manifest, then ``latest``, then remote retention; with several
                     ranks, the protocol of :mod:`.ranks` over the commit store
uploader process     the transfers themselves (``worker/``): concurrent files,
                     multipart parts, retries with backoff
load thread          a file found only in the remote tier: downloaded, verified
                     against the manifest, cached (:meth:`.uploader.Uploader.source`)
===================  ==============================================================

Nothing here runs on the event loop or on the trainer's threads; the loop only learns that
an upload ended (``await engine.uploaded(tag)``). Each tag's upload has a future; the engine
owns it, so a failure nobody awaited is raised by the engine's next call. Local retention
keeps a tag until its upload has ended (:meth:`RemoteTier.holding`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..._errors import AoffloadError, CheckpointError, ClosedError, InvalidStateError
from ..._runtime.threads import DaemonThreadExecutor, mark_retrieved, running_future
from ..core.result import CommitResult, result_of
from ..format import layout
from .early import EarlyFiles
from .uploader import Uploader, merge
from .worker.calls import AwaitFiles, Discard, PutText, RemoveTags, StartFiles

if TYPE_CHECKING:
    from ..core.retention import Retention
    from ..core.roles import Owner, Published
    from ..core.tags import OpenTag

__all__ = ["RemoteTier", "Spread"]

logger = logging.getLogger(__name__)

_KEEP_FUTURES = 64

_settling = threading.Lock()

Files = tuple[tuple[str, str, int], ...]
"""Files to upload: (local path, name in the tag, bytes per the manifest)."""


def _nothing() -> None:
    """Marks where the upload thread's queue ends."""


def _settle(
    future: concurrent.futures.Future[Any], value: Any, error: BaseException | None
) -> None:
    """Resolve ``future`` unless it is already (a close and the upload thread may race)."""
    with _settling:
        if future.done():
            return
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)


class Spread(Protocol):
    """The upload of a tag whose files lie on several ranks (:mod:`.ranks`)."""

    def upload(
        self, tier: RemoteTier, tag: str, published: Published, latest: bool, early: EarlyFiles
    ) -> None:
        """Upload this rank's files of ``tag``; one rank publishes once every rank has
        (blocking: the upload thread). Raises on every rank when any rank's upload failed."""


class RemoteTier:
    """The remote tier of one engine: its uploader and its uploads, in commit order.

    ``retention`` retires remote tags (only those older than the newest tag this engine
    published); ``timeout`` (``upload_timeout``) bounds the close's wait for the uploads
    in flight; ``early`` starts each file's upload once it is durable; ``spread`` uploads
    the files of several ranks (``None``: this process holds every file).
    """

    def __init__(
        self,
        uploader: Uploader,
        *,
        retention: Retention,
        start_timeout: float,
        timeout: float,
        early: bool = False,
        spread: Spread | None = None,
    ) -> None:
        self.uploader = uploader
        self.directory = uploader.directory
        self.url = uploader.url
        self.timeout = timeout
        self.early = early
        """Whether each file's upload starts as soon as it is durable (before the commit ends)."""
        self._retention = retention
        self._start_timeout = start_timeout
        self._spread = spread
        self._lock = threading.Lock()
        self._futures: collections.OrderedDict[str, concurrent.futures.Future[CommitResult]] = (
            collections.OrderedDict()
        )
        self._thread: DaemonThreadExecutor | None = None
        self._newest = 0  # the sequence of the newest tag this engine published

    # -- lifecycle -------------------------------------------------------------------------

    def spawn(self) -> None:
        """Start the uploader process (its start overlaps the directory's scan)."""
        self.uploader.spawn()

    def join(self, local: layout.Scan) -> layout.Scan:
        """Wait for the uploader, scan the remote tier; both tiers' tags (blocking)."""
        scan = self.uploader.join(self._start_timeout)
        self._thread = DaemonThreadExecutor("aoffload-upload")
        return merge(local, scan)

    def close(self) -> None:
        """Wait for the uploads in flight (at most ``upload_timeout`` in all), then stop the
        uploader. An upload still running then fails (:class:`CheckpointError`)."""
        with self._lock:
            pending = [f for f in self._futures.values() if not f.done()]
        started = time.monotonic()
        _, late = concurrent.futures.wait(pending, timeout=self.timeout)
        if not late and self._thread is not None:
            # the retention that follows a publication, still running on the upload
            # thread once the last upload resolved, ends before the uploader goes
            left = max(0.0, self.timeout - (time.monotonic() - started))
            concurrent.futures.wait([self._thread.submit(_nothing)], timeout=left)
        if late:
            logger.warning(
                "closing with %d upload(s) to %s still running after upload_timeout=%s s; "
                "they are abandoned (the checkpoints stay in the local tier)",
                len(late),
                self.url,
                self.timeout,
            )
        with self._lock:
            abandoned = [(tag, f) for tag, f in self._futures.items() if f in late]
        for tag, future in abandoned:
            _settle(future, None, self._failed(tag, ClosedError()))
        try:
            self.uploader.close(kill=bool(late))  # a hung upload: no graceful drain
        finally:
            if self._thread is not None:
                self._thread.shutdown(wait=True)

    # -- the engine's questions ------------------------------------------------------------

    def follow(self, open_tag: OpenTag, latest: bool, owner: Owner) -> _Upload:
        """Upload ``open_tag`` once its commit succeeds (:class:`_Upload`)."""
        return _Upload(self, open_tag, latest, owner)

    def uploaded(self, tag: str | None) -> concurrent.futures.Future[CommitResult]:
        """The future of ``tag``'s upload (default: the newest commit of this engine)."""
        with self._lock:
            if tag is None:
                if not self._futures:
                    raise InvalidStateError("this engine has committed nothing to upload")
                tag = next(reversed(self._futures))
            future = self._futures.get(tag)
        if future is not None:
            return future
        manifest = self.uploader.manifests().get(tag)
        if manifest is not None:
            done: concurrent.futures.Future[CommitResult] = running_future()
            done.set_result(result_of(self.directory, manifest))
            return done
        raise InvalidStateError(
            f"checkpoint {tag!r} was not committed by this engine, and {self.url} has no "
            "published checkpoint of that name"
        )

    def holding(self, tag: str) -> concurrent.futures.Future[Any] | None:
        """The upload that still reads local ``tag`` (retention waits for it), or ``None``."""
        with self._lock:
            future = self._futures.get(tag)
        return future if future is not None and not future.done() else None

    def source(
        self, name: str, tag: str | None, latest: str | None, known: list[str]
    ) -> tuple[Path, str | None, bool]:
        """Where to load file ``name`` of ``tag`` (default: ``latest``, the newest of both
        tiers) from: the local tier, or the cache a download fills (blocking)."""
        tag = tag if tag is not None else latest
        if tag is None:
            raise CheckpointError(
                f"neither {self.directory} nor {self.url} holds a committed checkpoint"
            )
        tag = layout.validate_tag(tag)
        root, fresh = self.uploader.source(name, tag, known)
        return root, tag, fresh

    # -- uploads (the upload thread) -------------------------------------------------------

    def _track(self, tag: str, upload: concurrent.futures.Future[CommitResult]) -> None:
        with self._lock:
            self._futures[tag] = upload
            self._futures.move_to_end(tag)
            while len(self._futures) > _KEEP_FUTURES:
                oldest = next(iter(self._futures))
                if not self._futures[oldest].done():
                    break
                del self._futures[oldest]

    def _submit(self, work: Callable[..., None], *args: Any) -> None:
        """Run ``work`` on the upload thread; :class:`RuntimeError` once it is gone."""
        if self._thread is None:
            raise RuntimeError("not started")
        self._thread.submit(work, *args)

    def _upload(
        self,
        tag: str,
        published: Published,
        latest: bool,
        upload: concurrent.futures.Future[CommitResult],
        early: EarlyFiles,
    ) -> None:
        try:
            if self._spread is not None:
                self._spread.upload(self, tag, published, latest, early)
            else:
                local = self.directory / tag
                text = (local / layout.MANIFEST).read_text(encoding="utf-8")
                manifest = json.loads(text)
                files = tuple(
                    (str(local / name), name, int(entry["bytes"]))
                    for name, entry in manifest["files"].items()
                )
                self.put_files(tag, files, early)
                self.publish(tag, manifest, text, latest)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever awaits the upload
            _settle(upload, None, self._failed(tag, exc))
        else:
            _settle(upload, published.result, None)
            self.retire()  # after: retention is not part of the publication

    def _failed(self, tag: str, exc: BaseException) -> BaseException:
        if isinstance(exc, ClosedError):
            exc = CheckpointError(
                f"the engine closed before the upload ended (upload_timeout={self.timeout} s)"
            )
        elif not isinstance(exc, CheckpointError):
            return exc
        where = self.directory / tag
        error = type(exc)(
            f"checkpoint {tag!r} was not published in {self.url}: {exc}; it is committed "
            f"locally in {where}, and the remote {layout.LATEST!r} still names "
            f"{self.uploader.latest!r}"
        )
        logger.error("%s", error)
        return error

    def put_files(self, tag: str, files: Files, early: EarlyFiles | None) -> None:
        """Upload ``files`` into ``tag``: those ``early`` has not started yet, then wait for
        all of them (blocking)."""
        if early is not None:
            early.upload(files, self.uploader.call)
        elif files:
            self.uploader.call(StartFiles(tag, files), f"could not upload {tag!r}")
            self.uploader.call(AwaitFiles(tag), f"could not upload {tag!r}")

    def discard(self, tag: str, names: tuple[str, ...]) -> None:
        """Remove this rank's uploaded files of ``tag``, which will never be published."""
        if names:
            try:
                self.uploader.call(Discard(tag, names), f"could not remove the files of {tag!r}")
            except AoffloadError as exc:  # the uploader died: a leftover nobody reads
                logger.warning("%s", exc)

    def publish(self, tag: str, manifest: dict[str, Any], text: str, latest: bool) -> None:
        """Every file is uploaded: write the manifest, then ``latest``."""
        call = self.uploader.call
        call(PutText((tag, layout.MANIFEST), text), f"could not publish {tag!r}")
        if latest:
            call(PutText((layout.LATEST,), tag + "\n"), "could not move latest")
        self.uploader.published(tag, manifest, latest)
        logger.info("checkpoint %s published in %s", tag, self.url)
        self._newest = max(self._newest, int(manifest["sequence"]))

    def retire(self) -> None:
        """Remote retention: remove the tags retention retires, all older than the newest
        tag this engine published (rank 0's upload thread, after a publication)."""
        ordered = sorted((int(m["sequence"]), t) for t, m in self.uploader.manifests().items())
        sequence = {tag: number for number, tag in ordered}
        retired = self._retention.retired([tag for _, tag in ordered])
        old = [tag for tag in retired if sequence[tag] < self._newest]
        if not old:
            return
        try:
            self.uploader.call(RemoveTags(tuple(old)), "retention could not remove old checkpoints")
        except AoffloadError:
            logger.exception("remote retention failed; the old tags stay in %s", self.url)
            return
        self.uploader.forget(old)


class _Upload:
    """The upload of one commit (the tier's :class:`~..core.roles.Follower`).

    Its future is owned from the start, before anyone can wait on it, so its failure is
    recorded before a waiter wakes. A failed commit fails it with the commit's error,
    marked seen (the commit's own future reports it: never twice), and what was sent early
    is removed.
    """

    def __init__(self, tier: RemoteTier, open_tag: OpenTag, latest: bool, owner: Owner) -> None:
        self._tier, self._open_tag, self._latest, self._owner = tier, open_tag, latest, owner
        self.tag = open_tag.tag
        self._early = EarlyFiles(tier.directory, open_tag, tier.uploader.core)
        self.future: concurrent.futures.Future[CommitResult] = running_future()
        self.future.add_done_callback(mark_retrieved)
        tier._track(self.tag, self.future)
        owner.own(self.future)

    def early(self) -> None:
        """With ``early_uploads``: each file's upload starts once it is durable."""
        if self._tier.early:
            self._early.watch(list(self._open_tag.files.values()))

    def committed(self, published: Published) -> None:
        """The commit succeeded: the upload thread uploads the tag."""
        try:
            tier = self._tier
            tier._submit(tier._upload, self.tag, published, self._latest, self.future, self._early)
        except RuntimeError:
            self._early.remove()
            closed = ClosedError(f"the engine closed before uploading {self.tag!r}")
            self.future.set_exception(closed)

    def failed(self, error: BaseException) -> None:
        """The commit failed: so does the upload; what was sent early is removed."""
        self._owner.commit_seen(self.future)
        self.future.set_exception(error)
        try:
            self._tier._submit(self._early.abandon)
        except RuntimeError:
            self._early.remove()
