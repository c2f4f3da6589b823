"""The remote tier of one engine, on the trainer's side: uploads the engine owns.

``CheckpointEngine(directory, remote=URL)`` keeps ``directory`` as the fast tier: a commit
is durable there, as without a remote tier. Each committed tag is then uploaded in the
background, in commit order, by :class:`RemoteTier`:

===================  ==============================================================
thread / process     work
===================  ==============================================================
the commit thread    on a successful commit, hands the tag to the upload thread
upload thread        one tag at a time: asks the uploader for the files, then the
                     manifest, then ``latest``, then remote retention; with several
                     ranks, the protocol of :mod:`._spread` over the commit store
uploader process     the transfers themselves (:mod:`.remote`): concurrent files,
                     multipart parts, retries with backoff
load thread          a file found only in the remote tier: downloaded, verified
                     against the manifest, cached (:mod:`._resume`)
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
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._errors import (
    AoffloadError,
    CheckpointError,
    ClosedError,
    CorruptCheckpointError,
    InvalidStateError,
    RemoteError,
)
from ..._runtime.core import WorkerCore
from ..._runtime.protocol import Call
from ..._runtime.threads import DaemonThreadExecutor, mark_retrieved, running_future
from ..core.commit import CommitResult
from ..core.tags import OpenTag
from ..format import layout
from .early import EarlyFiles
from .resume import merge, result_of
from .worker import TARGET
from .worker.calls import (
    AwaitFiles,
    Discard,
    PutText,
    ReadManifest,
    RemoveTags,
    ScanRemote,
    StartFiles,
    UploaderConfig,
)
from .worker.store import BACKOFF, is_url, redact_url

if TYPE_CHECKING:
    from .ranks import SpreadRanks

__all__ = ["RemoteTier"]

logger = logging.getLogger(__name__)

_KEEP_FUTURES = 64


_settling = threading.Lock()


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


def _done(value: Any) -> concurrent.futures.Future[Any]:
    future: concurrent.futures.Future[Any] = running_future()
    future.set_result(value)
    return future


class RemoteTier:
    """The remote tier of one engine: its uploader process and its uploads, in commit order.

    ``spawn()``, then ``join()`` (waits for the uploader, scans the remote tier) at the
    engine's start; :meth:`follow` for every commit; :meth:`close` at its end.
    """

    def __init__(
        self,
        directory: Path,
        url: object,
        storage_options: Mapping[str, Any] | None,
        *,
        keep_last: int | None,
        upload_timeout: float,
        close_timeout: float,
        upload_backoff: float = BACKOFF[0],
        early: bool = False,
    ) -> None:
        if not is_url(url):
            raise ValueError(f"remote must be an fsspec URL such as 's3://bucket/run', not {url!r}")
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise TypeError("storage_options must be a mapping (fsspec's options for the URL)")
        if not upload_timeout > 0:
            raise ValueError(f"upload_timeout must be > 0 seconds, not {upload_timeout!r}")
        if not 0 <= upload_backoff <= BACKOFF[1]:
            raise ValueError(
                f"upload_backoff must be between 0 and {BACKOFF[1]:g} seconds, "
                f"not {upload_backoff!r}"
            )
        self.directory = directory
        self.url = redact_url(str(url))
        self.timeout = upload_timeout
        self.early = early
        """Whether each file's upload starts as soon as it is durable (before the commit ends)."""
        self._keep_last = keep_last
        config = UploaderConfig(str(url), dict(storage_options or {}), backoff=upload_backoff)
        self.uploader = WorkerCore(
            TARGET, config, name="checkpoint-uploader", close_timeout=close_timeout
        )
        self.ranks: SpreadRanks | None = None
        """The distributed protocol (:class:`._spread.SpreadRanks`), set by the engine."""
        self._lock = threading.Lock()
        self._futures: collections.OrderedDict[str, concurrent.futures.Future[CommitResult]] = (
            collections.OrderedDict()
        )
        self._manifests: dict[str, dict[str, Any]] = {}
        self.latest: str | None = None
        """The tag the remote ``latest`` names, as of the scan and this engine's uploads."""
        self._thread: DaemonThreadExecutor | None = None
        self._newest = 0  # the sequence of the newest tag this engine published

    # -- lifecycle -------------------------------------------------------------------------

    def spawn(self) -> None:
        """Start the uploader process (its start overlaps the writer's)."""
        self.uploader.spawn()

    def join(self, timeout: float, local: layout.Scan) -> layout.Scan:
        """Wait for the uploader, scan the remote tier; both tiers' tags (blocking)."""
        try:
            self.uploader.ready.result(timeout)
        except concurrent.futures.TimeoutError:
            raise self.uploader.startup_timeout(timeout) from None
        scan = self.call(ScanRemote(), f"could not list the remote tier {self.url}")
        with self._lock:
            self._manifests, self.latest = dict(scan.manifests), scan.latest
        self._thread = DaemonThreadExecutor("aoffload-upload")
        return merge(local, self.directory, scan)

    def call(self, call: Call[Any], what: str) -> Any:
        """Run ``call`` in the uploader (blocking); its errors as :class:`CheckpointError`."""
        try:
            return self.uploader.request(call)
        except RemoteError as exc:
            kind = CorruptCheckpointError if "Corrupt" in exc.remote_type else CheckpointError
            raise kind(f"{what}: {exc.remote_message}") from None

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
        for tag, future in self._late(late):
            _settle(future, None, self._failed(tag, ClosedError()))
        try:
            if late:
                self.uploader.kill()  # it may hang on a dead endpoint: no graceful drain
            self.uploader.stop()
            self.uploader.release()
        finally:
            if self._thread is not None:
                self._thread.shutdown(wait=True)

    def _late(
        self, late: set[concurrent.futures.Future[CommitResult]]
    ) -> list[tuple[str, concurrent.futures.Future[CommitResult]]]:
        with self._lock:
            return [(tag, future) for tag, future in self._futures.items() if future in late]

    # -- uploads ---------------------------------------------------------------------------

    def follow(
        self,
        open_tag: OpenTag,
        commit: concurrent.futures.Future[CommitResult],
        latest: bool,
        own: Callable[[concurrent.futures.Future[Any]], None],
        seen: Callable[[concurrent.futures.Future[Any]], None],
    ) -> Callable[[], None]:
        """Upload ``open_tag``: each file once it is durable (:mod:`._early`), publish once
        ``commit`` succeeds; ``own`` the upload's future then. Returns what starts the
        early uploads, for the commit thread to run (it makes links: no I/O on the loop).

        The upload's future is owned from the start, before anyone can wait on it, so its
        failure is recorded before a waiter wakes. A failed commit fails it with the
        commit's error, marked ``seen`` (the commit's own future reports it: never twice),
        and what was sent is removed.
        """
        tag = open_tag.tag
        early = EarlyFiles(self.directory, open_tag, self.uploader)
        upload: concurrent.futures.Future[CommitResult] = running_future()
        upload.add_done_callback(mark_retrieved)
        with self._lock:
            self._futures[tag] = upload
            self._futures.move_to_end(tag)
            while len(self._futures) > _KEEP_FUTURES:
                oldest = next(iter(self._futures))
                if not self._futures[oldest].done():
                    break
                del self._futures[oldest]

        own(upload)

        def committed(future: concurrent.futures.Future[CommitResult]) -> None:
            error = future.exception()
            if error is not None:
                seen(upload)
                upload.set_exception(error)
            thread = self._thread
            try:
                if thread is None:
                    raise RuntimeError("not started")
                if error is not None:
                    thread.submit(early.abandon)
                else:
                    thread.submit(self._upload, tag, future.result(), latest, upload, early)
            except RuntimeError:
                early.remove()
                if error is None:
                    closed = ClosedError(f"the engine closed before uploading {tag!r}")
                    upload.set_exception(closed)

        commit.add_done_callback(committed)
        return lambda: early.watch(list(open_tag.files.values()))

    def uploaded(self, tag: str | None) -> concurrent.futures.Future[CommitResult]:
        """The future of ``tag``'s upload (default: the newest commit of this engine)."""
        with self._lock:
            if tag is None:
                if not self._futures:
                    raise InvalidStateError("this engine has committed nothing to upload")
                tag = next(reversed(self._futures))
            future = self._futures.get(tag)
            manifest = self._manifests.get(tag)
        if future is not None:
            return future
        if manifest is not None:
            return _done(result_of(self.directory, manifest))
        raise InvalidStateError(
            f"checkpoint {tag!r} was not committed by this engine, and {self.url} has no "
            "published checkpoint of that name"
        )

    def holding(self, tag: str) -> concurrent.futures.Future[Any] | None:
        """The upload that still reads local ``tag`` (retention waits for it), or ``None``."""
        with self._lock:
            future = self._futures.get(tag)
        return future if future is not None and not future.done() else None

    def _upload(
        self,
        tag: str,
        result: CommitResult,
        latest: bool,
        upload: concurrent.futures.Future[CommitResult],
        early: EarlyFiles,
    ) -> None:
        try:
            if self.ranks is not None:
                self.ranks.upload(tag, latest, self, early)
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
            _settle(upload, result, None)
            self.retire()  # after: retention is not part of the publication

    def _failed(self, tag: str, exc: BaseException) -> BaseException:
        if isinstance(exc, ClosedError):
            exc = CheckpointError(
                f"the engine closed before the upload ended (upload_timeout={self.timeout} s)"
            )
        elif not isinstance(exc, CheckpointError):
            return exc
        where = self.directory / tag
        with self._lock:
            latest = self.latest
        error = type(exc)(
            f"checkpoint {tag!r} was not published in {self.url}: {exc}; it is committed "
            f"locally in {where}, and the remote {layout.LATEST!r} still names {latest!r}"
        )
        logger.error("%s", error)
        return error

    def put_files(
        self, tag: str, files: tuple[tuple[str, str, int], ...], early: EarlyFiles | None
    ) -> None:
        """Upload ``files`` (local path, name, bytes) into ``tag``: those ``early`` has not
        started yet, then wait for all of them (blocking)."""
        if early is not None:
            early.upload(files, self.call)
        elif files:
            self.call(StartFiles(tag, files), f"could not upload {tag!r}")
            self.call(AwaitFiles(tag), f"could not upload {tag!r}")

    def discard(self, tag: str, names: tuple[str, ...]) -> None:
        """Remove this rank's uploaded files of ``tag``, which will never be published."""
        if names:
            try:
                self.call(Discard(tag, names), f"could not remove the files of {tag!r}")
            except AoffloadError as exc:  # the uploader died: a leftover nobody reads
                logger.warning("%s", exc)

    def publish(self, tag: str, manifest: dict[str, Any], text: str, latest: bool) -> None:
        """Every file is uploaded: write the manifest, then ``latest``; retire old tags."""
        self.call(PutText((tag, layout.MANIFEST), text), f"could not publish {tag!r}")
        if latest:
            self.call(PutText((layout.LATEST,), tag + "\n"), "could not move latest")
        with self._lock:
            self._manifests[tag] = manifest
            if latest:
                self.latest = tag
        logger.info("checkpoint %s published in %s", tag, self.url)
        self._newest = max(self._newest, int(manifest["sequence"]))

    def retire(self) -> None:
        """Remote retention: remove the oldest tags beyond ``keep_last``, all older than the
        newest tag this engine published (rank 0's upload thread, after a publication)."""
        if self._keep_last is None:
            return
        with self._lock:
            ordered = sorted((int(m["sequence"]), t) for t, m in self._manifests.items())
            old = [t for s, t in ordered[: -self._keep_last] if s < self._newest]
        if not old:
            return
        try:
            self.call(RemoveTags(tuple(old)), "retention could not remove old checkpoints")
        except AoffloadError:
            logger.exception("remote retention failed; the old tags stay in %s", self.url)
            return
        with self._lock:
            for tag in old:
                self._manifests.pop(tag, None)

    def manifest(self, tag: str) -> dict[str, Any]:
        """The remote manifest of ``tag`` (read from the remote tier if not known here)."""
        with self._lock:
            manifest = self._manifests.get(tag)
        if manifest is None:
            manifest = self.call(ReadManifest(tag), f"could not read checkpoint {tag!r}")
        return manifest
