"""Reading a checkpoint directory without an engine: what ``python -m aoffload`` reports.

Everything here reads the format (:mod:`.layout`, :mod:`.read`: its constants, manifests
and :func:`~.read.verify_file`); :func:`clean` is the one writer, and it takes the
directory lock (:mod:`.lock`) exclusive, so it never touches a live engine's files.
The directory is untrusted: manifests are checked (:mod:`.layout`) before anything
they name is opened, nothing is followed through a link, and a file is verified before
``inspect`` loads it.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ... import _paths
from ..._errors import CheckpointError, CorruptCheckpointError
from . import layout, read, write
from . import lock as _lock
from . import shm as _shm

__all__ = [
    "NESTED",
    "FileCheck",
    "FileSummary",
    "TagInfo",
    "clean",
    "inspect_tag",
    "leftovers",
    "list_tags",
    "locate",
    "pick",
    "resolve_tags",
    "summarise",
    "verify_each",
    "verify_tags",
]

_LATEST_TMP = f".{layout.LATEST}.tmp"  # the pointer being replaced (see write.publish)

NESTED = ".aoffload"
"""The checkpoint directory ``aoffload.lightning.AsyncCheckpointIO`` keeps inside the folder
of the checkpoints Lightning names (``<dir>/.aoffload/<tag>/<file>``, ``<dir>/<file>`` a
link to it)."""


def locate(directory: Path) -> tuple[Path, bool]:
    """The checkpoint directory to read for ``directory``, and whether it is the Lightning
    plugin's (``directory/.aoffload``). Blocking.

    A checkpoint directory is one an engine has started in (it holds ``.aoffload.lock``),
    or one that holds ``latest`` or a committed tag: it may hold no committed checkpoint
    yet. A directory that is none of these but holds such a ``.aoffload/`` is a folder of
    Lightning checkpoints. Raises :class:`CheckpointError` for anything else, and for a
    path that is not a directory.
    """
    if not directory.is_dir():  # the user's own path: a link to a directory is one
        raise CheckpointError(f"{directory} is not a directory")
    if _is_checkpoint_directory(directory):
        return directory, False
    nested = directory / NESTED
    if _paths.kind(nested) == "dir" and _is_checkpoint_directory(nested):
        return nested, True
    raise CheckpointError(
        f"{directory} is not an aoffload checkpoint directory: it holds no {layout.LATEST!r}, "
        f"no {_lock.LOCK_FILE!r}, no committed tag, and no {NESTED}/ of aoffload's Lightning "
        "plugin (point the command at the directory given to CheckpointEngine)"
    )


@dataclass(frozen=True, slots=True)
class TagInfo:
    """One committed tag as its manifest describes it (``error`` if the manifest is bad),
    with its commit metadata (``{}`` if none)."""

    tag: str
    sequence: int
    files: dict[str, Any]
    created: float | None
    error: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        """The bytes of every file, as the manifest records them."""
        return sum(int(entry["bytes"]) for entry in self.files.values())

    @property
    def age(self) -> float | None:
        """Seconds since the tag was committed."""
        return None if self.created is None else max(0.0, time.time() - self.created)


async def list_tags(directory: Path) -> tuple[list[TagInfo], str | None]:
    """The committed tags of ``directory`` (by sequence, oldest first) and ``latest``."""
    try:
        entries = sorted(await asyncio.to_thread(os.listdir, directory))
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise CheckpointError(f"{directory} is not a directory") from exc
    infos = []
    for entry in entries:
        if entry.startswith(".") or _paths.kind(directory / entry) != "dir":
            continue
        try:
            manifest = await asyncio.to_thread(
                read.read_manifest, directory / entry / layout.MANIFEST
            )
        except FileNotFoundError:
            continue
        except (CorruptCheckpointError, OSError) as exc:
            infos.append(TagInfo(entry, -1, {}, None, f"unreadable manifest: {exc}"))
            continue
        infos.append(
            TagInfo(
                entry,
                manifest["sequence"],
                dict(manifest["files"]),
                manifest.get("created"),
                metadata=dict(manifest.get("metadata") or {}),
            )
        )
    infos.sort(key=lambda info: (info.sequence, info.tag))
    try:
        latest = await asyncio.to_thread(read.read_latest, directory)
    except CorruptCheckpointError:
        latest = None
    return infos, latest


async def resolve_tags(directory: Path, tag: str | None, every: bool) -> list[TagInfo]:
    """The tags a command acts on: ``tag``, every committed tag, or the latest one."""
    infos, latest = await list_tags(directory)
    return pick(infos, latest, tag, every, f"{directory}", "committed")


def pick(
    infos: list[TagInfo], latest: str | None, tag: str | None, every: bool, where: str, kind: str
) -> list[TagInfo]:
    """Of the ``kind`` (committed, published) tags ``infos`` of ``where``: ``tag``, every
    one (``every``), or the one ``latest`` names; :class:`CheckpointError` if none is."""
    if every:
        if not infos:
            raise CheckpointError(f"{where} holds no {kind} checkpoint")
        return infos
    wanted = tag if tag is not None else latest
    if wanted is None:
        raise CheckpointError(f"{where} holds no {kind} checkpoint (no {layout.LATEST!r})")
    for info in infos:
        if info.tag == wanted:
            return [info]
    known = ", ".join(info.tag for info in infos) or "none"
    raise CheckpointError(f"{where} has no {kind} checkpoint {wanted!r} (it has: {known})")


# -- verify --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FileCheck:
    """The verdict on one file of a tag: ``error`` is ``None`` when it matches."""

    tag: str
    name: str
    bytes: int
    error: str | None


async def verify_tags(
    directory: Path, infos: list[TagInfo], progress: Callable[[int], object] | None = None
) -> list[FileCheck]:
    """Check every file of ``infos`` against its manifest, off the event loop, one by one.

    ``progress(nbytes)`` is called after each file. A tag whose manifest is unreadable
    yields one failed check named after the manifest.
    """

    def check(info: TagInfo, name: str, entry: dict[str, Any]) -> str | None:
        try:
            read.verify_file(directory / info.tag / name, entry, root=directory)
        except CorruptCheckpointError as exc:
            return str(exc)
        return None

    return await verify_each(infos, check, progress)


async def verify_each(
    infos: list[TagInfo],
    check: Callable[[TagInfo, str, dict[str, Any]], str | None],
    progress: Callable[[int], object] | None,
) -> list[FileCheck]:
    """``check(info, name, entry)`` (what is wrong, or ``None``) of every file of ``infos``,
    one by one on a thread, ``progress(nbytes)`` after each; a tag whose manifest is
    unreadable yields one failed check named after the manifest."""
    checks = []
    for info in infos:
        if info.error is not None:
            checks.append(FileCheck(info.tag, layout.MANIFEST, 0, info.error))
            continue
        for name, entry in info.files.items():
            error = await asyncio.to_thread(check, info, name, entry)
            checks.append(FileCheck(info.tag, name, int(entry["bytes"]), error))
            if progress is not None:
                progress(int(entry["bytes"]))
    return checks


# -- inspect -------------------------------------------------------------------------------


@dataclass(slots=True)
class FileSummary:
    """What one file holds: its tensors and its top-level keys (``error`` if unloadable)."""

    name: str
    tensors: int = 0
    tensor_bytes: int = 0
    dtypes: Counter[str] = field(default_factory=Counter)
    keys: dict[str, str] = field(default_factory=dict)
    top: str = ""
    error: str | None = None


def _describe(value: object, summary: FileSummary | None = None) -> tuple[int, str]:
    """Count the tensors under ``value`` (into ``summary``); return (count, kind)."""
    import torch  # inspect alone needs torch: ls, verify and clean start without it

    count = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            count += 1
            if summary is not None:
                summary.tensors += 1
                summary.tensor_bytes += item.numel() * item.element_size()
                summary.dtypes[str(item.dtype).removeprefix("torch.")] += 1
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return count, type(value).__name__


def summarise(
    directory: Path, info: TagInfo, name: str, weights_only: bool, verify: bool = True
) -> FileSummary:
    """Load file ``name`` of ``info``'s tag and describe it; ``verify=False`` when the caller
    has just verified it (a download checked as it was written): it is not read twice."""
    import torch

    tag, entry = info.tag, info.files[name]
    summary = FileSummary(name)
    path = directory / tag / name
    try:
        fd = read.open_verified(directory, f"{tag}/{name}", entry, verify)
    except CorruptCheckpointError as exc:
        summary.error = str(exc)
        return summary
    try:
        # the very file just verified, whatever happens to its name meanwhile
        opened = f"/proc/self/fd/{fd}"
        loaded = torch.load(opened, map_location="cpu", weights_only=weights_only, mmap=True)
    except Exception as exc:  # noqa: BLE001 - reported per file; the command exits non-zero
        summary.error = f"could not load {path} with weights_only={weights_only}: {exc}"
        return summary
    finally:
        os.close(fd)
    _describe(loaded, summary)
    summary.top = type(loaded).__name__
    if isinstance(loaded, dict):
        for key, value in loaded.items():
            count, kind = _describe(value)
            summary.keys[str(key)] = f"{kind}, {count} tensors" if count else kind
    return summary


async def inspect_tag(
    directory: Path, info: TagInfo, *, weights_only: bool = True
) -> list[FileSummary]:
    """A :class:`FileSummary` of every file of ``info``, each verified against its
    manifest, then loaded off the event loop with ``weights_only=True``
    (``weights_only=False``: the caller trusts the files)."""
    return [
        await asyncio.to_thread(summarise, directory, info, name, weights_only)
        for name in info.files
    ]


# -- clean ---------------------------------------------------------------------------------


def _size(path: Path) -> int:
    """Bytes under ``path``, without following a link (a link counts as itself)."""
    if _paths.kind(path) != "dir":
        return path.lstat().st_size
    total = 0
    for _, _, names, folder in os.fwalk(path, follow_symlinks=False):
        total += sum(os.lstat(name, dir_fd=folder).st_size for name in names)
    return total


def leftovers(directory: Path) -> list[tuple[Path, int]]:
    """The entries dead runs left in ``directory`` (unpublished tags, retired tags, a
    half-moved ``latest``, tag directories without a manifest holding only DeepSpeed's
    NVMe offload copies), with their sizes in bytes."""
    found = []
    for entry in sorted(os.listdir(directory)):
        path = directory / entry
        if (
            entry.startswith((layout.TMP_PREFIX, layout.TRASH_PREFIX))
            or entry == _LATEST_TMP
            or (read.is_orphan(path) and _paths.kind(path / layout.MANIFEST) == "missing")
        ):
            found.append((path, _size(path)))
    return found


def _is_checkpoint_directory(directory: Path) -> bool:
    if _paths.kind(directory / _lock.LOCK_FILE) == "file":
        return True
    if _paths.kind(directory / layout.LATEST) == "file":
        return True
    return any(
        _paths.kind(path) == "dir" and _paths.kind(path / layout.MANIFEST) == "file"
        for path in directory.iterdir()
    )


def clean(directory: Path, *, dry_run: bool = False) -> list[tuple[Path, int]] | None:
    """Remove :func:`leftovers` under the exclusive directory lock; ``None`` when a live
    engine holds the directory (then nothing is removed). Blocking."""
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a directory")
    if not _is_checkpoint_directory(directory):
        raise CheckpointError(
            f"{directory} is not an aoffload checkpoint directory (no {layout.LATEST!r}, "
            f"no {_lock.LOCK_FILE!r}, no committed tag); nothing was removed"
        )
    lock = _lock.try_exclusive(directory)
    if lock is None:
        return None
    try:
        found = leftovers(directory)
        if not dry_run:
            for path, _ in found:
                try:
                    write.remove_tree(path)  # a link is removed, never what it names
                except OSError as exc:
                    raise CheckpointError(f"could not remove {path}: {exc}") from exc
        # and the shared memory of dead trainers and writers (never a live one's)
        shm = _shm.dead_files() if dry_run else _shm.remove_dead()
        return found + [(Path(path), size) for path, size in shm]
    finally:
        lock.release()
