"""Which directory a DCP load reads, and its files opened safely (and verified, when it can).

A location is one of:

* an aoffload checkpoint directory: its ``latest`` tag, or the ``tag`` asked for; each file
  is checked against the tag's manifest (size and xxh3-64) before it is read;
* one committed tag directory of it (``DIR/<tag>``, holding the manifest);
* a plain DCP checkpoint directory (a ``.metadata`` and no manifest): read without
  verification, which is logged at WARNING, naming the directory.

A tag directory that an aoffload directory holds without a manifest is a save that never
committed: it is refused, whatever it holds. Every file DCP's metadata names must be a
plain name inside the checkpoint's directory, and no link is followed to it.

This module is the dcp package's one reader of aoffload's on-disk format
(:mod:`aoffload.checkpoint.format`).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from .._errors import CheckpointError, CorruptCheckpointError
from ..checkpoint.format import layout, read

__all__ = ["METADATA", "Checkpoint", "locate"]

logger = logging.getLogger(__name__)

METADATA = ".metadata"
"""DCP's metadata file in a checkpoint directory (``FileSystemWriter`` writes it last)."""
_PLAIN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class Checkpoint:
    """One DCP checkpoint directory, as located: ``root / relative`` is the directory,
    ``files`` the manifest's entries (``None``: a plain DCP directory, not verified)."""

    root: Path
    relative: str
    files: Mapping[str, Mapping[str, Any]] | None

    @property
    def path(self) -> Path:
        """The checkpoint's directory."""
        return self.root / self.relative if self.relative else self.root

    @property
    def verified(self) -> bool:
        """Whether its files are checked against a manifest."""
        return self.files is not None

    def open(self, name: str) -> int:
        """A descriptor of the file ``name`` (a plain name in the checkpoint's directory),
        at offset 0, for the caller to close. In an aoffload tag the file has been checked
        against the manifest through this very descriptor; a mismatch, a missing file or a
        name the manifest lacks is a :class:`CorruptCheckpointError` naming the file."""
        path = self.path / _plain(name, self.path)
        if self.files is None:
            return _open_plain(self.path, name)
        entry = self.files.get(name)
        if entry is None:
            raise CorruptCheckpointError(
                f"{path}: DCP's metadata names this file but the tag's manifest does not list it"
            )
        relative = f"{self.relative}/{name}" if self.relative else name
        return read.open_verified(self.root, relative, entry, True)

    def read(self, name: str, limit: int) -> bytes:
        """The whole file ``name``, at most ``limit`` bytes, checked against the manifest
        in memory (the bytes returned are the bytes hashed)."""
        path = self.path / _plain(name, self.path)
        entry = None if self.files is None else self.files.get(name)
        if self.files is None:
            fd = _open_plain(self.path, name)
        elif entry is None:
            raise CorruptCheckpointError(f"{path}: the tag's manifest does not list it")
        else:
            relative = f"{self.relative}/{name}" if self.relative else name
            fd = read.open_verified(self.root, relative, entry, False)
        try:
            size = os.fstat(fd).st_size
            if size > limit:
                raise CorruptCheckpointError(f"{path}: {size} bytes, over the limit of {limit}")
            data = _read_all(fd, size)
        finally:
            os.close(fd)
        if entry is not None and xxhash.xxh3_64_hexdigest(data) != entry["xxh3_64"]:
            raise CorruptCheckpointError(
                f"{path}: checksum mismatch (xxh3-64); the file is corrupt"
            )
        return data


def _read_all(fd: int, size: int) -> bytes:
    data = bytearray(size)
    view = memoryview(data)
    done = 0
    while done < size and (n := os.readv(fd, [view[done:]])):
        done += n
    return bytes(view[:done])


def _plain(name: object, directory: Path) -> str:
    if (
        not isinstance(name, str)
        or name in ("", ".", "..")
        or "/" in name
        or "\\" in name
        or "\0" in name
    ):
        raise CorruptCheckpointError(
            f"{directory}: DCP's metadata names {name!r}, which is not a file name in the "
            "checkpoint's directory"
        )
    return name


def _open_plain(directory: Path, name: str) -> int:
    path = directory / name
    try:
        fd = os.open(path, _PLAIN_FLAGS)
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(f"{path}: missing") from exc
    except OSError as exc:
        raise CorruptCheckpointError(f"{path}: cannot be opened ({exc.strerror})") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptCheckpointError(f"{path}: not a regular file")
    return fd


def _committed(root: Path, tag: str) -> Checkpoint:
    layout.validate_tag(tag)
    try:
        manifest = read.read_manifest(root / tag / layout.MANIFEST)
    except FileNotFoundError:
        raise CheckpointError(
            f"{root / tag} is not a committed checkpoint of {root} (it has no manifest: a save "
            "that did not finish?); load a committed tag, or the directory's latest"
        ) from None
    files = manifest["files"]
    if METADATA not in files:
        raise CheckpointError(
            f"{root / tag} was not saved through DCP (its manifest lists no {METADATA}); "
            "load its files with aoffload.load_checkpoint"
        )
    return Checkpoint(root, tag, files)


def locate(location: Path, tag: str | None) -> Checkpoint:
    """The checkpoint ``location`` (and ``tag``) names (see the module)."""
    if not location.is_dir():
        raise CheckpointError(f"{location}: no such checkpoint directory")
    if tag is not None:
        return _committed(location, tag)
    if os.path.lexists(location / layout.MANIFEST):
        return _committed(location.parent, location.name)
    latest = read.read_latest(location)
    if latest is not None:
        return _committed(location, latest)
    if os.path.lexists(location.parent / layout.LATEST):
        raise CheckpointError(
            f"{location} is in the aoffload checkpoint directory {location.parent} but was "
            "never committed there (it has no manifest: a save that did not finish?); load "
            "a committed tag, or the directory's latest"
        )
    if os.path.lexists(location / METADATA):
        logger.warning(
            "%s is a plain DCP checkpoint (no aoffload manifest): its files are read "
            "without verification",
            location,
        )
        return Checkpoint(location, "", None)
    raise CheckpointError(
        f"{location} holds no checkpoint: no aoffload 'latest', no manifest and no DCP {METADATA}"
    )
