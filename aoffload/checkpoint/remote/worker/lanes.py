"""Upload lanes: each upload thread sends through a filesystem and an event loop of its own.

fsspec's asynchronous filesystems (s3fs, gcsfs, adlfs) run every request of an instance on
one event loop thread. A file's request is prepared on that thread before its first byte
leaves, and the preparation is CPU work: the whole file read into memory, botocore's CRC32
and (over ``http://``) the SigV4 payload SHA-256, the copies into the HTTP body. With one
loop, the files of a tag are prepared one after the other while the others wait, and the
sends share that thread with the preparations; ``s3fs.put`` of a list does the same.

A lane is a thread running an event loop of its own, with its own instance of the
filesystem (its own client and connections), made the first time an upload thread of
:mod:`.service` sends a file: every upload thread has its lane, so files in flight are
prepared on several cores at once (hashlib, zlib and the socket calls release the GIL).
The requests are s3fs's own (``put_file``: one PUT below its multipart threshold,
concurrent parts above it); only where they are prepared changes. A filesystem that is not
asynchronous (``file://``) has no loop to spread: its files go through the store's instance.

Measured in one process on moto, on a busy 2-core host (4 files of 16 MiB, alternating, 16
repetitions): upload threads sharing one loop sent at 0.91x the throughput of ``s3fs.put``,
one lane per thread at 1.11x (``docs/remote.md`` has the engine's figures).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from typing import Any

from fsspec.asyn import AsyncFileSystem
from fsspec.core import url_to_fs
from fsspec.spec import AbstractFileSystem

from ...._errors import CheckpointError

__all__ = ["Lanes"]


def _share_models(lane: AbstractFileSystem, store: AbstractFileSystem) -> None:
    """An S3 lane's botocore session reads the service models the store's session has
    loaded already, instead of parsing them again (about 0.25 s of CPU per lane when four
    lanes start at once). Only the models are shared: each lane resolves its credentials
    itself, so that nothing bound to one event loop (a refresh lock) is used on another."""
    try:
        from aiobotocore.session import AioSession
        from s3fs import S3FileSystem
    except ImportError:  # not S3
        return
    loaded = getattr(store, "session", None)  # set by the store's first request
    if not isinstance(lane, S3FileSystem) or lane.session is not None or loaded is None:
        return
    session = AioSession(**lane.kwargs)  # what s3fs would make (a profile, say)
    session.register_component("data_loader", loaded.get_component("data_loader"))
    lane.session = session


class _Lane:
    """One event loop on a thread of its own, and a filesystem instance bound to it."""

    def __init__(
        self, url: str, options: Mapping[str, Any], number: int, store: AbstractFileSystem
    ) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name=f"aoffload-upload-lane-{number}", daemon=True
        )
        self.thread.start()
        try:
            # a fresh instance (fsspec's cache would hand back the store's, on its loop)
            self.fs: AbstractFileSystem = url_to_fs(
                url, **{**options, "skip_instance_cache": True, "loop": self.loop}
            )[0]
            _share_models(self.fs, store)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


class Lanes:
    """The upload lanes of one store: :meth:`put_file` sends on the calling thread's lane."""

    def __init__(self, fs: AbstractFileSystem, url: str, options: Mapping[str, Any]) -> None:
        self._fs = fs
        self._url = url
        self._options = dict(options)
        # an instance bound to its own loop: one that already runs on the caller's loop
        # (asynchronous=True) or has no loop (file://) keeps its requests where they are,
        # and so does a session of the user's (shared, it would be used from every loop)
        self.enabled = (
            isinstance(fs, AsyncFileSystem) and not fs.asynchronous and "session" not in options
        )
        self._local = threading.local()
        self._lock = threading.Lock()
        self._lanes: list[_Lane] = []
        self._closed = False

    def _lane(self) -> _Lane:
        with self._lock:
            if self._closed:  # a stopped loop would never run the upload: never wait on one
                raise CheckpointError("the uploader is closing: no upload starts any more")
            lane: _Lane | None = getattr(self._local, "lane", None)
            if lane is None:
                lane = _Lane(self._url, self._options, len(self._lanes), self._fs)
                self._lanes.append(lane)
                self._local.lane = lane
            return lane

    @property
    def count(self) -> int:
        """How many lanes run (one per upload thread that has sent a file; none once closed)."""
        with self._lock:
            return len(self._lanes)

    def put_file(self, local: str, target: str) -> None:
        """Upload local file ``local`` to ``target`` (blocking), on this thread's lane."""
        fs = self._lane().fs if self.enabled else self._fs
        fs.put_file(local, target)

    def close(self) -> None:
        """Stop every lane's loop (no upload may be in flight). Their clients and
        connections go with the uploader process."""
        with self._lock:
            self._closed = True
            lanes, self._lanes = self._lanes, []
        for lane in lanes:
            lane.stop()
