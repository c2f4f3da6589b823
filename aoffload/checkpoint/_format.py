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

import json
import mmap
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import xxhash

from .._errors import CheckpointError, CorruptCheckpointError, InvalidStateError

__all__ = [
    "FORMAT",
    "LATEST",
    "MANIFEST",
    "TMP_PREFIX",
    "TRASH_PREFIX",
    "FileEntry",
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
_VERIFY_BLOCK = 8 << 20


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One file of a checkpoint, as the manifest records it."""

    bytes: int
    xxh3_64: str


# -- names -----------------------------------------------------------------------------


def validate_name(name: object) -> str:
    """A file name inside a tag: relative, normalised, not the manifest's."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise InvalidStateError(f"file name {name!r}: must be a non-empty string")
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts:
        raise InvalidStateError(f"file name {name!r}: must be relative and must not contain '..'")
    if str(path) != name or name.endswith("/"):
        raise InvalidStateError(f"file name {name!r}: write it normalised, as {str(path)!r}")
    if path.name == MANIFEST:
        raise InvalidStateError(f"file name {name!r} is reserved for the manifest")
    return name


def validate_tag(tag: object) -> str:
    """A tag: one path component, not hidden, not ``latest``."""
    if not isinstance(tag, str) or not tag or "/" in tag or "\0" in tag:
        raise InvalidStateError(f"tag {tag!r}: must be a non-empty string without '/'")
    if tag.startswith(".") or tag == LATEST:
        raise InvalidStateError(f"tag {tag!r}: must not start with '.' nor be {LATEST!r}")
    return tag


# -- small blocking helpers (run on the engine's I/O thread) -----------------------------


def fsync_path(path: Path) -> None:
    """fsync a file or directory by path."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_tree(path: Path) -> None:
    """Remove a directory tree or a file, if it exists."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def write_text(path: Path, text: str, durable: bool) -> None:
    with open(path, "w", encoding="utf-8") as file:
        file.write(text)
        file.flush()
        if durable:
            os.fsync(file.fileno())


def _parse_manifest(path: Path, text: str) -> dict[str, Any]:
    try:
        manifest = json.loads(text)
    except ValueError as exc:
        raise CorruptCheckpointError(f"{path}: the manifest is not valid JSON") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{path}: not an aoffload manifest ({FORMAT})")
    return manifest


# -- phases ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Scan:
    """What a directory holds: committed tags (oldest first), their last sequence, ``latest``,
    and each tag's commit metadata (a tag committed without any has none here)."""

    tags: list[str]
    sequence: int
    latest: str | None
    metadata: dict[str, dict[str, Any]] = field(default_factory=dict)


def scan(directory: Path, *, clean: bool) -> Scan:
    """Read the committed tags; with ``clean``, remove leftovers of interrupted runs."""
    if not directory.is_dir():
        return Scan([], 0, None)
    found: list[tuple[int, str]] = []
    metadata: dict[str, dict[str, Any]] = {}
    for entry in os.listdir(directory):
        path = directory / entry
        if entry.startswith((TMP_PREFIX, TRASH_PREFIX)):
            if clean:
                remove_tree(path)
            continue
        manifest_path = path / MANIFEST
        if entry.startswith(".") or not manifest_path.is_file():
            continue
        manifest = _parse_manifest(manifest_path, manifest_path.read_text(encoding="utf-8"))
        found.append((int(manifest["sequence"]), entry))
        if manifest.get("metadata"):
            metadata[entry] = manifest["metadata"]
    found.sort()
    tags = [tag for _, tag in found]
    return Scan(tags, found[-1][0] if found else 0, read_latest(directory), metadata)


def digest(path: Path) -> FileEntry:
    """The size and xxh3-64 of the file at ``path``, read in blocks (see :func:`verify_file`)."""
    with open(path, "rb", buffering=0) as file:
        hasher = xxhash.xxh3_64()
        size = 0
        with mmap.mmap(-1, _VERIFY_BLOCK) as block, memoryview(block) as view:
            while n := file.readinto(view):
                hasher.update(view[:n])
                size += n
    return FileEntry(size, hasher.hexdigest())


def _sync_tree(root: Path) -> None:
    for folder, _, names in os.walk(root):
        for name in names:
            fsync_path(Path(folder) / name)
        fsync_path(Path(folder))


def gather(tmpdir: Path, sources: Mapping[Path, list[str]], *, durable: bool) -> None:
    """Rename every rank's files (``sources``: its tmp directory -> its names) into ``tmpdir``.

    Each source directory is removed once empty; its files were durable before (the rank
    reported them so), and the renames are made durable by fsyncing ``tmpdir``'s tree.
    """
    tmpdir.mkdir(exist_ok=True)
    for source, names in sources.items():
        for name in names:
            target = tmpdir / name
            target.parent.mkdir(parents=True, exist_ok=True)
            os.rename(source / name, target)
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
    fsynced and listed in the manifest. A name that a rank also saved is a
    :class:`CheckpointError`. Returns the adopted files' entries.
    """
    adopted: dict[str, FileEntry] = {}
    if not existing.is_dir():
        return adopted
    for folder, _, names in os.walk(existing):
        for name in names:
            path = Path(folder) / name
            relative = path.relative_to(existing).as_posix()
            if relative in files:
                raise CheckpointError(
                    f"{path} exists already and was also saved through the engine; "
                    "remove it or save under another name"
                )
            adopted[relative] = digest(path)
    if durable:
        _sync_tree(existing)
    for entry in os.listdir(existing):
        if (tmpdir / entry).exists():
            # a top-level folder both sides have (`offloaded_tensors` next to saved files)
            for folder, _, names in os.walk(existing / entry):
                for name in names:
                    target = tmpdir / (Path(folder) / name).relative_to(existing)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    os.rename(Path(folder) / name, target)
            remove_tree(existing / entry)
        else:
            os.rename(existing / entry, tmpdir / entry)
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
    is kept in the manifest. Returns every published file.
    """
    tmpdir.mkdir(exist_ok=True)
    everything = dict(files)
    everything.update(adopt(tmpdir, directory / tag, files, durable=durable))
    manifest = {
        "format": FORMAT,
        "tag": tag,
        "sequence": sequence,
        "created": time.time(),
        "files": {n: {"bytes": e.bytes, "xxh3_64": e.xxh3_64} for n, e in everything.items()},
    }
    if metadata:
        manifest["metadata"] = dict(metadata)
    write_text(tmpdir / MANIFEST, json.dumps(manifest, indent=1), durable)
    if durable:
        fsync_path(tmpdir)
    os.rename(tmpdir, directory / tag)
    if durable:
        fsync_path(directory)
    if latest:
        pointer = directory / f".{LATEST}.tmp"
        write_text(pointer, tag + "\n", durable)
        os.replace(pointer, directory / LATEST)
        if durable:
            fsync_path(directory)
    return everything


def retire(directory: Path, tag: str, trash_name: str) -> Path:
    """Rename a committed tag out of the listing (so a crash never leaves half a tag listed)."""
    trash = directory / f"{TRASH_PREFIX}{tag}-{trash_name}"
    os.rename(directory / tag, trash)
    return trash


# -- reading ------------------------------------------------------------------------------


def read_manifest(path: Path) -> dict[str, Any]:
    """The parsed manifest at ``path``; :class:`CorruptCheckpointError` if it is not one."""
    return _parse_manifest(path, path.read_text(encoding="utf-8"))


def read_latest(directory: Path) -> str | None:
    """The tag ``latest`` names, or ``None``."""
    try:
        return (directory / LATEST).read_text(encoding="utf-8").strip() or None
    except FileNotFoundError:
        return None


def verify_file(path: Path, entry: Mapping[str, Any]) -> None:
    """Check ``path`` against its manifest entry (size, xxh3-64), reading it in blocks.

    The blocks go into one anonymous mapping, so neither the reads nor the hashing hold
    the GIL for long, whatever the file's size.
    """
    try:
        with open(path, "rb", buffering=0) as file:
            size = os.fstat(file.fileno()).st_size
            if size != entry["bytes"]:
                raise CorruptCheckpointError(
                    f"{path}: {size} bytes on disk, the manifest says {entry['bytes']}"
                )
            digest = xxhash.xxh3_64()
            with mmap.mmap(-1, _VERIFY_BLOCK) as block, memoryview(block) as view:
                while n := file.readinto(view):
                    digest.update(view[:n])
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(f"{path}: listed in the manifest but missing") from exc
    if digest.hexdigest() != entry["xxh3_64"]:
        raise CorruptCheckpointError(f"{path}: checksum mismatch (xxh3-64); the file is corrupt")
