"""Loading a committed file: verified, off the event loop, and without stalling it.

A file whose pickle (``data.pkl``) is small, the usual case since the state is tensors,
is loaded in the trainer by ``torch.load(weights_only=True, mmap=True)`` on a thread: its
tensors map the file's pages, and nothing grows under the GIL.

A file whose pickle is large holds big non-tensor values (a 64 MB ``bytes``). torch's
weights-only unpickler decodes such a value in single long calls that hold the GIL (over
half a second for 64 MB on the CI machine), which stalls the trainer's event loop whatever
thread runs them. Such a file is loaded in a worker process instead (the engine's writer,
or one started for the call, :func:`load_in_worker`): it runs ``torch.load`` and sends back
the state's skeleton, pickled with a persistent id per tensor, naming where its storage
lies in the file so that the trainer maps the file itself, and per large ``bytes`` value,
left in a ``/dev/shm`` file that the trainer reads with one ``os.pread``, which fills the
new object's pages without the GIL, then removes (:func:`rebuild`).
"""

from __future__ import annotations

import asyncio
import io
import itertools
import os
import pickle
import zipfile
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from .._errors import CheckpointError, CorruptCheckpointError, RemoteError
from .._runtime.bridge import Bridge
from .._runtime.protocol import Call
from .._runtime.threads import DaemonThreadExecutor
from . import _store

__all__ = [
    "LoadFile",
    "LoadedFile",
    "in_writer",
    "load",
    "load_checkpoint",
    "load_in_worker",
    "rebuild",
    "unlink_all",
]

REMOTE_PICKLE = 8 << 20
"""Bytes of ``data.pkl`` from which a file is loaded by a worker."""
_BLOB = 1 << 20  # a bytes value this large travels through /dev/shm
_SHM_DIR = "/dev/shm"
_numbers = itertools.count()


@dataclass(frozen=True, slots=True)
class LoadedFile:
    """A file loaded by a worker: the pickled skeleton and the ``/dev/shm`` files it names."""

    skeleton: bytes
    blobs: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class LoadFile(Call[LoadedFile]):
    """Load ``path`` with ``torch.load(weights_only=True)`` and send back what :func:`rebuild`
    needs; ``safe_globals`` are the trainer's ``torch.serialization.get_safe_globals()``."""

    path: str
    safe_globals: tuple[Any, ...] = ()


def unlink_all(paths: Iterable[str]) -> None:
    """Remove the files ``paths`` (``/dev/shm`` blobs); those already gone are skipped."""
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue


# -- the worker's side ------------------------------------------------------------------


def _mapping_start(path: str) -> int:
    """Where this process mapped ``path`` from its first byte (``torch.load(mmap=True)``)."""
    target = os.path.realpath(path)
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].rstrip("\n") == target and int(fields[2], 16) == 0:
                return int(fields[0].split("-")[0], 16)
    raise CheckpointError(f"{path}: torch.load(mmap=True) left no mapping of the file")


