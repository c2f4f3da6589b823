"""Loading a committed file: verified, off the event loop, and without stalling it.

Everything here is blocking and runs on a thread (the engine's load thread, or one started
for :func:`~aoffload.load_checkpoint`); the event loop only awaits the result.

A file whose pickle (``data.pkl``) is small, the usual case since the state is tensors,
is loaded in the trainer by ``torch.load(weights_only=True, mmap=True)``: its tensors map
the file's pages, and nothing grows under the GIL.

A file whose pickle is large holds big non-tensor values (a 64 MB ``bytes``). torch's
weights-only unpickler decodes such a value in single long calls that hold the GIL (over
half a second for 64 MB on the CI machine), which stalls the trainer's event loop whatever
thread runs them. Such a file is loaded in a worker process instead (the engine's writer,
or one started for the call; ``writer/loader.py``): it sends back the state's skeleton
(:class:`~.writer._calls.LoadedFile`), naming where each tensor's storage lies in the
file, so that the trainer maps the file itself, and each large ``bytes`` value left in a
``/dev/shm`` file that the trainer reads with one ``os.pread`` (which fills the new
object's pages without the GIL), then removes (:func:`rebuild`).
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from ..._errors import CheckpointError, CorruptCheckpointError, RemoteError
from ..._runtime.core import WorkerCore
from ..format import layout, read
from ..writer.calls import TARGET, LoadedFile, LoadFile, WriterConfig
from ..writer.loader import unlink_all

if TYPE_CHECKING:
    from .roles import Tier

__all__ = [
    "MapLocation",
    "Remote",
    "in_writer",
    "load_file",
    "load_from",
    "rebuild",
    "temporary_loader",
]

MapLocation = str | torch.device | dict[str, str] | Callable[..., Any] | None

REMOTE_PICKLE = 8 << 20
"""Bytes of ``data.pkl`` from which a file is loaded by a worker."""
_LOADER_START_TIMEOUT = 120.0


# -- the trainer's side -----------------------------------------------------------------


def _read_blob(path: str, nbytes: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.pread(fd, nbytes, 0)  # the kernel fills the new bytes; the GIL is free
        if len(data) == nbytes:
            return data
        parts = [data]  # only above Linux's 2 GiB per read: joining holds the GIL
        while (done := sum(map(len, parts))) < nbytes:
            part = os.pread(fd, nbytes - done, done)
            if not part:
                raise CheckpointError(f"{path}: {done} of {nbytes} bytes")
            parts.append(part)
        return b"".join(parts)
    finally:
        os.close(fd)


class _Rebuilder(pickle.Unpickler):
    """Unpickles a worker's skeleton: tensors map ``whole``, large ``bytes`` are read in.

    A module-level class: one defined per call is a reference cycle that would keep the
    file mapped until the garbage collector ran, and unmapping it then (the file maybe
    deleted, its blocks freed by that very unmap) stalls whatever thread collects.
    """

    def __init__(self, skeleton: bytes, whole: torch.UntypedStorage) -> None:
        super().__init__(io.BytesIO(skeleton))
        self._whole = whole
        self._storages: dict[tuple[int, int], torch.UntypedStorage] = {}

    def persistent_load(self, pid: Any) -> Any:
        if pid[0] == "bytes":
            return _read_blob(pid[1], pid[2])
        _, at, nbytes, dtype, shape, stride, offset, requires_grad, parameter = pid
        storage = self._storages.get((at, nbytes))
        if storage is None:
            storage = self._storages[at, nbytes] = self._whole[at : at + nbytes]
        tensor = torch.empty((0,), dtype=dtype).set_(storage, offset, shape, stride)
        if parameter:
            return torch.nn.Parameter(tensor, requires_grad=requires_grad)
        return tensor.requires_grad_() if requires_grad else tensor


def rebuild(path: Path, loaded: LoadedFile) -> Any:
    """The state a worker loaded from ``path``: tensors map the file, as ``mmap=True`` does."""
    try:
        size = os.path.getsize(path)
        whole = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)
        return _Rebuilder(loaded.skeleton, cast(torch.UntypedStorage, whole)).load()
    finally:
        unlink_all(loaded.blobs)


def _pickle_bytes(path: Path, opened: str | None = None) -> int:
    """The size of the file's ``data.pkl`` (its non-tensor values, pickled); ``opened``
    names the same file when it was opened already (``/proc/self/fd/N``)."""
    try:
        with zipfile.ZipFile(opened or path) as archive:
            return max(
                (i.file_size for i in archive.infolist() if i.filename.endswith("/data.pkl")),
                default=0,
            )
    except zipfile.BadZipFile as exc:
        raise CorruptCheckpointError(f"{path}: not a torch.save file ({exc})") from exc


def _cannot_load(path: Path, weights_only: bool, why: object) -> CheckpointError:
    if not weights_only:
        return CheckpointError(f"could not load {path} with weights_only=False: {why}")
    return CheckpointError(
        f"could not load {path} with weights_only=True: {why}. If you trust this file, "
        "load it with weights_only=False (it runs the file's pickled code), or allow the "
        "global it names with torch.serialization.add_safe_globals([...])"
    )


def _torch_load(
    path: Path, opened: str, map_location: MapLocation, weights_only: bool = True
) -> Any:
    try:
        # mmap: tensors map the file's pages instead of being read into fresh memory
        # under the GIL (170 ms of loop lag for 256 MiB without it).
        return torch.load(opened, map_location=map_location, weights_only=weights_only, mmap=True)
    except Exception as exc:
        raise _cannot_load(path, weights_only, exc) from exc


def _on_cpu(map_location: MapLocation) -> bool:
    return map_location is None or (
        isinstance(map_location, (str, torch.device)) and torch.device(map_location).type == "cpu"
    )


Finish = Callable[[LoadedFile], Any]
Remote = Callable[[LoadFile, Finish], Any]
"""Runs a :class:`LoadFile` in a worker (the engine's writer, or one started for it), then
``finish`` on its reply while the worker still runs (its close removes what the trainer
did not read)."""


def temporary_loader(call: LoadFile, finish: Finish) -> Any:
    """Run ``call`` in a writer process started for it (a second or so to start)."""
    config = WriterConfig(durable=False)
    core = WorkerCore(TARGET, config, name="checkpoint-loader", close_timeout=30.0)
    core.start(_LOADER_START_TIMEOUT)
    try:
        return finish(core.request(call))
    finally:
        core.stop()
        core.release()


def in_writer(writer: WorkerCore | None) -> Remote:
    """Loads in ``writer`` (or, without one, in a loader started for the call)."""
    if writer is None:  # a replica has no writer
        return temporary_loader

    def remote(call: LoadFile, finish: Finish) -> Any:
        return finish(writer.request(call))

    return remote


def load_file(
    directory: Path,
    name: str,
    tag: str | None,
    map_location: MapLocation,
    verify: bool,
    remote: Remote = temporary_loader,
    weights_only: bool = True,
) -> Any:
    """Load file ``name`` of committed ``tag`` (default: ``latest``), verified (blocking).

    ``weights_only=False`` (the caller's opt-in, for trusted files) loads with torch's own
    unpickler, always here: the file's classes must be importable in this process.
    """
    name = layout.validate_name(name)
    tag, manifest = read.find_tag(directory, tag)
    entry = manifest["files"].get(name)
    if entry is None:
        raise CheckpointError(
            f"checkpoint {tag!r} has no file {name!r}; it has {sorted(manifest['files'])}"
        )
    path = directory / tag / name
    # Opened without following a link below `directory`, and checked through the same
    # descriptor that every later read goes through (/proc/self/fd): the file loaded is
    # the file verified.
    fd = read.open_verified(directory, f"{tag}/{name}", entry, verify)
    try:
        opened = f"/proc/self/fd/{fd}"
        pickled = _pickle_bytes(path, opened)
        if pickled < REMOTE_PICKLE or not _on_cpu(map_location) or not weights_only:
            return _torch_load(path, opened, map_location, weights_only)
        call = LoadFile(os.readlink(opened), tuple(torch.serialization.get_safe_globals()))
        return remote(call, lambda loaded: rebuild(Path(opened), loaded))
    except RemoteError as exc:
        raise _cannot_load(path, True, exc.remote_message) from exc
    finally:
        os.close(fd)


def load_from(
    tier: Tier,
    writer: WorkerCore | None,
    name: str,
    tag: str | None,
    latest: str | None,
    known: list[str],
    map_location: MapLocation,
    verify: bool,
    weights_only: bool = True,
) -> Any:
    """Load file ``name`` of ``tag`` (blocking: the engine's load thread) from where
    ``tier`` says it is (``latest`` and ``known``: the engine's), in ``writer`` when its
    pickle is large. A download just verified is not hashed twice."""
    name = layout.validate_name(name)
    root, found, fresh = tier.source(name, tag, latest, known)
    return load_file(
        root, name, found, map_location, verify and not fresh, in_writer(writer), weights_only
    )
