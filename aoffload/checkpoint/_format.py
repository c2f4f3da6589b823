"""The on-disk format of a checkpoint directory, and every operation on it.

::

    directory/.tmp-<tag>-<id>/<files>        written and fsynced by the writer
    (distributed: one such directory per rank; rank 0 renames the others' files into
    its own, :func:`gather`, once every rank reported them durable)
    directory/<tag>/<files> put there by others (DeepSpeed's NVMe ``offloaded_tensors``)
        are moved in too, hashed and fsynced: they are published with the tag (:func:`adopt`)
    directory/.tmp-<tag>-<id>/.aoffload-manifest.json   sizes + xxh3-64 of every file, last
    rename .tmp-<tag>-<id> -> <tag>, fsync directory    the tag now exists, complete
    latest.tmp -> os.replace -> latest, fsync directory the pointer moves atomically
    rename old tags -> .trash-*, then delete             retention, after the new tag is durable

A crash at any instant leaves ``latest`` naming either the old or the new checkpoint.
Each phase is one synchronous function here (scan, publish, retire, verify), run by the
engine's threads (the commit thread publishes; the load thread reads), never by the event
loop. This module is the format alone: it imports neither torch nor the rest of the engine,
so the command line reads a directory without importing torch.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import mmap
import os
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from .._errors import CheckpointError, CorruptCheckpointError, InvalidStateError
from . import _paths, _untrusted

__all__ = [
    "FORMAT",
    "LATEST",
    "MANIFEST",
    "TMP_PREFIX",
    "TRASH_PREFIX",
    "FileEntry",
    "is_orphan",
    "Scan",
    "adopt",
    "digest",
    "gather",
    "publish",
    "read_latest",
    "read_manifest",
    "remove_tree",
    "retire",
    "scan",
    "validate_name",
    "validate_tag",
    "verify_file",
]

MANIFEST = ".aoffload-manifest.json"
"""The manifest's file name inside a tag directory; written last."""
LATEST = "latest"
"""The file naming the newest committed tag."""
FORMAT = "aoffload-checkpoint/1"
"""The manifest's ``format`` value."""
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
OFFLOADED = "offloaded_tensors"
"""What DeepSpeed's NVMe offload copies into ``<tag>/`` itself (see :func:`adopt`)."""
_VERIFY_BLOCK = 8 << 20
_LATEST_BYTES = 4096

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One file of a checkpoint, as the manifest records it."""

    bytes: int
    xxh3_64: str


# -- names (see _untrusted) -------------------------------------------------------------


def validate_name(name: object) -> str:
    """A file name inside a tag: relative, normalised, not the manifest's (see
    :mod:`._untrusted` for the rules)."""
    return _untrusted.validate_name(name, MANIFEST)


def validate_tag(tag: object, limit: int = _untrusted.MAX_TAG_BYTES) -> str:
    """A tag: one path component, not hidden, not ``latest``, at most ``limit`` UTF-8
    bytes (see :mod:`._untrusted`)."""
    return _untrusted.validate_tag(tag, limit)


# -- small blocking helpers (run on the engine's threads) ---------------------------------


def fsync_path(path: Path) -> None:
    """fsync a file or directory by path."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_tree(path: Path) -> None:
    """Remove the directory tree, file or link at ``path``, if any; a link is removed
    itself, never what it names (:func:`._paths.remove`)."""
    _paths.remove(path)