class _Skeleton(pickle.Pickler):
    def __init__(self, file: io.BytesIO, path: str, blobs: list[str]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._path, self._blobs = path, blobs
        self._start: int | None = None  # read once a tensor keeps the mapping alive
        self._size = os.path.getsize(path)

    def persistent_id(self, obj: Any) -> tuple[Any, ...] | None:
        if isinstance(obj, torch.Tensor):
            if self._start is None:
                self._start = _mapping_start(self._path)
            storage = obj.untyped_storage()
            nbytes = storage.nbytes()
            at = storage.data_ptr() - self._start if nbytes else 0
            if not 0 <= at <= self._size - nbytes:
                raise CheckpointError(f"{self._path}: a tensor's storage is not in the file")
            parameter = isinstance(obj, torch.nn.Parameter)
            return ("tensor", at, nbytes, obj.dtype, tuple(obj.shape), obj.stride(),
                    obj.storage_offset(), obj.requires_grad, parameter)  # fmt: skip
        if type(obj) is bytes and len(obj) >= _BLOB:
            blob = f"{_SHM_DIR}/aoffload-load-{os.getpid()}-{next(_numbers)}"
            fd = os.open(blob, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            self._blobs.append(blob)
            try:
                with memoryview(obj) as view:
                    written = 0
                    while written < len(view):
                        written += os.write(fd, view[written:])
            finally:
                os.close(fd)
            return ("bytes", blob, len(obj))
        return None


def load_in_worker(call: LoadFile, blobs: list[str]) -> LoadedFile:
    """Load ``call.path`` here and describe the state for :func:`rebuild` in the trainer.

    The globals the trainer allowed are allowed here too. The ``/dev/shm`` files made for
    large values are added to ``blobs``, so that the worker can remove those the trainer
    never read (a failed call removes its own at once).
    """
    path = call.path
    with torch.serialization.safe_globals(list(call.safe_globals)):
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    made: list[str] = []
    try:
        buffer = io.BytesIO()
        _Skeleton(buffer, path, made).dump(state)
    except BaseException:
        unlink_all(made)
        raise
    finally:
        blobs += made
    return LoadedFile(buffer.getvalue(), tuple(made))


# -- the trainer's side -----------------------------------------------------------------


def _discard(reply: asyncio.Future[LoadedFile]) -> None:
    """Remove the ``/dev/shm`` files of a worker's reply that nobody will read."""
    if not reply.cancelled() and reply.exception() is None:
        unlink_all(reply.result().blobs)


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


def _pickle_bytes(path: Path) -> int:
    """The size of the file's ``data.pkl`` (its non-tensor values, pickled)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return max(
                (i.file_size for i in archive.infolist() if i.filename.endswith("/data.pkl")),
                default=0,
            )
    except zipfile.BadZipFile as exc:
        raise CorruptCheckpointError(f"{path}: not a torch.save file ({exc})") from exc


def _verify(path: Path, entry: dict[str, Any], verify: bool) -> int:
    try:
        if verify:
            _store.verify_file(path, entry)
        return _pickle_bytes(path)
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(f"{path}: listed in the manifest but missing") from exc


def _torch_load(path: Path, map_location: _store.MapLocation) -> Any:
    try:
        # mmap: tensors map the file's pages instead of being read into fresh memory
        # under the GIL (170 ms of loop lag for 256 MiB without it).
        return torch.load(path, map_location=map_location, weights_only=True, mmap=True)
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(f"{path}: listed in the manifest but missing") from exc
    except Exception as exc:
        raise CheckpointError(f"could not load {path} with weights_only=True: {exc}") from exc


def _on_cpu(map_location: _store.MapLocation) -> bool:
    return map_location is None or (
        isinstance(map_location, (str, torch.device)) and torch.device(map_location).type == "cpu"
    )


Finish = Callable[[LoadedFile], Awaitable[Any]]
Remote = Callable[[LoadFile, Finish], Awaitable[Any]]
"""Runs a :class:`LoadFile` in a worker (the engine's writer, or one started for it), then
``finish`` on its reply while the worker still runs (it removes what the trainer left)."""


async def temporary_loader(call: LoadFile, finish: Finish) -> Any:
    """Run ``call`` in a writer process started for it (a second or so to start)."""
    from ._writer import TARGET, WriterConfig

    async with Bridge(TARGET, WriterConfig(durable=False), name="checkpoint-loader") as bridge:
        return await finish(await bridge.request(call))


async def in_writer(bridge: Bridge | None, call: LoadFile, finish: Finish) -> Any:
    """Run ``call`` in an engine's writer (in a loader started for it if it has none)."""
    if bridge is None:  # a replica has no writer
        return await temporary_loader(call, finish)
    reply = bridge.call(call)
    try:
        loaded = await asyncio.shield(reply)
    except asyncio.CancelledError:
        reply.add_done_callback(_discard)  # its /dev/shm files are nobody's now
        raise
    return await finish(loaded)


async def load(
    directory: Path,
    name: str,
    tag: str | None,
    map_location: _store.MapLocation,
    verify: bool,
    executor: Executor,
    remote: Remote = temporary_loader,
) -> Any:
    """Load file ``name`` of committed ``tag`` (default: ``latest``), verified, off the loop."""
    name = _store.validate_name(name)
    if tag is None:
        tag = await _store.read_latest(directory, executor)
        if tag is None:
            raise CheckpointError(
                f"{directory} holds no committed checkpoint (no {_store.LATEST!r})"
            )
    tag = _store.validate_tag(tag)
    try:
        manifest = await _store.read_manifest(directory / tag / _store.MANIFEST, executor)
    except FileNotFoundError as exc:
        raise CheckpointError(f"{directory} has no committed checkpoint {tag!r}") from exc
    entry = manifest["files"].get(name)
    if entry is None:
        raise CheckpointError(
            f"checkpoint {tag!r} has no file {name!r}; it has {sorted(manifest['files'])}"
        )
    loop = asyncio.get_running_loop()
    path = directory / tag / name
    pickled = await loop.run_in_executor(executor, _verify, path, entry, verify)
    if pickled < REMOTE_PICKLE or not _on_cpu(map_location):
        return await loop.run_in_executor(executor, _torch_load, path, map_location)

    async def finish(loaded: LoadedFile) -> Any:
        return await loop.run_in_executor(executor, rebuild, path, loaded)

    try:
        call = LoadFile(str(path), tuple(torch.serialization.get_safe_globals()))
        return await remote(call, finish)
    except RemoteError as exc:
        raise CheckpointError(
            f"could not load {path} with weights_only=True: {exc.remote_message}"
        ) from exc


async def load_checkpoint(
    directory: str | os.PathLike[str],
    name: str,
    tag: str | None = None,
    *,
    map_location: _store.MapLocation = "cpu",
    verify: bool = True,
) -> Any:
    """Load file ``name`` of a committed checkpoint in ``directory``, without an engine.

    ``tag=None`` reads the checkpoint ``latest`` names. The file's size and xxh3-64 are
    checked against the manifest (``verify=False`` skips that), then it is loaded with
    ``torch.load(..., weights_only=True, map_location=map_location)`` off the event loop
    (in a worker process started for the call when the file holds large non-tensor
    values, so that unpickling them does not stall the loop). Raises
    :class:`CorruptCheckpointError` naming the file on a mismatch or a missing file, and
    :class:`CheckpointError` for an unknown tag or name.
    """
    executor = DaemonThreadExecutor("aoffload-load")
    try:
        loaded = await load(Path(directory), name, tag, map_location, verify, executor)
    except asyncio.CancelledError:
        executor.shutdown(wait=False)  # its read may still run: never join it on the loop
        raise
    except BaseException:
        executor.shutdown(wait=True)  # idle: the call that failed has returned
        raise
    executor.shutdown(wait=True)  # idle: joining it takes microseconds
    return loaded
