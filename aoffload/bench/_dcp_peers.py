"""The systems the ``dcp`` section measures, as each runs inside one rank.

Every peer saves the rank's state under a fresh ``path`` in three timed parts: the call,
the fence the trainer waits on after its step before it may change the state again, and
the wait until the checkpoint is durable (every file and the directory entries that
publish it fsynced, on this rank). :class:`Save` holds the last two. Where a peer does
not fsync what it wrote, the bench does before counting it durable, and each peer's
:attr:`note` says what the bench added.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

__all__ = [
    "AOFFLOAD_DCP",
    "AOFFLOAD_DCP_CAPPED",
    "AOFFLOAD_DCP_FACE",
    "AOFFLOAD_ENGINE",
    "AoffloadDcp",
    "AoffloadDcpFace",
    "aoffload_dcp_name",
    "DCP_BLOCKING",
    "TORCH_CHECKPOINTING",
    "AoffloadEngine",
    "DcpAsync",
    "DcpBlocking",
    "dcp_async_name",
    "Peer",
    "Save",
    "TorchCheckpointing",
    "fsync_tree",
]

logger = logging.getLogger(__name__)

AOFFLOAD_ENGINE = "aoffload CheckpointEngine (its own torch.save files: a reference, not DCP)"
AOFFLOAD_DCP = "aoffload.dcp (Stager + StorageWriter)"
"""The start of the labels of aoffload's DCP route (its DCP mode follows)."""
AOFFLOAD_DCP_FACE = "aoffload.dcp, engine.dcp.async_save (DCP's save on the face's thread)"
AOFFLOAD_DCP_CAPPED = (
    "aoffload.dcp, engine.dcp.async_save through staging_bytes = a quarter of the state"
)
DCP_BLOCKING = "DCP save, FileSystemWriter (blocking)"
TORCH_CHECKPOINTING = "torch_checkpointing"
"""The start of torch_checkpointing's label (its version and writes follow)."""


def _nothing() -> None:
    return None


def _fsync(path: Path, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path, *, files: bool) -> None:
    """fsync ``path``'s directories (with ``files``, every file too) and its parent."""
    for folder, _, names in os.walk(path):
        if files:
            for name in names:
                _fsync(Path(folder) / name)
        _fsync(Path(folder), os.O_RDONLY | os.O_DIRECTORY)
    _fsync(path.parent, os.O_RDONLY | os.O_DIRECTORY)


@dataclass(frozen=True)
class Save:
    """A save under way: ``fence()`` returns once the trainer may change the state again,
    ``durable()`` once the checkpoint is durable on this rank."""

    fence: Callable[[], None]
    durable: Callable[[], None]


class Peer(Protocol):
    """One system: ``save(path)`` is the timed call; ``close()`` ends it."""

    name: str
    note: str

    def save(self, path: Path) -> Save: ...

    def close(self) -> None: ...


class DcpBlocking:
    """``dcp.save`` with its ``FileSystemWriter``: the trainer waits for all of it."""

    note = (
        "FileSystemWriter fsyncs each file; the bench fsyncs the checkpoint's directory "
        "and its parent (the rename that publishes .metadata)"
    )

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.name = DCP_BLOCKING
        self.state = state

    def save(self, path: Path) -> Save:
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import save

        save(self.state, storage_writer=FileSystemWriter(path, sync_files=True))
        fsync_tree(path, files=False)
        return Save(_nothing, _nothing)

    def close(self) -> None:
        return None


def dcp_async_name(process: bool, shared: bool | None, cuda: bool) -> str:
    """The label of :class:`DcpAsync` in these modes."""
    mode = "PROCESS" if process else "THREAD"
    if shared is None:
        return f"DCP async_save {mode}, no stager (copies in the call)"
    parts = ["async staging"]
    parts += ["shared memory"] if shared else []
    parts += ["pinned memory, non-blocking copies"] if cuda else []
    return f"DCP async_save {mode}, DefaultStager ({', '.join(parts)})"


