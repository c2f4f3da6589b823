"""The uploader: a worker service that moves checkpoints between the local and remote tiers.

It serves the calls of :mod:`.calls` one at a time, in order, on the
:class:`~.store.RemoteStore` it builds from its configuration. A :class:`~.calls.StartFiles`
starts its files' uploads on a pool of threads (``concurrency`` at once) and is answered at
once; :class:`~.calls.AwaitFiles` waits for them. Each goes through fsspec's
``put_file`` on its thread's own event loop (:mod:`.lanes`), which sends a large file as a
multipart upload with concurrent parts where the backend has them (s3fs: from 2 x 50 MiB,
``max_concurrency`` parts in flight); a reader of the remote tier never sees a file
half-written. The process runs as background
work (``SCHED_BATCH``): the trainer's threads come first. Its log records leave through a
filter that removes every credential.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Mapping
from typing import Any

from ...._runtime.protocol import Call
from ...._runtime.serve import Handler, Service
from ...._runtime.threads import background_policy
from .calls import (
    AwaitFiles,
    Discard,
    Fetch,
    GetManifest,
    PutText,
    RemoveTags,
    ScanRemote,
    StartFiles,
    UploaderConfig,
)
from .store import Redactor, RemoteStore

__all__ = ["UploaderService"]

logger = logging.getLogger(__name__)

_QUIET = ("botocore", "aiobotocore", "s3fs", "fsspec", "urllib3", "aiohttp", "gcsfs", "adlfs")
"""Libraries whose debug logs show requests (and their signed headers): WARNING and up."""


class _Scrub(logging.Filter):
    """Removes credentials from every record before it is forwarded to the trainer."""

    def __init__(self, redact: Redactor) -> None:
        super().__init__()
        self._redact = redact

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = self._redact(record.getMessage()), None
        if record.exc_info is not None:
            record.exc_text = self._redact(logging.Formatter().formatException(record.exc_info))
            record.exc_info = None
        return True


class UploaderService(Service):
    """Serves the uploader's calls, one at a time, in order."""

    config_type = UploaderConfig

    def __init__(self, config: UploaderConfig) -> None:
        background_policy()  # uploading is background work: the trainer's cores come first
        redact = Redactor(config.url, config.storage_options)
        for handler in logging.getLogger().handlers:
            handler.addFilter(_Scrub(redact))
        for name in _QUIET:
            logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))
        self._store = RemoteStore(
            config.url, config.storage_options, config.retries, config.backoff
        )
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max(1, config.concurrency), thread_name_prefix="aoffload-upload"
        )
        self._uploads: dict[str, list[tuple[str, concurrent.futures.Future[None]]]] = {}

    def handlers(self) -> Mapping[type[Call[Any]], Handler]:
        """Scan, upload files, write a small object, remove tags, download, read a manifest."""
        return {
            ScanRemote: lambda call: self._store.scan(call.probe),
            StartFiles: self._start_files,
            AwaitFiles: self._await_files,
            PutText: lambda call: self._store.put_text(call.parts, call.text),
            RemoveTags: self._remove,
            Fetch: self._fetch,
            Discard: lambda call: self._store.discard(call.tag, call.names),
            GetManifest: lambda call: self._store.manifest(call.tag),
        }

    def _start_files(self, call: StartFiles) -> None:
        started = self._uploads.setdefault(call.tag, [])
        for local, name, nbytes in call.files:
            upload = self._pool.submit(self._store.put_file, local, call.tag, name, nbytes)
            started.append((name, upload))

    def _await_files(self, call: AwaitFiles) -> None:
        uploads = self._uploads.pop(call.tag, [])
        concurrent.futures.wait([upload for _, upload in uploads])
        failed = [upload for _, upload in uploads if upload.exception() is not None]
        if failed:  # nothing of a failed upload stays behind (it would never be published)
            self._store.discard(call.tag, [n for n, u in uploads if u.exception() is None])
            failed[0].result()

    def _remove(self, call: RemoveTags) -> None:
        for tag in call.tags:
            self._store.remove_tag(tag)

    def _fetch(self, call: Fetch) -> None:
        self._store.fetch(call.tag, call.name, call.entry, call.target)

    def close(self) -> None:
        """Stop the upload threads and their lanes (nothing is in flight: calls are served
        in order)."""
        self._pool.shutdown(wait=True)
        self._store.lanes.close()
