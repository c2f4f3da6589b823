"""Asynchronous, snapshot-consistent, crash-safe checkpoints: :class:`CheckpointEngine`.

``save()`` copies every tensor into shared staging memory (off the event loop) and
returns; a spawned writer process turns the staged tensors into plain ``torch.save``
files while training goes on. ``commit()`` waits until every file of a tag is durable,
then publishes the tag (the commit protocol, all in the trainer through ``aiofiles``
on the engine's own I/O thread)::

    directory/.tmp-<tag>-<id>/<files>        written and fsynced by the writer
    directory/.tmp-<tag>-<id>/.aoffload-manifest.json   sizes + xxh3-64 of every file, last
    rename .tmp-<tag>-<id> -> <tag>, fsync directory    the tag now exists, complete
    latest.tmp -> os.replace -> latest, fsync directory the pointer moves atomically
    rename old tags -> .trash-*, then delete             retention, after the new tag is durable

A crash at any instant leaves ``latest`` naming either the old or the new checkpoint.
Leftover ``.tmp-*`` and ``.trash-*`` entries are removed when a writing engine starts.
"""

from __future__ import annotations

import asyncio
import enum
import io
import json
import logging
import os
import pickle
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import aiofiles
import aiofiles.os
import torch
import xxhash

from ._bridge import AsyncResource, Bridge, DaemonThreadExecutor
from ._errors import (
    CheckpointError,
    ClosedError,
    CorruptCheckpointError,
    InvalidStateError,
    RemoteError,
)
from ._staging import Region, Segment, Slot, aligned
from ._writer import (
    MANIFEST,
    TARGET,
    FileRecord,
    MapSegment,
    SyncTree,
    TensorRecord,
    WriteFile,
    WriterConfig,
    WriterOp,
)

__all__ = ["CheckpointEngine", "CommitResult", "load_checkpoint"]

logger = logging.getLogger(__name__)

LATEST = "latest"
_FORMAT = "aoffload-checkpoint/1"
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"
MapLocation = str | torch.device | dict[str, str] | Callable[..., Any] | None


@dataclass(frozen=True, slots=True)
class CommitResult:
    """What one ``commit()`` published, and how long each phase took.

    ``stage_seconds``: time spent copying the tag's tensors into staging memory (what
    ``save()`` cost the trainer); ``write_seconds``: the writer's time serialising and
    fsyncing the files; ``commit_seconds``: from the ``commit()`` call until the tag and
    ``latest`` were durable and published. A replica (``writer=False``) gets zero files.
    """

    tag: str
    path: Path
    files: tuple[str, ...]
    bytes: int
    stage_seconds: float
    write_seconds: float
    commit_seconds: float

    @property
    def write_gb_per_second(self) -> float:
        """Durable write throughput of the writer, in GB/s (10**9 bytes)."""
        return self.bytes / self.write_seconds / 1e9 if self.write_seconds > 0 else 0.0

    @property
    def stage_gb_per_second(self) -> float:
        """Staging copy throughput, in GB/s (10**9 bytes)."""
        return self.bytes / self.stage_seconds / 1e9 if self.stage_seconds > 0 else 0.0


# -- validation and planning (trainer side) ------------------------------------------------


def _validate_name(name: object) -> str:
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


def _validate_tag(tag: object) -> str:
    if not isinstance(tag, str) or not tag or "/" in tag or "\0" in tag:
        raise InvalidStateError(f"tag {tag!r}: must be a non-empty string without '/'")
    if tag.startswith(".") or tag == LATEST:
        raise InvalidStateError(f"tag {tag!r}: must not start with '.' nor be {LATEST!r}")
    return tag


def _tensor_problem(tensor: torch.Tensor) -> str | None:
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        return f"tensor subclass {type(tensor).__qualname__} is not supported"
    if tensor.layout is not torch.strided or tensor.is_nested:
        return f"tensors with layout {tensor.layout} are not supported (only dense tensors)"
    if tensor.is_quantized:
        return "quantized tensors are not supported"
    if tensor.device.type not in ("cpu", "cuda"):
        return f"tensors on device {tensor.device} are not supported (only cpu and cuda)"
    return None


class _Unsupported(Exception):
    pass


