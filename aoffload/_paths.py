"""Path operations that never follow a symbolic link inside a checkpoint directory.

A checkpoint directory is untrusted input: it may come from a download, another user or a
crashed run, and its contents may change while an engine runs. So every path *below* a
root (the directory the user named, which is opened normally, links and all) is resolved
one component at a time, each opened with ``O_NOFOLLOW`` relative to its parent's
descriptor (``openat``). A link anywhere inside, planted before or during the operation,
fails the operation with :class:`UnsafePathError` instead of redirecting it; writes,
renames and deletes act on the entry itself, never on what a link names. Trees are
removed with ``shutil.rmtree``'s descriptor-based walk, which unlinks links and never
enters them.

Pure ``os``, no torch: the trainer's side (:mod:`.read`, :mod:`.write`) and the writer
process (``writer/``) both use it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "UnsafePathError",
    "kind",
    "open_dir",
    "open_file",
    "open_regular",
    "regular_files",
    "remove",
    "rename",
    "split",
]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePathError(OSError):
    """An entry inside a checkpoint directory is a link or of a kind aoffload never uses."""


def split(relative: str) -> list[str]:
    """The components of ``relative``; :class:`UnsafePathError` unless it stays beneath."""
    parts = relative.split("/")
    if not relative or relative.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise UnsafePathError(errno.EINVAL, "not a relative path below the directory", relative)
    return parts


def kind(path: Path) -> str:
    """What ``path`` is, without following a link: ``missing``, ``dir``, ``file``,
    ``link`` or ``other``."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return "missing"
    if stat.S_ISLNK(mode):
        return "link"
    if stat.S_ISDIR(mode):
        return "dir"
    return "file" if stat.S_ISREG(mode) else "other"


def _refused(exc: OSError, where: Path) -> OSError:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
        what = kind(where)
        if what in ("link", "file", "other"):
            message = (
                "is a symbolic link; aoffload never follows links inside a checkpoint directory"
                if what == "link"
                else f"is a {'file' if what == 'file' else 'special file'}, not a directory"
            )
            return UnsafePathError(exc.errno, message, str(where))
    exc.filename = str(where)
    return exc


def _open_below(parent: int, name: str, flags: int, mode: int, where: Path) -> int:
    try:
        return os.open(name, flags, mode, dir_fd=parent)
    except OSError as exc:
        raise _refused(exc, where) from None


def open_dir(root: Path, relative: str = "", *, create: bool = False, mode: int = 0o755) -> int:
    """A descriptor of directory ``root/relative``, no link followed below ``root``.

    ``create`` makes the missing directories. The caller closes the descriptor.
    """
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    where = root
    try:
        for part in split(relative) if relative else []:
            where = where / part
            try:
                child = _open_below(fd, part, _DIR_FLAGS, 0, where)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, mode, dir_fd=fd)
                child = _open_below(fd, part, _DIR_FLAGS, 0, where)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file(
    root: Path, relative: str, flags: int = os.O_RDONLY, mode: int = 0o644, *, parents: bool = False
) -> int:
    """``os.open`` of ``root/relative`` with no link followed below ``root``.

    ``parents`` creates the missing directories on the way. The caller closes it.
    """
    *folders, name = split(relative)
    parent = open_dir(root, "/".join(folders), create=parents)
    try:
        return _open_below(
            parent, name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, root / relative
        )
    finally:
        os.close(parent)


def open_regular(root: Path, relative: str) -> int:
    """A regular file below ``root``, open for reading with no link followed;
    :class:`UnsafePathError` for anything else (a FIFO never blocks the open)."""
    fd = open_file(root, relative, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafePathError(errno.EINVAL, "is not a regular file", str(root / relative))
    except BaseException:
        os.close(fd)
        raise
    return fd


def remove(path: Path) -> None:
    """Remove the file, link or directory tree at ``path`` (if any); a link is removed
    itself, never what it names, and nothing outside ``path`` is touched."""
    what = kind(path)
    if what == "missing":
        return
    if what == "dir":
        shutil.rmtree(path)  # descriptor-based on Linux: links inside are unlinked, not entered
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def rename(source: Path, source_rel: str, target: Path, target_rel: str) -> None:
    """Rename ``source/source_rel`` to ``target/target_rel`` (missing target directories
    are made), with no link followed below either root."""
    *from_dirs, from_name = split(source_rel)
    *to_dirs, to_name = split(target_rel)
    old = open_dir(source, "/".join(from_dirs))
    try:
        new = open_dir(target, "/".join(to_dirs), create=True)
        try:
            os.rename(from_name, to_name, src_dir_fd=old, dst_dir_fd=new)
        finally:
            os.close(new)
    finally:
        os.close(old)


def regular_files(root: Path) -> Iterator[str]:
    """The relative names of the regular files under directory ``root``, walked without
    following links; :class:`UnsafePathError` for a link or a special file."""
    if kind(root) != "dir":
        raise UnsafePathError(errno.ENOTDIR, "is not a directory (or is a link)", str(root))
    for folder, _, names, folder_fd in os.fwalk(root, follow_symlinks=False):
        for name in names:
            mode = os.lstat(name, dir_fd=folder_fd).st_mode
            path = Path(folder) / name
            if stat.S_ISLNK(mode):
                raise UnsafePathError(
                    errno.ELOOP,
                    "is a symbolic link; aoffload never follows links inside a checkpoint "
                    "directory",
                    str(path),
                )
            if not stat.S_ISREG(mode):
                raise UnsafePathError(errno.EINVAL, "is a special file", str(path))
            yield path.relative_to(root).as_posix()
