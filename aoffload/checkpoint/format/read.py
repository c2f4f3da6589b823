"""Reading a checkpoint directory: manifests, ``latest``, verified files, the scan at start.

Every call blocks and runs on the engine's threads (the load thread, the start), or in the
command line; never on the event loop. The directory is untrusted (see :mod:`.layout`):
nothing is followed through a link below it, and a manifest is checked before anything it
names is opened. No torch here.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ... import _paths as paths
from ..._errors import CheckpointError, CorruptCheckpointError, InvalidStateError
from .layout import (
    LATEST,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    OFFLOADED,
    TMP_PREFIX,
    TRASH_PREFIX,
    FileEntry,
    Scan,
    check_manifest,
    validate_tag,
)

__all__ = [
    "digest",
    "find_tag",
    "is_orphan",
    "latest_bytes",
    "open_verified",
    "parse_manifest",
    "read_latest",
    "read_manifest",
    "scan",
    "verify_file",
]

_LATEST_BYTES = 4096

logger = logging.getLogger(__name__)


def _open_untrusted(root: Path, relative: str) -> int:
    """A regular file below ``root``, opened without following a link; a link, a special
    file or a missing file is a :class:`CorruptCheckpointError` naming it."""
    try:
        return paths.open_regular(root, relative)
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(f"{root / relative}: missing") from exc
    except paths.UnsafePathError as exc:
        raise CorruptCheckpointError(f"{exc.filename}: {exc.strerror}") from None


def _read_bounded(fd: int, path: Path, limit: int, what: str) -> bytes:
    size = os.fstat(fd).st_size
    if size > limit:
        raise CorruptCheckpointError(f"{path}: {size} bytes, over the limit of {limit} for {what}")
    data = bytearray()
    while chunk := os.read(fd, limit + 1 - len(data)):
        data += chunk
        if len(data) > limit:
            raise CorruptCheckpointError(f"{path}: over the limit of {limit} bytes for {what}")
    return bytes(data)


def parse_manifest(path: Path | str, data: bytes) -> dict[str, Any]:
    """The manifest in ``data`` (read from ``path``: a file, or a remote object) if it has
    the shape of one; else :class:`CorruptCheckpointError` naming ``path``."""
    try:
        manifest = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{path}: the manifest is not valid JSON") from exc
    return check_manifest(path, manifest)


# -- reading -------------------------------------------------------------------------


def read_manifest(path: Path) -> dict[str, Any]:
    """The parsed manifest at ``path`` (``DIR/<tag>/<manifest>``).

    The tag directory and the manifest are opened without following links. Raises
    ``FileNotFoundError`` when there is none, :class:`CorruptCheckpointError` when it is
    not a well-formed manifest, a link, or over
    :data:`~.MAX_MANIFEST_BYTES`.
    """
    root, relative = path.parent.parent, f"{path.parent.name}/{path.name}"
    try:
        fd = paths.open_regular(root, relative)
    except paths.UnsafePathError as exc:
        raise CorruptCheckpointError(f"{exc.filename}: {exc.strerror}") from None
    try:
        data = _read_bounded(fd, path, MAX_MANIFEST_BYTES, "a manifest")
    finally:
        os.close(fd)
    return parse_manifest(path, data)


def read_latest(directory: Path) -> str | None:
    """The tag ``latest`` names, or ``None``; :class:`CorruptCheckpointError` when
    ``latest`` is a link, over 4 KiB, or does not name a valid tag."""
    path = directory / LATEST
    try:
        fd = paths.open_regular(directory, LATEST)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except paths.UnsafePathError as exc:
        raise CorruptCheckpointError(f"{exc.filename}: {exc.strerror}") from None
    try:
        data = _read_bounded(fd, path, _LATEST_BYTES, f"{LATEST!r}")
    finally:
        os.close(fd)
    try:
        tag = data.decode("utf-8").strip()
        return validate_tag(tag) if tag else None
    except (UnicodeDecodeError, InvalidStateError) as exc:
        raise CorruptCheckpointError(f"{path} does not name a checkpoint: {exc}") from None


def find_tag(directory: Path, tag: str | None) -> tuple[str, dict[str, Any]]:
    """Committed ``tag`` (default: the one ``latest`` names) and its manifest (blocking)."""
    if tag is None:
        tag = read_latest(directory)
        if tag is None:
            raise CheckpointError(f"{directory} holds no committed checkpoint (no {LATEST!r})")
    tag = validate_tag(tag)
    try:
        return tag, read_manifest(directory / tag / MANIFEST)
    except FileNotFoundError as exc:
        raise CheckpointError(f"{directory} has no committed checkpoint {tag!r}") from exc


def open_verified(root: Path, relative: str, entry: Mapping[str, Any], verify: bool) -> int:
    """``root/relative``, opened without following a link and (with ``verify``) checked
    against its manifest ``entry``: the descriptor, at offset 0, for the caller to close.

    Whatever reads the descriptor afterwards reads the very file that was checked.
    """
    path = root / relative
    fd = _open_untrusted(root, relative)
    try:
        size = os.fstat(fd).st_size
        if size != entry["bytes"]:
            raise CorruptCheckpointError(
                f"{path}: {size} bytes on disk, the manifest says {entry['bytes']}"
            )
        if verify:
            if FileEntry.of(fd).xxh3_64 != entry["xxh3_64"]:
                raise CorruptCheckpointError(
                    f"{path}: checksum mismatch (xxh3-64); the file is corrupt"
                )
            os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def verify_file(path: Path, entry: Mapping[str, Any], *, root: Path | None = None) -> None:
    """Check ``path`` against its manifest entry (size, xxh3-64), reading it in blocks.

    With ``root``, no link is followed below it; without, the file itself must not be a
    link. The blocks go into one anonymous mapping, so neither the reads nor the hashing
    hold the GIL for long, whatever the file's size.
    """
    if root is None:
        root = path.parent
    os.close(open_verified(root, path.relative_to(root).as_posix(), entry, True))


def latest_bytes(directory: Path, found: Scan) -> int:
    """The size of the checkpoint ``found`` says ``latest`` names (0: none, or unreadable)."""
    if found.latest is None or found.latest not in found.tags:
        return 0
    try:
        manifest = read_manifest(directory / found.latest / MANIFEST)
    except (OSError, CheckpointError):
        return 0
    return sum(entry["bytes"] for entry in manifest["files"].values())


def digest(path: Path) -> FileEntry:
    """The size and xxh3-64 of the file at ``path`` (a link is refused), read in blocks."""
    fd = paths.open_regular(path.parent, path.name)
    try:
        return FileEntry.of(fd)
    finally:
        os.close(fd)


# -- the scan at start ------------------------------------------------------------------


def is_orphan(path: Path) -> bool:
    """Whether ``path`` is a tag directory that a crashed run left: no manifest, nothing
    in it but the NVMe offload copies DeepSpeed puts there (``offloaded_tensors/``), and
    owned by this user. Links are never orphans."""
    try:
        info = os.lstat(path)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            return False
        entries = os.listdir(path)
    except OSError:
        return False
    return entries == [OFFLOADED] and paths.kind(path / OFFLOADED) == "dir"


def _remove_leftover(path: Path) -> None:
    try:
        paths.remove(path)
    except OSError as exc:
        logger.warning("could not remove %s, left by an interrupted run: %s", path, exc)


def scan(directory: Path, *, clean: bool) -> Scan:
    """Read the committed tags; with ``clean``, remove leftovers of interrupted runs.

    Leftovers are temporary and retired tags and tag directories a crashed run left
    without a manifest (:func:`is_orphan`); a link among them is removed itself. A tag
    whose manifest is unreadable, malformed or too large is *quarantined*: logged at
    WARNING, left in place, and neither listed, loaded nor retired. Links and files
    that are not tags are ignored. A bad ``latest`` is logged and ignored.
    """
    if not directory.is_dir():
        return Scan([], 0, None)
    found: list[tuple[int, str]] = []
    quarantined: list[str] = []
    metadata: dict[str, dict[str, Any]] = {}
    for entry in sorted(os.listdir(directory)):
        path = directory / entry
        if entry.startswith((TMP_PREFIX, TRASH_PREFIX)):
            if clean:
                _remove_leftover(path)
            continue
        if entry.startswith(".") or entry == LATEST or paths.kind(path) != "dir":
            continue
        try:
            validate_tag(entry)
            manifest = read_manifest(path / MANIFEST)
        except InvalidStateError:
            continue  # not a name aoffload gives a tag
        except FileNotFoundError:
            if clean and is_orphan(path):
                logger.info("removing %s, left without a manifest by an interrupted run", path)
                _remove_leftover(path)
            continue
        except (CorruptCheckpointError, OSError) as exc:
            logger.warning(
                "checkpoint %r in %s is quarantined, its manifest is unusable (%s): it is "
                "not listed, loaded nor retired; repair or remove it",
                entry,
                directory,
                exc,
            )
            quarantined.append(entry)
            continue
        found.append((manifest["sequence"], entry))
        if manifest.get("metadata"):
            metadata[entry] = manifest["metadata"]
    found.sort()
    try:
        latest = read_latest(directory)
    except CorruptCheckpointError as exc:
        logger.warning("ignoring %s: %s", directory / LATEST, exc)
        latest = None
    tags = [tag for _, tag in found]
    last = found[-1][0] if found else 0
    sequences = {tag: sequence for sequence, tag in found}
    return Scan(tags, last, latest, metadata, tuple(quarantined), sequences)
