"""The remote tier's storage, through fsspec: one checkpoint directory under a URL.

The layout is the local one (:mod:`.._format`)::

    URL/<tag>/<files>                   every file first, each uploaded once, no rename
    URL/<tag>/.aoffload-manifest.json   then the manifest: the tag now exists, complete
    URL/latest                          then the pointer (one small object, overwritten)

Object stores have no atomic rename (fsspec's generic ``mv`` is a copy then a delete), so
publication is by write order alone: a reader that sees a manifest sees every file it
lists, and ``latest`` never names a tag whose manifest is not there. Retention deletes a
tag's manifest first, so a tag disappears whole.

Every call is blocking and retried with backoff on transient errors (:func:`retried`);
missing credentials, access denied and a missing bucket are permanent: never retried. It
runs in the uploader process (:mod:`.service`), or in the command line. Errors never
carry a credential: :class:`Redactor` scrubs every message that leaves this module.
Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import xxhash

from ...._errors import CheckpointError, CorruptCheckpointError
from ...format import layout
from ...format.read import parse_manifest, verify_file
from ...format.write import fsync_path
from .calls import BACKOFF, RETRIES, RemoteScan, redact_url
from .lanes import Lanes

__all__ = ["Redactor", "RemoteStore", "retried"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_BLOCK = 8 << 20
_PERMANENT = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    ValueError,
    TypeError,
    CheckpointError,  # and CorruptCheckpointError: what this module decided, not the network
)
_NO_CREDENTIALS = frozenset(
    {
        "NoCredentialsError",  # botocore: nothing in storage_options, the environment, files
        "PartialCredentialsError",
        "CredentialRetrievalError",
        "NoAuthTokenError",
        "UnauthorizedSSOTokenError",
        "DefaultCredentialsError",  # google-auth
        "ClientAuthenticationError",  # azure-core
    }
)
"""The cloud SDKs' errors for credentials that are missing or unusable, by class name (the
SDKs are optional: none is imported here). No retry can make credentials appear."""
_PROBE = ".aoffload-probe-"
"""The name of the small object a start writes and deletes, to check the tier is writable."""
_SECRET_KEY = re.compile(r"key|secret|token|pass|credential|session|sas|sig|auth", re.I)
_SECRET_ENV = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AZURE_STORAGE_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_STORAGE_CONNECTION_STRING",
    "GOOGLE_APPLICATION_CREDENTIALS",
)


class Redactor:
    """Removes every credential of ``url`` and ``storage_options`` from a text.

    A credential is a string value under a key that names one (``key``, ``secret``,
    ``token``, ``password``, ``sas``...), at any depth of the options; the URL's user
    information and query string; and the cloud SDKs' secret environment variables.
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any]) -> None:
        secrets: set[str] = set()
        self._collect(storage_options, secrets, False)
        _, sep, rest = url.partition("://")
        if sep:
            userinfo = rest.partition("/")[0].rpartition("@")[0]
            secrets.update(part for part in re.split(r"[:@]", userinfo) if part)
            query = rest.partition("?")[2]
            secrets.update(v for _, _, v in (p.partition("=") for p in query.split("&")) if v)
        secrets.update(os.environ[name] for name in _SECRET_ENV if os.environ.get(name))
        # the longest first, so that a secret containing another is removed whole
        self._secrets = sorted((s for s in secrets if len(s) >= 4), key=len, reverse=True)
        self.url = redact_url(url)

    def _collect(self, value: object, into: set[str], secret: bool) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                self._collect(item, into, secret or bool(_SECRET_KEY.search(str(key))))
        elif isinstance(value, (list, tuple)):
            for item in value:
                self._collect(item, into, secret)
        elif isinstance(value, str) and secret:
            into.add(value)

    def __call__(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _no_credentials(exc: BaseException) -> bool:
    return any(kind.__name__ in _NO_CREDENTIALS for kind in type(exc).__mro__)


def _permanent(exc: BaseException) -> bool:
    """Whether retrying cannot help: what the store itself decided, a missing object or
    bucket, access denied, no usable credentials."""
    return isinstance(exc, _PERMANENT) or _no_credentials(exc)


def _explain(exc: BaseException) -> str:
    """``exc`` described, with what to do where the kind of failure says it."""
    text = _describe(exc)
    if _no_credentials(exc):
        return (
            f"{text} (no usable credentials: give them in storage_options, e.g. "
            "{'key': ..., 'secret': ...} for s3://, or in the environment or the SDK's "
            "configuration files)"
        )
    if isinstance(exc, PermissionError):
        return f"{text} (access denied: the credentials must allow listing, writing and deleting)"
    return text


def retried(
    what: str,
    call: Callable[[], T],
    redact: Redactor,
    retries: int = RETRIES,
    backoff: float = BACKOFF[0],
) -> T:
    """``call()``, retried with backoff while it fails with a transient error: ``backoff``
    seconds before the first retry, doubled before each next one, at most ``BACKOFF[1]``.
    A permanent error (no usable credentials, access denied, a missing object or bucket,
    what this module decided) is raised at once.

    Raises :class:`CheckpointError` saying ``what`` failed, how many times, and why (the
    message redacted, the original exception not chained: its text may hold a credential).
    """
    delay = backoff
    for attempt in range(retries + 1):
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - transient until proven otherwise: retried
            error: BaseException = exc
            if _permanent(exc) or attempt == retries:
                break
            logger.warning(
                "%s failed (%s); retry %d of %d in %.1f s",
                what,
                redact(_describe(exc)),
                attempt + 1,
                retries,
                delay,
            )
            time.sleep(delay)
            delay = min(delay * 2, BACKOFF[1])
    tries = f" after {attempt + 1} attempts" if attempt else ""
    raise CheckpointError(redact(f"{what} failed{tries}: {_explain(error)}")) from None


class RemoteStore:
    """The checkpoint directory at ``url``, through fsspec with ``storage_options``."""

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        retries: int = RETRIES,
        backoff: float = BACKOFF[0],
    ) -> None:
        import fsspec  # the remote tier's only dependency: imported when one is used

        options = dict(storage_options or {})
        self.redact = Redactor(url, options)
        self.url = self.redact.url
        self.retries = retries
        self.backoff = backoff
        try:
            # a fresh instance: fsspec's cache would reuse one made for another endpoint
            self.fs, root = fsspec.core.url_to_fs(url, **{"skip_instance_cache": True, **options})
        except ImportError as exc:
            raise CheckpointError(
                f"{self.url}: {exc} (the S3 tier needs `pip install aoffload[s3]`)"
            ) from None
        except Exception as exc:  # noqa: BLE001 - reported redacted, never chained
            raise CheckpointError(self.redact(f"{self.url}: {_describe(exc)}")) from None
        self.root = root.rstrip("/")
        self.lanes = Lanes(self.fs, url, options)
        """Where :meth:`put_file` sends from: one event loop per upload thread."""
        if hasattr(self.fs, "auto_mkdir"):  # a filesystem with directories (file://)
            self.fs.auto_mkdir = True

    def path(self, *parts: str) -> str:
        """The fsspec path of ``parts`` under the root."""
        return "/".join((self.root, *parts))

    def _retried(self, what: str, call: Callable[[], T]) -> T:
        return retried(f"{what} ({self.url})", call, self.redact, self.retries, self.backoff)

    # -- reading ---------------------------------------------------------------------------

    def read_latest(self) -> str | None:
        """The tag ``URL/latest`` names, or ``None``."""

        def read() -> str | None:
            try:
                return bytes(self.fs.cat_file(self.path(layout.LATEST))).decode().strip() or None
            except FileNotFoundError:
                return None

        return self._retried("reading latest", read)

    def manifest(self, tag: str) -> dict[str, Any]:
        """The manifest of published ``tag``; :class:`CheckpointError` if it has none."""
        path = self.path(tag, layout.MANIFEST)

        def read() -> bytes:
            try:
                return bytes(self.fs.cat_file(path))
            except FileNotFoundError:
                raise CheckpointError(f"{self.url} has no published checkpoint {tag!r}") from None

        data = self._retried(f"reading the manifest of {tag!r}", read)
        return parse_manifest(f"{self.url}/{tag}/{layout.MANIFEST}", data)

    def _bucket(self) -> str | None:
        """The bucket (or container) the root lies in, for an object store; else ``None``."""
        if hasattr(self.fs, "auto_mkdir"):  # a filesystem with directories: no buckets
            return None
        return self.root.partition("/")[0] or None

    def _listing(self) -> list[str]:
        """The folders under the root (none for a prefix that holds nothing yet).

        Raises :class:`FileNotFoundError` naming the bucket when it does not exist.
        """
        try:
            entries = self.fs.ls(self.root, detail=True, refresh=True)
        except FileNotFoundError:
            bucket = self._bucket()
            if bucket is not None and bucket != self.root:
                try:
                    self.fs.ls(bucket, refresh=True)
                except FileNotFoundError:
                    raise FileNotFoundError(f"the bucket {bucket!r} does not exist") from None
            elif bucket is not None:
                raise FileNotFoundError(f"the bucket {bucket!r} does not exist") from None
            return []
        return [e["name"].rstrip("/") for e in entries if e.get("type") == "directory"]

    def probe(self) -> None:
        """Check that the remote tier can be listed and written: list the root, then write
        a small object under it and delete it. Raises :class:`CheckpointError` saying which
        step failed and why (a missing bucket, access denied, no credentials: at once)."""
        self._retried("listing the remote tier", self._listing)
        probe = self.path(f"{_PROBE}{uuid.uuid4().hex[:12]}")
        self._retried("writing a probe object", lambda: self.fs.pipe_file(probe, b"aoffload"))
        self._retried("deleting the probe object", lambda: self.fs.rm_file(probe))

    def scan(self, probe: bool = False) -> RemoteScan:
        """Every published tag (a tag is published once its manifest exists) and ``latest``;
        with ``probe``, first check that the tier can be written (:meth:`probe`)."""
        if probe:
            self.probe()
        folders = self._retried("listing the remote tier", self._listing)
        names = [f.rpartition("/")[2] for f in folders]
        tags = [n for n in names if n and not n.startswith(".") and n != layout.LATEST]
        paths = [self.path(tag, layout.MANIFEST) for tag in tags]

        def manifests() -> dict[str, bytes]:
            found = self.fs.cat(paths, on_error="omit") if paths else {}
            return {str(k): bytes(v) for k, v in found.items()}

        found = self._retried("reading the manifests", manifests)
        parsed = {}
        for tag, path in zip(tags, paths, strict=True):
            data = found.get(path) or found.get(self.fs._strip_protocol(path))
            if data is not None:
                parsed[tag] = parse_manifest(f"{self.url}/{tag}/{layout.MANIFEST}", data)
        return RemoteScan(parsed, self.read_latest())

    def fetch(self, tag: str, name: str, entry: Mapping[str, Any], target: str) -> None:
        """Download file ``name`` of ``tag`` to ``target``, verified against ``entry``.

        The file is downloaded beside ``target``, checked (size, xxh3-64), fsynced, then
        renamed into place: ``target`` is either absent or verified.
        """
        partial = f"{target}.part-{uuid.uuid4().hex[:8]}"
        source = self.path(tag, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            self._retried(f"downloading {tag}/{name}", lambda: self.fs.get_file(source, partial))
            try:
                verify_file(Path(partial), entry)
            except CorruptCheckpointError as exc:
                raise CorruptCheckpointError(
                    f"{self.url}/{tag}/{name}: the downloaded file does not match the "
                    f"manifest ({str(exc).partition(': ')[2]})"
                ) from None
            fsync_path(Path(partial))
            os.replace(partial, target)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)

    def hash_remote(self, tag: str, name: str) -> layout.FileEntry:
        """The size and xxh3-64 of remote file ``name`` of ``tag``, streamed (``verify``)."""

        def read() -> layout.FileEntry:
            hasher, size = xxhash.xxh3_64(), 0
            with self.fs.open(self.path(tag, name), "rb", block_size=_BLOCK) as file:
                while block := file.read(_BLOCK):
                    hasher.update(block)
                    size += len(block)
            return layout.FileEntry(size, hasher.hexdigest())

        return self._retried(f"reading {tag}/{name}", read)

    # -- writing ---------------------------------------------------------------------------

    def put_file(self, local: str, tag: str, name: str, nbytes: int) -> None:
        """Upload local file ``local`` as ``name`` of ``tag`` (multipart and concurrent parts
        where the backend has them), on the calling thread's lane (:mod:`.lanes`); checks
        its size against the manifest's first."""
        size = os.path.getsize(local)
        if size != nbytes:
            raise CorruptCheckpointError(
                f"{local}: {size} bytes on disk, the manifest says {nbytes}; not uploaded"
            )
        target = self.path(tag, name)
        self._retried(f"uploading {tag}/{name}", lambda: self.lanes.put_file(local, target))

    def put_text(self, parts: Iterable[str], text: str) -> None:
        """Write a small object (a manifest, ``latest``) in one request."""
        target = self.path(*parts)
        data = text.encode()
        self._retried(f"writing {'/'.join(parts)}", lambda: self.fs.pipe_file(target, data))

    def discard(self, tag: str, names: Iterable[str]) -> None:
        """Remove files ``names`` of an unpublished ``tag``: once each, errors logged only
        (what is left has no manifest: no reader ever sees it)."""
        for name in names:
            try:
                self.fs.rm_file(self.path(tag, name))
            except Exception as exc:  # noqa: BLE001 - best effort; a leftover is harmless
                logger.warning(
                    "could not remove %s/%s of an unpublished upload: %s",
                    tag,
                    name,
                    self.redact(_describe(exc)),
                )

    def remove_tag(self, tag: str) -> None:
        """Remove published ``tag``: its manifest first (it disappears whole), then its files."""
        manifest = self.path(tag, layout.MANIFEST)

        def remove() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(manifest)
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(self.path(tag), recursive=True)

        self._retried(f"removing {tag!r}", remove)