class _Pickler(pickle.Pickler):
    """Pickles the skeleton of a state; every tensor becomes a persistent id."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self._ids: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> int | None:
        if not isinstance(obj, torch.Tensor):
            return None
        index = self._ids.get(id(obj))
        if index is None:
            problem = _tensor_problem(obj)
            if problem is not None:
                raise _Unsupported(problem)
            index = self._ids[id(obj)] = len(self.tensors)
            self.tensors.append(obj)
        return index


def _locate(value: object, key: str) -> tuple[str, str] | None:
    """Find the first key whose value cannot be saved, and why (the slow, error-only path)."""
    if isinstance(value, dict):
        for k, v in value.items():
            found = _locate(v, f"{key}[{k!r}]")
            if found is not None:
                return found
        return None
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = _locate(v, f"{key}[{i}]")
            if found is not None:
                return found
        return None
    try:
        _Pickler(io.BytesIO()).dump(value)
    except Exception as exc:  # noqa: BLE001 - reported to the caller with its key
        return key, f"{type(exc).__name__}: {exc}"
    return None


@dataclass(frozen=True, slots=True)
class _Plan:
    skeleton: bytes
    tensors: tuple[torch.Tensor, ...]
    offsets: tuple[int, ...]
    nbytes: int


def _plan(state: object, name: str) -> _Plan:
    buffer = io.BytesIO()
    pickler = _Pickler(buffer)
    try:
        pickler.dump(state)
    except Exception as exc:
        found = _locate(state, "state")
        where, why = found if found is not None else ("state", f"{type(exc).__name__}: {exc}")
        raise InvalidStateError(f"cannot save {name!r}: {where}: {why}") from exc
    offsets, total = [], 0
    for tensor in pickler.tensors:
        offsets.append(total)
        total += aligned(tensor.numel() * tensor.element_size())
    return _Plan(buffer.getvalue(), tuple(pickler.tensors), tuple(offsets), total)


def _stage(region: Region, plan: _Plan) -> float:
    """Copy the plan's tensors into ``region`` (on the engine's I/O thread)."""
    started = time.perf_counter()
    if torch.get_num_threads() != 1:
        # Per thread under OpenMP: only this I/O thread copies single-threaded. Intra-op
        # workers spinning after each parallel copy starved the event loop on small hosts.
        torch.set_num_threads(1)
    array = region.segment.array
    if array is None:
        raise ClosedError("the checkpoint engine's staging memory was released")
    cuda_streams: dict[torch.device, torch.cuda.Stream] = {}
    for tensor, offset in zip(plan.tensors, plan.offsets, strict=True):
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            continue
        start = region.offset + offset
        target = array[start : start + nbytes].view(tensor.dtype).view(tensor.shape)
        if tensor.is_cuda:
            region.segment.pin()
            stream = cuda_streams.get(tensor.device)
            if stream is None:
                stream = cuda_streams[tensor.device] = torch.cuda.Stream(tensor.device)  # type: ignore[no-untyped-call]
                stream.wait_stream(torch.cuda.default_stream(tensor.device))
            with torch.cuda.stream(stream):
                target.copy_(tensor.detach(), non_blocking=True)
        else:
            target.copy_(tensor.detach())
    for stream in cuda_streams.values():
        stream.synchronize()
    return time.perf_counter() - started


def _consume(future: asyncio.Future[Any]) -> None:
    """Mark a future's exception as seen: whoever awaits it later still gets it."""
    if not future.cancelled():
        future.exception()


# -- file helpers (trainer side, on the engine's I/O thread) ---------------------------------


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_verify_load(path: Path, entry: dict[str, Any], map_location: Any, verify: bool) -> Any:
    try:
        with open(path, "rb", buffering=0) as file:
            size = os.fstat(file.fileno()).st_size
            if verify and size != entry["bytes"]:
                raise CorruptCheckpointError(
                    f"{path}: {size} bytes on disk, the manifest says {entry['bytes']}"
                )
            data = bytearray(size)
            view, done = memoryview(data), 0
            while done < size and (n := file.readinto(view[done:])):
                done += n
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(f"{path}: listed in the manifest but missing") from exc
    if verify and xxhash.xxh3_64_hexdigest(data) != entry["xxh3_64"]:
        raise CorruptCheckpointError(f"{path}: checksum mismatch (xxh3-64); the file is corrupt")
    try:
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"could not load {path} with weights_only=True: {exc}") from exc


