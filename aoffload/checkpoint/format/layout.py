"""What a checkpoint directory holds, and the rules for what reaches it from outside.

::

    directory/<tag>/<files>                     a committed checkpoint (its files)
    directory/<tag>/.aoffload-manifest.json     sizes + xxh3-64 of every file, written last
    directory/latest                            names the newest committed tag
    directory/.tmp-<tag>-<id>/                  a tag being written (a crash's leftover)
    directory/.trash-<tag>-<id>/                a retired tag being deleted

Tags and file names come from the caller; manifests and ``latest`` come from a directory
that may have been prepared by someone else. Everything is checked before it is used as
a path or trusted as a number:

* a tag is one path component, not hidden, not ``latest``, without control characters or
  whitespace at either end, UTF-8, and short enough that its temporary name
  (``.tmp-<tag>-<id>``) and its retired name (``.trash-<tag>-<id>``) fit the filesystem's
  name limit (:data:`MAX_TAG_BYTES` on the usual 255-byte limit);
* a file name is relative and normalised, each component held to the same rules;
* a manifest is at most :data:`MAX_MANIFEST_BYTES`, JSON of the expected shape, and every
  file it names passes the file-name rules (so ``../../x`` is never opened).

Pure Python, no torch: the command line uses it without importing torch.
"""

from __future__ import annotations

import mmap
import os
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, TypeGuard

import xxhash

from ..._errors import CorruptCheckpointError, InvalidStateError

__all__ = [
    "FORMAT",
    "LATEST",
    "MANIFEST",
    "MAX_MANIFEST_BYTES",
    "MAX_NAME_BYTES",
    "MAX_TAG_BYTES",
    "OFFLOADED",
    "TMP_PREFIX",
    "TRASH_PREFIX",
    "FileEntry",
    "Scan",
    "check_manifest",
    "is_url",
    "tag_limit",
    "validate_name",
    "validate_tag",
]

MANIFEST = ".aoffload-manifest.json"
"""The manifest's file name inside a tag directory; written last."""
LATEST = "latest"
"""The file naming the newest committed tag."""
FORMAT = "aoffload-checkpoint/1"
"""The manifest's ``format`` value."""
TMP_PREFIX = ".tmp-"
"""How the name of a tag being written (or a file being uploaded early) begins."""
TRASH_PREFIX = ".trash-"
"""How the name of a retired tag being deleted begins."""
OFFLOADED = "offloaded_tensors"
"""What DeepSpeed's NVMe offload copies into ``<tag>/`` itself (see ``write.adopt``)."""
_HASH_BLOCK = 8 << 20

MAX_NAME_BYTES = 255
"""The usual filesystem limit on one path component (``NAME_MAX``)."""
_SUFFIX_BYTES = len(".trash-") + 1 + 8  # the longest name a tag gets: .trash-<tag>-<8 hex>
MAX_TAG_BYTES = MAX_NAME_BYTES - _SUFFIX_BYTES
"""The longest tag, in UTF-8 bytes, on a filesystem with 255-byte names (239)."""
MAX_MANIFEST_BYTES = 16 << 20
"""The largest manifest read (about 150,000 files); a larger one is corrupt."""
_HEX64 = re.compile(r"[0-9a-f]{16}")


def is_url(location: object) -> TypeGuard[str]:
    """Whether ``location`` names a remote tier (``protocol://...``), not a local path."""
    return isinstance(location, str) and "://" in location


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One file of a checkpoint, as the manifest records it."""

    bytes: int
    xxh3_64: str

    @classmethod
    def of(cls, fd: int) -> FileEntry:
        """The entry of the file open at ``fd``, read from its offset to its end in blocks
        into one anonymous mapping (neither the reads nor the hashing hold the GIL long)."""
        hasher = xxhash.xxh3_64()
        size = 0
        with mmap.mmap(-1, _HASH_BLOCK) as block, memoryview(block) as view:
            while n := os.readv(fd, [view]):
                hasher.update(view[:n])
                size += n
        return cls(size, hasher.hexdigest())


@dataclass(frozen=True, slots=True)
class Scan:
    """What a directory (or a remote tier) holds: committed tags (oldest first), the last
    sequence, ``latest``, each tag's commit metadata (a tag committed without any has none
    here), the tags whose manifest is unreadable (set aside, see ``read.scan``), and each
    tag's sequence number."""

    tags: list[str]
    sequence: int
    latest: str | None
    metadata: dict[str, dict[str, Any]] = field(default_factory=dict)
    quarantined: tuple[str, ...] = ()
    sequences: dict[str, int] = field(default_factory=dict)