class DcpAsync:
    """``dcp.async_save`` in THREAD or PROCESS mode, with a ``DefaultStager`` or none.

    ``shared=None`` passes no stager: ``async_save`` then copies the state in the call
    (its default). Otherwise one ``DefaultStager`` with async staging serves every save of
    the block (its staging buffers are kept between saves, as DCP intends); pinned memory
    and non-blocking copies are used where CUDA is (DCP refuses them without it).

    Another system on DCP's route (aoffload.dcp's) passes its own ``stager`` and ``writer``
    (a ``StorageWriter`` per save path, else DCP's ``FileSystemWriter`` through
    ``checkpoint_id``), its ``name`` and its ``note``.
    """

    note = DcpBlocking.note

    def __init__(
        self,
        state: dict[str, torch.Tensor],
        process: bool,
        shared: bool | None,
        *,
        stager: Any = None,
        writer: Callable[[Path], Any] | None = None,
        name: str = "",
        note: str = "",
    ) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.kind = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
        self.state = state
        self.stager = stager
        self.writer = writer
        self.note = note or DcpBlocking.note
        cuda = torch.cuda.is_available()
        self.name = name or dcp_async_name(process, shared, cuda)
        if stager is None and shared is not None:
            self.stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda,
                    use_shared_memory=shared,
                    use_async_staging=True,
                    use_non_blocking_copy=cuda,
                )
            )

    def save(self, path: Path) -> Save:
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save

        response = async_save(
            self.state,
            checkpoint_id=None if self.writer else str(path),
            storage_writer=self.writer(path) if self.writer else None,
            async_checkpointer_type=self.kind,
            async_stager=self.stager,
        )
        if isinstance(response, AsyncSaveResponse):
            fence: Callable[[], None] = response.staging_completion.result
            upload = response.upload_completion
        else:
            fence, upload = _nothing, response

        def durable() -> None:
            upload.result()
            fsync_tree(path, files=False)

        return Save(fence, durable)

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()


class TorchCheckpointing:
    """``torch_checkpointing``'s ``CheckpointManager`` (async saver, its defaults).

    Its fence is ``manager.lock()``, the guard it documents for the trainer's next change
    of the state. It never fsyncs: the bench fsyncs every file and directory of the
    checkpoint before counting it durable.
    """

    def __init__(self, state: dict[str, torch.Tensor], direct_io: bool) -> None:
        import torch_checkpointing
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        self.version = getattr(torch_checkpointing, "__version__", "?")
        writes = "O_DIRECT writes" if direct_io else "buffered writes: its O_DIRECT fails here"
        self.name = f"{TORCH_CHECKPOINTING} {self.version} CheckpointManager (async, {writes})"
        self.note = "it never fsyncs: the bench fsyncs every file and directory it wrote"
        config = torch_checkpointing.CheckpointManager.Config(
            storage_config=LocalFileSystemStorageConfig(use_direct_io=direct_io)
        )
        self.state = state
        self.manager = torch_checkpointing.CheckpointManager(config)

    def save(self, path: Path) -> Save:
        future = self.manager.save(str(path), {"model": self.state})

        def fence() -> None:
            with self.manager.lock():
                pass

        def durable() -> None:
            if future is not None:
                future.result()
            fsync_tree(path, files=True)

        return Save(fence, durable)

    def close(self) -> None:
        self.manager.close()


async def _call(function: Callable[[], Any]) -> Any:
    return function()