async def _read_text(path: Path, executor: DaemonThreadExecutor) -> str:
    # Not `async with`: aiofiles closes a context-managed file on the default executor.
    file = await aiofiles.open(path, encoding="utf-8", executor=executor)
    try:
        return await file.read()
    finally:
        await file.close()


async def _read_manifest(path: Path, executor: DaemonThreadExecutor) -> dict[str, Any]:
    text = await _read_text(path, executor)
    try:
        manifest = json.loads(text)
    except ValueError as exc:
        raise CorruptCheckpointError(f"{path}: the manifest is not valid JSON") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
        raise CorruptCheckpointError(f"{path}: not an aoffload manifest ({_FORMAT})")
    return manifest


async def _read_latest(directory: Path, executor: DaemonThreadExecutor) -> str | None:
    try:
        return (await _read_text(directory / LATEST, executor)).strip() or None
    except FileNotFoundError:
        return None


async def _load(
    directory: Path,
    name: str,
    tag: str | None,
    map_location: MapLocation,
    verify: bool,
    executor: DaemonThreadExecutor,
) -> Any:
    name = _validate_name(name)
    if tag is None:
        tag = await _read_latest(directory, executor)
        if tag is None:
            raise CheckpointError(f"{directory} holds no committed checkpoint (no {LATEST!r})")
    tag = _validate_tag(tag)
    try:
        manifest = await _read_manifest(directory / tag / MANIFEST, executor)
    except FileNotFoundError as exc:
        raise CheckpointError(f"{directory} has no committed checkpoint {tag!r}") from exc
    entry = manifest["files"].get(name)
    if entry is None:
        raise CheckpointError(
            f"checkpoint {tag!r} has no file {name!r}; it has {sorted(manifest['files'])}"
        )
    loop = asyncio.get_running_loop()
    path = directory / tag / name
    return await loop.run_in_executor(
        executor, _read_verify_load, path, entry, map_location, verify
    )


async def load_checkpoint(
    directory: str | os.PathLike[str],
    name: str,
    tag: str | None = None,
    *,
    map_location: MapLocation = "cpu",
    verify: bool = True,
) -> Any:
    """Load file ``name`` of a committed checkpoint in ``directory``, without an engine.

    ``tag=None`` reads the checkpoint ``latest`` names. The file's size and xxh3-64 are
    checked against the manifest (``verify=False`` skips that), then it is loaded with
    ``torch.load(..., weights_only=True, map_location=map_location)`` off the event loop.
    Raises :class:`CorruptCheckpointError` naming the file on a mismatch or a missing
    file, and :class:`CheckpointError` for an unknown tag or name.
    """
    executor = DaemonThreadExecutor("aoffload-load")
    try:
        return await _load(Path(directory), name, tag, map_location, verify, executor)
    finally:
        executor.shutdown(wait=True)  # idle by now: the thread only takes its stop item


# -- the engine ----------------------------------------------------------------------------