def tag_limit(directory: Path) -> int:
    """The longest tag, in UTF-8 bytes, that ``directory``'s filesystem can hold."""
    try:
        name_max = os.pathconf(directory, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = MAX_NAME_BYTES
    return max(1, min(name_max, MAX_NAME_BYTES) - _SUFFIX_BYTES)


def _check_text(what: str, whole: object, text: str, limit: int) -> None:
    if not text:
        raise InvalidStateError(f"{what} {whole!r}: must not be empty")
    if text != text.strip():
        raise InvalidStateError(f"{what} {whole!r}: must not begin or end with whitespace")
    bad = next((c for c in text if unicodedata.category(c) == "Cc"), None)
    if bad is not None:
        raise InvalidStateError(f"{what} {whole!r}: must not contain control characters ({bad!r})")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidStateError(f"{what} {whole!r}: must be valid Unicode ({exc.reason})") from None
    if size > limit:
        raise InvalidStateError(
            f"{what} {whole!r}: {size} bytes in UTF-8, over the limit of {limit} here "
            "(the filesystem's name limit, less the room its temporary and retired names need)"
        )


def validate_tag(tag: object, limit: int = MAX_TAG_BYTES) -> str:
    """A tag: one path component, not hidden, not ``latest``, at most ``limit`` UTF-8 bytes."""
    if not isinstance(tag, str) or not tag or "/" in tag:
        raise InvalidStateError(f"tag {tag!r}: must be a non-empty string without '/'")
    if tag.startswith(".") or tag == LATEST:
        raise InvalidStateError(f"tag {tag!r}: must not start with '.' nor be 'latest'")
    _check_text("tag", tag, tag, limit)
    return tag


def validate_name(name: object) -> str:
    """A file name inside a tag: relative, normalised, each component a valid name, not
    the manifest's."""
    if not isinstance(name, str) or not name:
        raise InvalidStateError(f"file name {name!r}: must be a non-empty string")
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts:
        raise InvalidStateError(f"file name {name!r}: must be relative and must not contain '..'")
    if str(path) != name or name.endswith("/"):
        raise InvalidStateError(f"file name {name!r}: write it normalised, as {str(path)!r}")
    for part in path.parts:
        _check_text("file name", name, part, MAX_NAME_BYTES)
    if path.name == MANIFEST:
        raise InvalidStateError(f"file name {name!r} is reserved for the manifest")
    return name


def check_manifest(path: Path | str, manifest: Any) -> dict[str, Any]:
    """``manifest`` (parsed JSON) if it has the shape of one; else
    :class:`CorruptCheckpointError` naming ``path`` and what is wrong."""

    def corrupt(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{path}: {why}")

    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise corrupt(f"not an aoffload manifest ({FORMAT})")
    sequence = manifest.get("sequence")
    if type(sequence) is not int or sequence < 0:
        raise corrupt(f"the manifest's sequence is {sequence!r}, not a number >= 0")
    created = manifest.get("created")
    if created is not None and type(created) not in (int, float):
        raise corrupt(f"the manifest's creation time is {created!r}, not a number")
    metadata = manifest.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise corrupt(f"the manifest's metadata is {type(metadata).__name__}, not an object")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise corrupt("the manifest lists no files")
    for name, entry in files.items():
        try:
            validate_name(name)
        except InvalidStateError as exc:
            raise corrupt(f"the manifest names a file that cannot be in the tag: {exc}") from None
        if (
            not isinstance(entry, dict)
            or type(entry.get("bytes")) is not int
            or entry["bytes"] < 0
            or not isinstance(entry.get("xxh3_64"), str)
            or not _HEX64.fullmatch(entry["xxh3_64"])
        ):
            raise corrupt(f"the manifest's entry for {name!r} is not {{bytes, xxh3_64}}: {entry!r}")
    return manifest
