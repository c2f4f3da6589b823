"""Writing a checkpoint directory: publish a tag, move ``latest``, retire, gather ranks' files.

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
Each phase is one synchronous function here, run by the engine's commit thread, never by
the event loop. Nothing is followed through a link below the directory. No torch here.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ... import _paths as paths
from ..._errors import CheckpointError
from .layout import FORMAT, LATEST, MANIFEST, TRASH_PREFIX, FileEntry, validate_name

__all__ = [
    "adopt",
    "fsync_path",
    "gather",
    "point_latest",
    "publish",
    "remove_tree",
    "retire",
    "write_below",
]


def fsync_path(path: Path) -> None:
    """fsync a file or directory by path."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_tree(path: Path) -> None:
    """Remove the directory tree, file or link at ``path``, if any; a link is removed
    itself, never what it names (:func:`.paths.remove`)."""
    paths.remove(path)


def write_below(root: Path, relative: str, text: str, durable: bool) -> None:
    """Write ``text`` to ``root/relative`` without following a link below ``root``."""
    fd = paths.open_file(root, relative, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        with memoryview(text.encode("utf-8")) as data:
            done = 0
            while done < len(data):
                done += os.write(fd, data[done:])
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def gather(tmpdir: Path, sources: Mapping[Path, list[str]], *, durable: bool) -> None:
    """Rename every rank's files (``sources``: its tmp directory -> its names) into ``tmpdir``.

    Each source directory is removed once empty; its files were durable before (the rank
    reported them so), and the renames are made durable by fsyncing ``tmpdir``'s tree.
    Every directory is a child of the same checkpoint directory; no link is followed.
    """
    directory = tmpdir.parent
    os.close(paths.open_dir(directory, tmpdir.name, create=True))
    for source, names in sources.items():
        for name in names:
            validate_name(name)
            paths.rename(directory, f"{source.name}/{name}", directory, f"{tmpdir.name}/{name}")
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
    what = paths.kind(existing)
    if what == "missing":
        return adopted
    if what != "dir" or os.lstat(existing).st_uid != os.geteuid():
        kind = {"link": "a symbolic link", "dir": "another user's directory"}.get(what, "a file")
        raise paths.UnsafePathError(
            errno.EEXIST,
            f"exists and is {kind}, not a directory aoffload can publish; nothing was moved. "
            "Remove it or commit under another tag",
            str(existing),
        )
    try:
        names = list(paths.regular_files(existing))
    except paths.UnsafePathError as exc:
        raise paths.UnsafePathError(
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
        fd = paths.open_regular(existing, relative)
        try:
            adopted[relative] = FileEntry.of(fd)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
    if durable:
        for folder, _, _ in os.walk(existing):
            fsync_path(Path(folder))
    directory = existing.parent
    for entry in os.listdir(existing):
        if paths.kind(tmpdir / entry) != "missing":
            # a top-level folder both sides have (`offloaded_tensors` next to saved files)
            for relative in names:
                if relative.startswith(entry + "/"):
                    paths.rename(
                        directory,
                        f"{existing.name}/{relative}",
                        directory,
                        f"{tmpdir.name}/{relative}",
                    )
            remove_tree(existing / entry)
        else:
            paths.rename(directory, f"{existing.name}/{entry}", directory, f"{tmpdir.name}/{entry}")
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
    if paths.kind(existing) == "dir" and paths.kind(existing / MANIFEST) != "missing":
        raise paths.UnsafePathError(
            errno.EEXIST,
            "is a committed checkpoint (it has a manifest), and a committed checkpoint is "
            "never rewritten; commit under a new tag",
            str(existing),
        )
    os.close(paths.open_dir(directory, tmpdir.name, create=True))
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