class _State(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"


@dataclass
class _OpenTag:
    """A tag with files staged or being written, not yet published."""

    tag: str
    tmpdir: Path
    slot: Slot
    writes: dict[str, asyncio.Future[FileRecord]] = field(default_factory=dict)
    staging: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    stage_seconds: float = 0.0
    commit: asyncio.Task[CommitResult] | None = None


class CheckpointEngine(AsyncResource):
    """Snapshot-consistent asynchronous checkpoints written by a spawned writer process.

    Use as ``async with CheckpointEngine(directory) as engine:``; see :meth:`save`,
    :meth:`commit` and :meth:`load`. ``keep_last`` keeps that many newest committed tags
    (``None``: all). ``max_pending`` bounds the checkpoints staged but not yet durable
    (each holds staging memory the size of its tensors). ``writer=False`` makes a
    replica that validates names and writes nothing. ``durable=False`` skips fsync
    (tests, scratch runs). Tags are ordered by commit: each manifest records a sequence
    number one above the highest found in ``directory``.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        max_pending: int = 1,
        writer: bool = True,
        durable: bool = True,
        start_timeout: float = 60.0,
        close_timeout: float = 30.0,
        direct_io: bool = True,
    ) -> None:
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be None or an int >= 1, not {keep_last!r}")
        if not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending must be an int >= 1, not {max_pending!r}")
        self._directory = Path(directory)
        self._keep_last = keep_last
        self._writer = writer
        self._durable = durable
        self._close_timeout = close_timeout
        self._state = _State.NEW
        self._bridge = (
            Bridge(
                TARGET,
                WriterConfig(durable=durable, direct_io=direct_io),
                name="checkpoint-writer",
                start_timeout=start_timeout,
                close_timeout=close_timeout,
            )
            if writer
            else None
        )
        self._io: DaemonThreadExecutor | None = None
        self._trash: DaemonThreadExecutor | None = None
        self._deletions: set[asyncio.Future[None]] = set()
        self._slots = [Slot(i) for i in range(max_pending)]
        self._free_slots = list(reversed(self._slots))
        self._slot_waiters: list[asyncio.Future[None]] = []
        self._save_lock = asyncio.Lock()
        self._open: dict[str, _OpenTag] = {}
        self._committed: list[str] = []
        self._results: dict[str, CommitResult] = {}
        self._latest: str | None = None
        self._sequence = 0
        self._last_commit: asyncio.Task[CommitResult] | None = None

    # -- introspection -----------------------------------------------------------------

    @property
    def directory(self) -> Path:
        """The checkpoint directory."""
        return self._directory

    @property
    def pid(self) -> int | None:
        """The writer's process id while it runs, else ``None`` (always for a replica)."""
        return self._bridge.pid if self._bridge is not None else None

    def latest(self) -> str | None:
        """The newest committed tag (what ``latest`` names), or ``None``."""
        return self._latest

    def tags(self) -> list[str]:
        """Committed tags, oldest first (by commit order), as of start and own commits."""
        return list(self._committed)

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Scan the directory (cleaning a crash's leftovers) and start the writer."""
        if self._state is not _State.NEW:
            raise ClosedError("this CheckpointEngine was already started; create a new one")
        self._state = _State.RUNNING
        self._io = DaemonThreadExecutor("aoffload-checkpoint-io")
        try:
            await self._scan()
            if self._bridge is not None:
                await self._bridge.start()
        except BaseException:
            await self._shutdown()
            raise

    async def _scan(self) -> None:
        io_ = self._executor()
        if self._writer:
            await aiofiles.os.makedirs(self._directory, exist_ok=True, executor=io_)
        elif not await aiofiles.os.path.isdir(self._directory, executor=io_):
            return
        found: list[tuple[int, str]] = []
        for entry in await aiofiles.os.listdir(self._directory, executor=io_):
            path = self._directory / entry
            if entry.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
                if self._writer:
                    logger.info("removing %s, left over by an interrupted checkpoint", path)
                    await self._rmtree(path)
                continue
            if entry.startswith(".") or not await aiofiles.os.path.isfile(
                path / MANIFEST, executor=io_
            ):
                continue
            manifest = await _read_manifest(path / MANIFEST, io_)
            found.append((int(manifest["sequence"]), entry))
        found.sort()
        self._committed = [tag for _, tag in found]
        self._sequence = found[-1][0] if found else 0
        self._latest = await _read_latest(self._directory, io_)

    async def aclose(self) -> None:
        """Finish commits in flight, stop the writer, release staging memory. Idempotent.

        Tags saved but never committed are discarded (logged at WARNING).
        """
        if self._state in (_State.CLOSED, _State.CLOSING):
            return
        if self._state is _State.NEW:
            self._state = _State.CLOSED
            return
        self._state = _State.CLOSING
        await self._shutdown()

    async def _shutdown(self) -> None:
        self._state = _State.CLOSING
        try:
            commits = [t.commit for t in self._open.values() if t.commit is not None]
            if commits:
                _, late = await asyncio.wait(commits, timeout=self._close_timeout)
                for task in late:
                    task.cancel()
            for tag in self._open:
                logger.warning("checkpoint %r was saved but never committed; discarded", tag)
        finally:
            try:
                if self._bridge is not None:
                    await self._bridge.aclose()
            finally:
                if self._deletions:
                    await asyncio.wait(self._deletions)
                if self._trash is not None:
                    self._trash.shutdown(wait=True)
                if self._io is not None:
                    for open_tag in list(self._open.values()):
                        await self._rmtree(open_tag.tmpdir)
                    self._open.clear()
                    await asyncio.get_running_loop().run_in_executor(self._io, self._close_slots)
                    self._io.shutdown(wait=True)
                else:
                    self._close_slots()
                self._state = _State.CLOSED

    def _close_slots(self) -> None:
        for slot in self._slots:
            slot.close()

    def _check_running(self) -> None:
        if self._state is not _State.RUNNING:
            raise ClosedError(
                f"this CheckpointEngine is {self._state.value}; use it inside `async with`"
            )

    def _executor(self) -> DaemonThreadExecutor:
        if self._io is None:
            raise ClosedError("this CheckpointEngine was never started")
        return self._io

    async def _rmtree(self, path: Path) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor(), _remove_tree, path)

    # -- save ---------------------------------------------------------------------------

    async def save(self, state: object, name: str, *, tag: str) -> None:
        """Snapshot ``state`` as file ``name`` of checkpoint ``tag``; return once copied.

        ``state`` is any nesting of dict/list/tuple holding tensors and picklable values.
        When this returns, every tensor has been copied into staging memory: the caller
        may mutate or free it at once. The file is written in the background; write
        errors surface from :meth:`commit`. Waits while ``max_pending`` checkpoints are
        staged and not yet durable. Raises :class:`InvalidStateError` naming the key or
        file for bad input, :class:`WorkerDiedError` if the writer died.
        """
        self._check_running()
        name, tag = _validate_name(name), _validate_tag(tag)
        if tag in self._results or tag in self._committed:
            raise InvalidStateError(f"checkpoint {tag!r} is already committed; use a new tag")
        if self._bridge is None:
            return
        self._bridge.check()
        plan = _plan(state, name)
        async with self._save_lock:
            open_tag = self._open.get(tag)
            created = open_tag is None
            if open_tag is None:
                slot = await self._acquire_slot(tag)
                tmpdir = self._directory / f"{_TMP_PREFIX}{tag}-{uuid.uuid4().hex[:8]}"
                open_tag = self._open[tag] = _OpenTag(tag, tmpdir, slot)
                open_tag.idle.set()
            if open_tag.commit is not None:
                raise InvalidStateError(f"checkpoint {tag!r} is being committed; use a new tag")
            if name in open_tag.writes:
                raise InvalidStateError(f"file {name!r} was already saved in checkpoint {tag!r}")
            open_tag.staging += 1
            open_tag.idle.clear()
            try:
                await self._stage_and_send(open_tag, name, plan)
            except BaseException:
                if created and not open_tag.writes:
                    self._release(open_tag)  # nothing reached the writer: free the slot again
                raise
            finally:
                open_tag.staging -= 1
                if open_tag.staging == 0:
                    open_tag.idle.set()

    async def _stage_and_send(self, open_tag: _OpenTag, name: str, plan: _Plan) -> None:
        bridge = self._bridge
        if bridge is None:
            return
        loop = asyncio.get_running_loop()
        # A new segment is reserved and populated page by page (~100 ms per 256 MiB): on
        # the I/O thread, never on the loop. The writer maps it as soon as it exists, even
        # if this save() was cancelled meanwhile, since later saves may use its space.
        allocation = loop.run_in_executor(self._executor(), open_tag.slot.allocate, plan.nbytes)

        def map_new_segment(done: asyncio.Future[tuple[Region, Segment | None]]) -> None:
            if not done.cancelled() and done.exception() is None:
                new_segment = done.result()[1]
                if new_segment is not None:
                    self._map(bridge, new_segment)

        allocation.add_done_callback(map_new_segment)
        region, _ = await asyncio.shield(allocation)
        copy = loop.run_in_executor(self._executor(), _stage, region, plan)
        # Cancelling save() abandons the wait; the copy ends on the I/O thread, which
        # runs the next copy into this slot only after it.
        open_tag.stage_seconds += await asyncio.shield(copy)
        records = tuple(
            TensorRecord(
                region.offset + offset,
                tensor.numel() * tensor.element_size(),
                tensor.dtype,
                tuple(tensor.shape),
                tensor.requires_grad,
            )
            for tensor, offset in zip(plan.tensors, plan.offsets, strict=True)
        )
        message = WriteFile(
            str(open_tag.tmpdir / name), region.segment.path, plan.skeleton, records
        )
        future = bridge.send(WriterOp.WRITE, message)
        future.add_done_callback(_consume)
        open_tag.writes[name] = future

    def _map(self, bridge: Bridge, segment: Segment) -> None:
        def mapped(future: asyncio.Future[Any]) -> None:
            segment.unlink()  # mapped in both processes (or the writer is gone): drop the name
            _consume(future)

        try:
            bridge.send(WriterOp.MAP, MapSegment(segment.path, segment.size)).add_done_callback(
                mapped
            )
        except BaseException:
            segment.unlink()
            raise

    async def _acquire_slot(self, tag: str) -> Slot:
        while not self._free_slots:
            if not any(t.commit is not None for t in self._open.values()):
                raise CheckpointError(
                    f"cannot stage checkpoint {tag!r}: max_pending={len(self._slots)} "
                    f"checkpoints {sorted(self._open)} are staged and none is being "
                    "committed; commit one first or raise max_pending"
                )
            waiter = asyncio.get_running_loop().create_future()
            self._slot_waiters.append(waiter)
            await waiter
        return self._free_slots.pop()

    def _release(self, open_tag: _OpenTag) -> None:
        self._open.pop(open_tag.tag, None)
        open_tag.slot.reset()
        self._free_slots.append(open_tag.slot)
        waiters, self._slot_waiters = self._slot_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    # -- commit -------------------------------------------------------------------------

    async def commit(self, tag: str | None = None) -> CommitResult:
        """Make checkpoint ``tag`` durable and publish it as ``latest``; see the module doc.

        ``tag=None`` commits the single open tag. Cancelling the awaiting task abandons
        the wait only: the commit goes on, and a later ``commit(tag)`` returns its result.
        Raises :class:`InvalidStateError` when nothing was saved under ``tag``,
        :class:`CheckpointError` naming the file when a write failed (the tag is
        discarded, ``latest`` unchanged), :class:`WorkerDiedError` if the writer died.
        """
        self._check_running()
        if self._bridge is None:
            resolved = _validate_tag(tag) if tag is not None else ""
            return CommitResult(resolved, self._directory / resolved, (), 0, 0.0, 0.0, 0.0)
        self._bridge.check()
        if tag is None:
            if len(self._open) != 1:
                raise InvalidStateError(
                    f"commit() without a tag needs exactly one open checkpoint; open: "
                    f"{sorted(self._open)}"
                )
            tag = next(iter(self._open))
        tag = _validate_tag(tag)
        if tag in self._results:
            return self._results[tag]
        open_tag = self._open.get(tag)
        if open_tag is None:
            raise InvalidStateError(f"nothing was saved under tag {tag!r}; nothing to commit")
        if open_tag.commit is None:
            open_tag.commit = asyncio.create_task(self._commit(open_tag, self._last_commit))
            open_tag.commit.add_done_callback(_consume)
            self._last_commit = open_tag.commit
        return await asyncio.shield(open_tag.commit)

    async def _commit(
        self, open_tag: _OpenTag, previous: asyncio.Task[CommitResult] | None
    ) -> CommitResult:
        bridge, io_ = self._bridge, self._executor()
        if bridge is None:
            raise ClosedError("a replica engine commits nothing")
        started = time.perf_counter()
        tag, published = open_tag.tag, False
        try:
            if previous is not None and not previous.done():
                await asyncio.wait([previous])  # publish in commit order; its errors are its own
            await open_tag.idle.wait()
            if not open_tag.writes:
                raise InvalidStateError(f"nothing was saved under tag {tag!r}; nothing to commit")
            records: dict[str, FileRecord] = {}
            for name, future in open_tag.writes.items():
                try:
                    records[name] = await future
                except RemoteError as exc:
                    raise CheckpointError(
                        f"could not write {name!r} of checkpoint {tag!r} to "
                        f"{open_tag.tmpdir / name}: {exc.remote_message}; the checkpoint is "
                        f"discarded, {LATEST!r} still names {self._latest!r}"
                    ) from exc
            await bridge.request(WriterOp.SYNC, SyncTree(str(open_tag.tmpdir)))
            try:
                await self._publish(open_tag, records)
                published = True
            except OSError as exc:
                raise CheckpointError(
                    f"could not publish checkpoint {tag!r} in {self._directory}: {exc}; "
                    f"{LATEST!r} still names {self._latest!r}"
                ) from exc
            total = sum(record.nbytes for record in records.values())
            result = CommitResult(
                tag=tag,
                path=self._directory / tag,
                files=tuple(records),
                bytes=total,
                stage_seconds=open_tag.stage_seconds,
                write_seconds=sum(record.seconds for record in records.values()),
                commit_seconds=time.perf_counter() - started,
            )
            self._results[tag] = result
            logger.info(
                "checkpoint %s committed: %d files, %.3f GB, staged in %.3f s, written in "
                "%.3f s (%.2f GB/s), commit %.3f s",
                tag,
                len(records),
                total / 1e9,
                result.stage_seconds,
                result.write_seconds,
                result.write_gb_per_second,
                result.commit_seconds,
            )
        finally:
            self._release(open_tag)
            if not published:
                await self._rmtree(open_tag.tmpdir)
        await self._retain(io_)
        return result

    async def _publish(self, open_tag: _OpenTag, records: dict[str, FileRecord]) -> None:
        io_, directory, tag = self._executor(), self._directory, open_tag.tag
        manifest = {
            "format": _FORMAT,
            "tag": tag,
            "sequence": self._sequence + 1,
            "created": time.time(),
            "files": {
                name: {"bytes": record.nbytes, "xxh3_64": record.xxh3_64}
                for name, record in records.items()
            },
        }
        await self._write_durably(open_tag.tmpdir / MANIFEST, json.dumps(manifest, indent=1))
        await self._fsync(open_tag.tmpdir)
        await aiofiles.os.rename(open_tag.tmpdir, directory / tag, executor=io_)
        await self._fsync(directory)
        self._sequence += 1
        self._committed.append(tag)
        pointer = directory / f".{LATEST}.tmp"
        await self._write_durably(pointer, tag + "\n")
        await aiofiles.os.replace(pointer, directory / LATEST, executor=io_)
        await self._fsync(directory)
        self._latest = tag

    async def _write_durably(self, path: Path, text: str) -> None:
        file = await aiofiles.open(path, "w", encoding="utf-8", executor=self._executor())
        try:
            await file.write(text)
            await file.flush()
            if self._durable:
                await asyncio.get_running_loop().run_in_executor(
                    self._executor(), os.fsync, file.fileno()
                )
        finally:
            await file.close()

    async def _fsync(self, path: Path) -> None:
        if self._durable:
            await asyncio.get_running_loop().run_in_executor(self._executor(), _fsync_path, path)

    async def _retain(self, io_: DaemonThreadExecutor) -> None:
        if self._keep_last is None:
            return
        while len(self._committed) > self._keep_last:
            tag = self._committed.pop(0)
            self._results.pop(tag, None)
            trash = self._directory / f"{_TRASH_PREFIX}{tag}-{uuid.uuid4().hex[:8]}"
            try:
                # Renamed first, so a crash mid-delete never leaves a half tag listed.
                await aiofiles.os.rename(self._directory / tag, trash, executor=io_)
            except OSError:
                logger.exception("retention could not delete checkpoint %r; left in place", tag)
                continue
            # Deleting GiBs takes a while: on its own thread, off commit()'s path and off the
            # I/O thread that stages the next save(); aclose() waits for it.
            if self._trash is None:
                self._trash = DaemonThreadExecutor("aoffload-checkpoint-trash")
            deletion = asyncio.get_running_loop().run_in_executor(self._trash, _remove_tree, trash)
            self._deletions.add(deletion)
            deletion.add_done_callback(self._deleted)

    def _deleted(self, deletion: asyncio.Future[None]) -> None:
        self._deletions.discard(deletion)
        if not deletion.cancelled() and deletion.exception() is not None:
            logger.error(
                "retention could not delete an old checkpoint; a later start removes it",
                exc_info=deletion.exception(),
            )

    # -- load ---------------------------------------------------------------------------

    async def load(
        self,
        name: str,
        *,
        tag: str | None = None,
        map_location: MapLocation = "cpu",
        verify: bool = True,
    ) -> Any:
        """Load file ``name`` of committed checkpoint ``tag`` (default: the newest).

        Verified against the manifest (``CorruptCheckpointError`` naming the file on a
        mismatch), loaded with ``weights_only=True`` off the event loop.
        """
        self._check_running()
        return await _load(self._directory, name, tag, map_location, verify, self._executor())


def _remove_tree(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