def write_below(root: Path, relative: str, text: str, durable: bool) -> None:
    """Write ``text`` to ``root/relative`` without following a link below ``root``."""
    fd = _paths.open_file(root, relative, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        with memoryview(text.encode("utf-8")) as data:
            done = 0
            while done < len(data):
                done += os.write(fd, data[done:])
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def _open_untrusted(root: Path, relative: str) -> int:
    """A regular file below ``root``, opened without following a link; a link, a special
    file or a missing file is a :class:`CorruptCheckpointError` naming it."""
    try:
        return _paths.open_regular(root, relative)
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(f"{root / relative}: missing") from exc
    except _paths.UnsafePathError as exc:
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


def _parse_manifest(path: Path, data: bytes) -> dict[str, Any]:
    try:
        manifest = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{path}: the manifest is not valid JSON") from exc
    return _untrusted.check_manifest(path, manifest, FORMAT, MANIFEST)


# -- phases ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Scan:
    """What a directory holds: committed tags (oldest first), their last sequence,
    ``latest``, each tag's commit metadata (a tag committed without any has none here), and
    the tags whose manifest is unreadable (set aside, see :func:`scan`)."""

    tags: list[str]
    sequence: int
    latest: str | None
    metadata: dict[str, dict[str, Any]] = field(default_factory=dict)
    quarantined: tuple[str, ...] = ()


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
    return entries == [OFFLOADED] and _paths.kind(path / OFFLOADED) == "dir"


def _remove_leftover(path: Path) -> None:
    try:
        remove_tree(path)
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
        if entry.startswith(".") or entry == LATEST or _paths.kind(path) != "dir":
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
    return Scan(tags, found[-1][0] if found else 0, latest, metadata, tuple(quarantined))


def _digest_fd(fd: int) -> FileEntry:
    hasher = xxhash.xxh3_64()
    size = 0
    with mmap.mmap(-1, _VERIFY_BLOCK) as block, memoryview(block) as view:
        while n := os.readv(fd, [view]):
            hasher.update(view[:n])
            size += n
    return FileEntry(size, hasher.hexdigest())


def digest(path: Path) -> FileEntry:
    """The size and xxh3-64 of the file at ``path`` (a link is refused), read in blocks."""
    fd = _paths.open_regular(path.parent, path.name)
    try:
        return _digest_fd(fd)
    finally:
        os.close(fd)


def gather(tmpdir: Path, sources: Mapping[Path, list[str]], *, durable: bool) -> None:
    """Rename every rank's files (``sources``: its tmp directory -> its names) into ``tmpdir``.

    Each source directory is removed once empty; its files were durable before (the rank
    reported them so), and the renames are made durable by fsyncing ``tmpdir``'s tree.
    Every directory is a child of the same checkpoint directory; no link is followed.
    """
    directory = tmpdir.parent
    os.close(_paths.open_dir(directory, tmpdir.name, create=True))
    for source, names in sources.items():
        for name in names:
            validate_name(name)
            _paths.rename(directory, f"{source.name}/{name}", directory, f"{tmpdir.name}/{name}")
        remove_tree(source)
    if durable:
        for folder, _, _ in os.walk(tmpdir):
            fsync_path(Path(folder))


def adopt(
    tmpdir: Path, existing: Path, files: Mapping[str, FileEntry], *, durable: bool
) -> dict[str, FileEntry]:
    """Move what others put in the uncommitted ``existing`` tag directory into ``tmpdir``.

    DeepSpeed copies NVMe-offloaded optimizer state into ``save_dir/<tag>/offloaded_tensors``
    itself, around the checkpoint engine; those files are published with the tag: hashed,
    fsynced and listed in the manifest. ``existing`` must be a real directory of this user
    holding only directories and regular files: a link, a file, another user's directory or
    a link inside is refused (:class:`CheckpointError`) before anything moves. A name that
    a rank also saved is a :class:`CheckpointError`. Returns the adopted files' entries.
    """
    adopted: dict[str, FileEntry] = {}
    what = _paths.kind(existing)
    if what == "missing":
        return adopted
    if what != "dir" or os.lstat(existing).st_uid != os.geteuid():
        kind = {"link": "a symbolic link", "dir": "another user's directory"}.get(what, "a file")
        raise _paths.UnsafePathError(
            errno.EEXIST,
            f"exists and is {kind}, not a directory aoffload can publish; nothing was moved. "
            "Remove it or commit under another tag",
            str(existing),
        )
    try:
        names = list(_paths.regular_files(existing))
    except _paths.UnsafePathError as exc:
        raise _paths.UnsafePathError(
            exc.errno,
            f"{exc.strerror}; aoffload publishes only the plain files and directories it "
            "finds in a tag's directory; nothing was moved",
            exc.filename,
        ) from None
    for relative in names:
        if relative in files:
            raise CheckpointError(
                f"{existing / relative} exists already and was also saved through the engine; "
                "remove it or save under another name"
            )
        fd = _paths.open_regular(existing, relative)
        try:
            adopted[relative] = _digest_fd(fd)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
    if durable:
        for folder, _, _ in os.walk(existing):
            fsync_path(Path(folder))
    directory = existing.parent
    for entry in os.listdir(existing):
        if _paths.kind(tmpdir / entry) != "missing":
            # a top-level folder both sides have (`offloaded_tensors` next to saved files)
            for relative in names:
                if relative.startswith(entry + "/"):
                    _paths.rename(
                        directory,
                        f"{existing.name}/{relative}",
                        directory,
                        f"{tmpdir.name}/{relative}",
                    )
            remove_tree(existing / entry)
        else:
            _paths.rename(
                directory, f"{existing.name}/{entry}", directory, f"{tmpdir.name}/{entry}"
            )
    os.rmdir(existing)
    return adopted


def publish(
    tmpdir: Path,
    directory: Path,
    tag: str,
    sequence: int,
    files: Mapping[str, FileEntry],
    *,
    durable: bool,
    latest: bool = True,
    metadata: Mapping[str, Any] | None = None,
) -> dict[str, FileEntry]:
    """Write the manifest last, rename the tag into place, then move ``latest`` (atomically).

    Files already in an uncommitted ``directory/tag`` are published too (:func:`adopt`).
    ``latest=False`` leaves the ``latest`` pointer alone. ``metadata`` (the commit's, JSON)
    is kept in the manifest. A tag that is already committed (its directory has a manifest)
    is never rewritten: :class:`CheckpointError`. Returns every published file. Nothing is
    followed through a link.
    """
    existing = directory / tag
    if _paths.kind(existing) == "dir" and _paths.kind(existing / MANIFEST) != "missing":
        raise _paths.UnsafePathError(
            errno.EEXIST,
            "is a committed checkpoint (it has a manifest), and a committed checkpoint is "
            "never rewritten; commit under a new tag",
            str(existing),
        )
    os.close(_paths.open_dir(directory, tmpdir.name, create=True))
    everything = dict(files)
    everything.update(adopt(tmpdir, existing, files, durable=durable))
    manifest = {
        "format": FORMAT,
        "tag": tag,
        "sequence": sequence,
        "created": time.time(),
        "files": {n: {"bytes": e.bytes, "xxh3_64": e.xxh3_64} for n, e in everything.items()},
    }
    if metadata:
        manifest["metadata"] = dict(metadata)
    write_below(directory, f"{tmpdir.name}/{MANIFEST}", json.dumps(manifest, indent=1), durable)
    if durable:
        fsync_path(tmpdir)
    folder = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.rename(tmpdir.name, tag, src_dir_fd=folder, dst_dir_fd=folder)
        if durable:
            os.fsync(folder)
    finally:
        os.close(folder)
    if latest:
        point_latest(directory, tag, durable=durable)
    return everything


def point_latest(directory: Path, tag: str | None, *, durable: bool) -> None:
    """Make ``latest`` name ``tag`` (atomically, through a temporary), or remove it
    (``None``); neither the pointer nor its temporary is followed if it is a link."""
    folder = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if tag is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(LATEST, dir_fd=folder)
        else:
            pointer = f".{LATEST}.tmp"
            remove_tree(directory / pointer)  # a leftover (or a planted link) goes first
            write_below(directory, pointer, tag + "\n", durable)
            os.replace(pointer, LATEST, src_dir_fd=folder, dst_dir_fd=folder)
        if durable:
            os.fsync(folder)
    finally:
        os.close(folder)


def retire(directory: Path, tag: str, trash_name: str) -> Path:
    """Rename a committed tag out of the listing (so a crash never leaves half a tag listed)."""
    trash = directory / f"{TRASH_PREFIX}{tag}-{trash_name}"
    os.rename(directory / tag, trash)  # renames the entry itself, never a link's target
    return trash


# -- reading ------------------------------------------------------------------------------


def read_manifest(path: Path) -> dict[str, Any]:
    """The parsed manifest at ``path`` (``DIR/<tag>/<manifest>``).

    The tag directory and the manifest are opened without following links. Raises
    ``FileNotFoundError`` when there is none, :class:`CorruptCheckpointError` when it is
    not a well-formed manifest, a link, or over
    :data:`~._untrusted.MAX_MANIFEST_BYTES`.
    """
    root, relative = path.parent.parent, f"{path.parent.name}/{path.name}"
    try:
        fd = _paths.open_regular(root, relative)
    except _paths.UnsafePathError as exc:
        raise CorruptCheckpointError(f"{exc.filename}: {exc.strerror}") from None
    try:
        data = _read_bounded(fd, path, _untrusted.MAX_MANIFEST_BYTES, "a manifest")
    finally:
        os.close(fd)
    return _parse_manifest(path, data)


def read_latest(directory: Path) -> str | None:
    """The tag ``latest`` names, or ``None``; :class:`CorruptCheckpointError` when
    ``latest`` is a link, over 4 KiB, or does not name a valid tag."""
    path = directory / LATEST
    try:
        fd = _paths.open_regular(directory, LATEST)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except _paths.UnsafePathError as exc:
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
            if _digest_fd(fd).xxh3_64 != entry["xxh3_64"]:
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