async def _wait(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


class AoffloadEngine:
    """aoffload's engine on its own format (one ``torch.save`` file per rank), driven by a
    synchronous trainer: ``stage()``, the fence, ``commit()`` (fsynced and published by
    the engine itself). A reference until ``aoffload.dcp`` runs here."""

    note = "the engine fsyncs every file and directory itself"

    def __init__(self, state: dict[str, torch.Tensor], root: Path, rank: int) -> None:
        import aoffload

        self.name = AOFFLOAD_ENGINE
        self.state, self.rank = state, rank
        self.loop = asyncio.new_event_loop()
        self.engine = aoffload.CheckpointEngine(root, distributed=True, keep_last=1)
        self._run(self.engine.astart())

    def _run(self, awaitable: Awaitable[Any]) -> Any:
        return self.loop.run_until_complete(_wait(awaitable))

    def save(self, path: Path) -> Save:
        tag = path.name
        name = f"shard-{self.rank}.pt"
        staged = self._run(_call(lambda: self.engine.stage(self.state, name, tag=tag)))
        return Save(lambda: self._run(staged), lambda: self._run(self.engine.commit(tag)))

    def close(self) -> None:
        try:
            self._run(self.engine.aclose())
        finally:
            with contextlib.suppress(RuntimeError):
                self.loop.close()


def aoffload_dcp_name(process: bool) -> str:
    """The label of :class:`AoffloadDcp` in this DCP mode."""
    return f"{AOFFLOAD_DCP}, DCP async_save {'PROCESS' if process else 'THREAD'}"


class AoffloadDcp:
    """aoffload's DCP route: ``dcp.async_save`` with aoffload's ``Stager`` and a
    ``StorageWriter`` through a distributed engine on ``root`` (a synchronous trainer: the
    engine's ``with`` face). Its fence is DCP's ``staging_completion``, durable its
    ``upload_completion``: the tag published on every rank, ``latest`` moved."""

    note = (
        "the engine fsyncs every file and directory itself (the bench adds nothing); each "
        "save publishes a tag and moves latest"
    )

    def __init__(self, state: dict[str, torch.Tensor], root: Path, process: bool) -> None:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        import aoffload
        from aoffload.dcp import Stager

        self.name = aoffload_dcp_name(process)
        self.state = state
        self.kind = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
        self.engine = aoffload.CheckpointEngine(root, distributed=True, keep_last=1)
        self.engine.start()
        self.stager = Stager()

    def save(self, path: Path) -> Save:
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save

        from aoffload.dcp import StorageWriter

        writer = StorageWriter(self.engine.directory, tag=path.name, engine=self.engine)
        response = async_save(
            self.state,
            storage_writer=writer,
            async_checkpointer_type=self.kind,
            async_stager=self.stager,
        )
        if not isinstance(response, AsyncSaveResponse):  # pragma: no cover - Stager's future
            raise TypeError("aoffload's Stager staged synchronously")
        completion = response.staging_completion
        upload = response.upload_completion
        return Save(lambda: completion.result(), lambda: upload.result())

    def close(self) -> None:
        try:
            self.stager.close()
        finally:
            self.engine.close()


class AoffloadDcpFace:
    """aoffload's DCP route as the engine's face: ``engine.dcp.async_save`` (the same
    Stager and StorageWriter, DCP's ``save`` on the face's long-lived thread); with
    ``staging_bytes``, an engine capped below the state, through which it streams."""

    note = AoffloadDcp.note

    def __init__(
        self, state: dict[str, torch.Tensor], root: Path, staging_bytes: int | None = None
    ) -> None:
        import aoffload

        self.name = AOFFLOAD_DCP_FACE if staging_bytes is None else AOFFLOAD_DCP_CAPPED
        if staging_bytes is not None:
            self.note = (
                f"{AoffloadDcp.note}; the engine's staging_bytes is {staging_bytes / 2**20:.0f} "
                "MiB: the state streams through it in waves, a file each"
            )
        self.state = state
        self.engine = aoffload.CheckpointEngine(
            root, distributed=True, keep_last=1, staging_bytes=staging_bytes
        )
        self.engine.start()

    def save(self, path: Path) -> Save:
        response = self.engine.dcp.async_save(self.state, checkpoint_id=path.name)
        staged, upload = response.staging_completion, response.upload_completion

        def durable() -> None:
            upload.result()

        return Save(staged.result, durable)

    def close(self) -> None:
        self.engine.close()
