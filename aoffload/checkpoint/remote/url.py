"""Reading a remote tier without an engine: :func:`~aoffload.load_checkpoint` and
:func:`~aoffload.load_metadata` of a URL.

An uploader started for the call lists the remote tier, then downloads the file, verified
against the remote manifest, into a temporary directory that is removed once the file is
loaded (its tensors map the file, which outlives its name). Everything here blocks: it
runs on a thread of its own.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..._errors import CheckpointError
from ..core.load import MapLocation, load_file
from ..format import layout
from .uploader import CACHE, Uploader
from .worker.calls import RemoteScan, UploaderConfig, redact_url

__all__ = ["RemoteTag", "load_url", "metadata_url"]

_SECONDS = 120.0


@contextmanager
def _uploader(
    scratch: str, url: str, storage_options: Mapping[str, Any] | None
) -> Iterator[Uploader]:
    """An uploader for ``url``, working in ``scratch``; stopped on leaving."""
    config = UploaderConfig(url, dict(storage_options or {}))
    uploader = Uploader(Path(scratch), config, redact_url(url), _SECONDS)
    uploader.spawn()
    try:
        yield uploader
    finally:
        uploader.close()


def _published(uploader: Uploader, tag: str | None) -> tuple[str, RemoteScan]:
    """Published ``tag`` (default: the one ``latest`` names) and the remote tier's scan."""
    scan = uploader.join(_SECONDS)
    tags = scan.tags()
    tag = tag if tag is not None else (scan.latest if scan.latest in tags else None)
    if tag is None:
        raise CheckpointError(f"{uploader.url} holds no published checkpoint")
    tag = layout.validate_tag(tag)
    if tag not in tags:
        known = ", ".join(tags) or "none"
        raise CheckpointError(
            f"{uploader.url} has no published checkpoint {tag!r} (it has: {known})"
        )
    return tag, scan


def load_url(
    url: str,
    name: str,
    tag: str | None,
    storage_options: Mapping[str, Any] | None,
    map_location: MapLocation,
    verify: bool,
    weights_only: bool = True,
) -> Any:
    """Load file ``name`` of published ``tag`` (default: ``latest``) of ``url`` (blocking).

    A file just downloaded was verified on its way in: it is not hashed twice.
    """
    name = layout.validate_name(name)
    with tempfile.TemporaryDirectory(prefix="aoffload-load-") as scratch:
        with _uploader(scratch, url, storage_options) as uploader:
            tag, _ = _published(uploader, tag)
            root, fresh = uploader.source(name, tag)
        return load_file(
            root, name, tag, map_location, verify and not fresh, weights_only=weights_only
        )


def metadata_url(
    url: str, tag: str | None, storage_options: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The metadata of published ``tag`` (default: ``latest``) of ``url`` (blocking)."""
    with (
        tempfile.TemporaryDirectory(prefix="aoffload-load-") as scratch,
        _uploader(scratch, url, storage_options) as uploader,
    ):
        tag, scan = _published(uploader, tag)
    return dict(scan.manifests[tag].get("metadata") or {})


class RemoteTag:
    """One published tag of ``url`` (default: the one ``latest`` names), whose files are
    downloaded when asked for (verified against the remote manifest) into a scratch
    directory laid out as a checkpoint directory (``root``, holding ``tag`` and its
    manifest): what ``aoffload.dcp.StorageReader`` reads a remote tier through. An
    uploader runs until :meth:`close`, which also removes the scratch directory."""

    def __init__(self, url: str, tag: str | None, storage_options: Mapping[str, Any] | None):
        self._scratch = tempfile.mkdtemp(prefix="aoffload-remote-")
        self.root = Path(self._scratch) / CACHE
        config = UploaderConfig(url, dict(storage_options or {}))
        self._uploader = Uploader(Path(self._scratch), config, redact_url(url), _SECONDS)
        try:
            self._uploader.spawn()
            self.tag, _ = _published(self._uploader, tag)
        except BaseException:
            self.close()
            raise

    def fetch(self, name: str) -> None:
        """Download file ``name`` of the tag into ``root`` (once; blocking)."""
        self._uploader.source(layout.validate_name(name), self.tag)

    def close(self) -> None:
        """Stop the uploader, remove the downloads. Idempotent."""
        try:
            self._uploader.close()
        finally:
            shutil.rmtree(self._scratch, ignore_errors=True)
