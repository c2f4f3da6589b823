"""A real S3 endpoint on loopback for tests: moto's server in a process of its own.

:class:`S3Endpoint` starts ``python -m moto.server`` on ``127.0.0.1`` and a free port and
says how to reach it (:attr:`S3Endpoint.environ`: ``AWS_ENDPOINT_URL`` and fake
credentials; :attr:`S3Endpoint.storage_options`: the same for fsspec). It is what the
``aoffload_s3`` fixture of :mod:`aoffload.testing` (which exports it) and ``aoffload
local-s3`` use, and it can be paused (SIGSTOP), resumed and stopped, to test what a slow or
dead endpoint does.
It needs ``moto[server]`` (``pip install aoffload[dev]``). Loopback only.
:meth:`S3Endpoint.objects`, :meth:`~S3Endpoint.get` and :meth:`~S3Endpoint.put` read and
write objects with plain HTTP, to check what an engine uploaded (or damage it) without
boto in the test process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from typing import Any
from xml.etree import ElementTree

__all__ = ["S3Endpoint"]

_START_SECONDS = 60.0
_FAKE = {
    "AWS_ACCESS_KEY_ID": "aoffload-test-key",
    "AWS_SECRET_ACCESS_KEY": "aoffload-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}

_AUTHORIZATION = (
    f"AWS4-HMAC-SHA256 Credential={_FAKE['AWS_ACCESS_KEY_ID']}/20240101/us-east-1/s3/"
    "aws4_request, SignedHeaders=host, Signature=0"
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class S3Endpoint:
    """moto's S3 server on ``127.0.0.1:<port>``; use :meth:`start` (a context manager)."""

    def __init__(self, process: subprocess.Popen[bytes], port: int) -> None:
        self.process = process
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        """The endpoint's URL (what ``AWS_ENDPOINT_URL`` says)."""
        self.environ = {"AWS_ENDPOINT_URL": self.url, **_FAKE}
        """The environment that points boto, s3fs and the spawned workers at it."""
        self.storage_options: dict[str, Any] = {
            "key": _FAKE["AWS_ACCESS_KEY_ID"],
            "secret": _FAKE["AWS_SECRET_ACCESS_KEY"],
            "endpoint_url": self.url,
            "client_kwargs": {"region_name": _FAKE["AWS_DEFAULT_REGION"]},
        }
        """The same for s3fs alone: ``CheckpointEngine(..., storage_options=...)``."""

    @classmethod
    @contextlib.contextmanager
    def start(cls, port: int = 0, environ: Mapping[str, str] | None = None) -> Iterator[S3Endpoint]:
        """Start the server (on ``port``; 0: a free one), wait until it listens, yield it;
        stop it at the end. ``environ`` is added to the server's environment (moto's
        settings: ``INITIAL_NO_AUTH_ACTION_COUNT=1`` checks every request but the first
        against its IAM users, so that any credentials are denied)."""
        port = port or _free_port()
        process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env={**os.environ, **_FAKE, **(environ or {})},
        )
        endpoint = cls(process, port)
        try:
            endpoint._wait_listening()
            yield endpoint
        finally:
            endpoint.stop()

    def _wait_listening(self) -> None:
        listening = threading.Event()
        seen: list[bytes] = []

        stderr = self.process.stderr
        if stderr is None:  # pragma: no cover - started with stderr=PIPE
            raise RuntimeError("moto's server has no log pipe")

        def read() -> None:  # the server says when it listens; then drain its log
            for line in stderr:
                if b"Running on" in line:
                    listening.set()
                elif not listening.is_set():
                    seen.append(line)
            listening.set()

        threading.Thread(target=read, name="moto-log", daemon=True).start()
        if not listening.wait(_START_SECONDS) or self.process.poll() is not None:
            raise RuntimeError(
                "moto's S3 server did not start (pip install 'moto[server]'): "
                + b"".join(seen).decode(errors="replace")[-2000:]
            )

    def _request(self, method: str, path: str, data: bytes | None = None) -> bytes:
        # Plain HTTP: moto does not check signatures, and botocore's models stay out of the
        # test process (loading them leaves a heap whose collection stalls an event loop).
        request = urllib.request.Request(f"{self.url}/{path}", data=data, method=method)
        request.add_header("Authorization", _AUTHORIZATION)  # named, never checked
        request.add_header("x-amz-content-sha256", "UNSIGNED-PAYLOAD")
        request.add_header("Content-Type", "application/octet-stream")  # not a form
        with urllib.request.urlopen(request, timeout=60) as response:
            return bytes(response.read())

    def bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh name unless given); its name."""
        name = name or f"aoffload-{uuid.uuid4().hex[:12]}"
        self._request("PUT", name)
        return name

    def objects(self, url: str) -> dict[str, bytes]:
        """Every object under ``url`` (``s3://bucket/prefix``), by key relative to it."""
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        prefix = prefix.rstrip("/") + "/" if prefix else ""
        query = urllib.parse.urlencode({"list-type": "2", "prefix": prefix})
        found: dict[str, bytes] = {}
        token = ""
        while True:
            extra = f"&continuation-token={urllib.parse.quote(token)}" if token else ""
            listing = ElementTree.fromstring(self._request("GET", f"{bucket}?{query}{extra}"))
            for element in listing.iter():
                if element.tag.endswith("}Key") and element.text:
                    key = element.text
                    found[key.removeprefix(prefix)] = self.get(f"s3://{bucket}/{key}")
            token = next(
                (e.text or "" for e in listing.iter() if e.tag.endswith("}NextContinuationToken")),
                "",
            )
            if not token:
                return found

    def get(self, url: str) -> bytes:
        """The object at ``url`` (``s3://bucket/key``)."""
        return self._request("GET", urllib.parse.quote(url.removeprefix("s3://")))

    def put(self, url: str, data: bytes) -> None:
        """Write the object at ``url`` (``s3://bucket/key``)."""
        self._request("PUT", urllib.parse.quote(url.removeprefix("s3://")), data)

    def pause(self) -> None:
        """SIGSTOP the server: connections hang until :meth:`resume`."""
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT the server."""
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """Stop the server for good (the endpoint is then down: connections are refused)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
        self.process.wait()
        if self.process.stderr is not None:
            self.process.stderr.close()
