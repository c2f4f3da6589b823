"""DeepSpeed's ``CheckpointEngine`` interface, backed by aoffload's checkpoint engine.

:class:`AsyncCheckpointEngine` drives :class:`aoffload.CheckpointEngine` through its
synchronous face, from DeepSpeed's thread: no event loop anywhere. The copy, the writes
and the commits run on the engine's threads and writer process; the adapter's methods only
hand work over and, at the fence, wait on handles (``.result()``). :func:`install` puts it
on a ``DeepSpeedEngine``. See ``docs/deepspeed.md`` for how to install it and why
``latest`` stays truthful.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
)
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointEngine as _DeepSpeedCheckpointEngine,
)

from .. import AoffloadError, CheckpointEngine, CheckpointError, ClosedError, Handle, Staged
from ._inflight import CommitsInFlight
from ._load import load_verified

__all__ = ["AsyncCheckpointEngine", "install"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class _Open:
    """The checkpoint between ``create()`` and ``commit()``."""

    info: CheckpointCommitInfo
    files: int = 0
    staged: list[Staged] = dataclasses.field(default_factory=list)


def _name_in(opened: _Open | None, path: str) -> str | None:
    """``name`` when ``path`` is ``save_dir/<tag>/<name>`` of the ``opened`` checkpoint."""
    if opened is None:
        return None
    info = opened.info
    relative = os.path.relpath(os.path.abspath(path), os.path.abspath(info.save_dir))
    tag, _, name = relative.partition(os.sep)
    return name if tag == info.tag else None


def _fence(staged: list[Staged]) -> None:
    """Block until every copy of ``staged`` has ended and passed the fence's check; raise
    the first failure (once)."""
    for copy in staged:
        copy.result()


class AsyncCheckpointEngine(_DeepSpeedCheckpointEngine):  # type: ignore[misc]
    """DeepSpeed decoupled checkpoint engine backed by :class:`aoffload.CheckpointEngine`.

    ``save()`` only *starts* the snapshot copy into staging memory and returns, so the copy
    overlaps the next forward and backward. DeepSpeed calls ``commit()`` at the next step
    boundary, before the optimizer step: it waits for that copy to end (the fence: the
    optimizer never touches memory still being copied), then starts aoffload's commit and
    returns, so the trainer keeps stepping while the files are written and fsynced. Until that
    ``step()``, the saved tensors must not be modified in place (forward and backward do not
    modify parameters or optimizer state); a modification is caught (``CheckpointError``
    naming the key) rather than written torn. aoffload publishes the
    tag and moves ``save_dir/latest`` (the plain-text file DeepSpeed reads) only once the
    checkpoint is durable; ``get_commit_info()`` hands DeepSpeed ``save_latest=False`` so
    DeepSpeed never writes ``latest`` early. A failed background commit is raised from the next
    call (``save_checkpoint``, ``step``, :meth:`wait`, ``cleanup``).

    ``directory`` is DeepSpeed's ``save_dir``; DeepSpeed's ``save_dir/<tag>/<file>`` paths map
    onto aoffload's ``directory``, ``tag`` and ``name``. Without ``directory`` the engine binds to
    the first ``save_dir`` it sees. The other keyword arguments go to
    :class:`aoffload.CheckpointEngine`. ``writer=False`` makes a data-parallel replica that writes
    nothing.

    On several ranks (``distributed=None``: whenever ``torch.distributed`` runs with more than
    one rank) every rank's engine takes part in one commit per tag (``distributed=True`` of
    :class:`aoffload.CheckpointEngine`): the tag and ``latest`` are published once every rank's
    files are durable. ``commit_timeout`` bounds the wait for a rank that never reports, and
    also how long :meth:`wait`, ``load()`` and :meth:`cleanup` wait for commits in flight.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        keep_last: int | None = None,
        max_pending: int = 1,
        writer: bool = True,
        durable: bool = True,
        start_timeout: float = 60.0,
        distributed: bool | None = None,
        commit_timeout: float = 300.0,
        config_params: object = None,
    ) -> None:
        super().__init__(config_params)
        self.name = "aoffload.AsyncCheckpointEngine"
        self._options: dict[str, Any] = {
            "keep_last": keep_last,
            "max_pending": max_pending,
            "writer": writer,
            "durable": durable,
            "start_timeout": start_timeout,
            # DeepSpeed loads its checkpoints with weights_only=False (load() below)
            "unloadable": "ignore",
        }
        if distributed is None:
            distributed = dist.is_initialized() and dist.get_world_size() > 1
        if distributed:
            self._options.update(distributed=True, commit_timeout=commit_timeout)
        self._distributed = distributed
        self._writer = writer
        self._directory: str | None = None
        self._engines: dict[str, CheckpointEngine] = {}
        self._open: _Open | None = None
        self._commits = CommitsInFlight(commit_timeout)
        self._closed = False
        if directory is not None and (writer or distributed):  # a collective when distributed
            self._bind(os.fspath(directory))

    # -- helpers ---------------------------------------------------------------------------

    @property
    def directory(self) -> str | None:
        """The first ``save_dir`` this engine writes to (``directory``, if given)."""
        return self._directory

    @property
    def pid(self) -> int | None:
        """The process id of the writer for :attr:`directory` while it runs, else ``None``."""
        engine = self._engines.get(self._directory) if self._directory is not None else None
        return None if engine is None else engine.pid

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the AsyncCheckpointEngine was cleaned up")

    def _bind(self, directory: str) -> CheckpointEngine:
        """The aoffload engine (one writer process) for ``directory``, started on first use."""
        directory = os.path.abspath(directory)
        engine = self._engines.get(directory)
        if engine is None:
            os.makedirs(directory, exist_ok=True)
            engine = CheckpointEngine(directory, **self._options)
            engine.start()
            self._engines[directory] = engine
            if self._directory is None:
                self._directory = directory
            logger.debug("checkpoint writer started for %s (pid %s)", directory, engine.pid)
        return engine

    def _start_commit(self, opened: _Open) -> None:
        if opened.files == 0 and not self._distributed:
            # Nothing of this tag went through aoffload (a replica, or only plain exports).
            return
        info = opened.info
        engine = self._bind(info.save_dir)
        # The fence: every copy of this tag has ended before DeepSpeed's optimizer step.
        _fence(opened.staged)
        # Distributed: every rank takes part in every commit, with or without files.
        # aoffload publishes tags in commit order and moves `latest` (the same plain-text
        # file DeepSpeed reads) only once the tag is durable (on every rank, if distributed).
        commit = engine.commit(info.tag, latest=info.save_latest)
        commit.add_done_callback(_log_durable)  # its failure is the adapter's to raise
        self._commits.add(info.tag, commit)

    # -- DeepSpeed's CheckpointEngine interface ---------------------------------------------

    def create(self, info: CheckpointCommitInfo) -> None:
        """Begin checkpoint ``info.tag`` in ``info.save_dir``."""
        self._check_open()
        self._commits.raise_failed()
        if self._open is not None and self._open.info != info:
            # save_checkpoint() twice without a step in between: commit the first one now.
            opened, self._open = self._open, None
            self._start_commit(opened)
        self._open = _Open(info)
        if self._distributed:
            self._bind(info.save_dir)  # every rank calls create(): the start is a collective

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """Create ``path``, except the open tag's directory, which aoffload publishes."""
        if _name_in(self._open, os.path.join(path, "")) is not None:
            return
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: object, path: str) -> None:
        """Start snapshotting ``state_dict`` for ``path``; returns before the copy ends.

        The writer for ``save_dir`` starts on the first save there. Paths outside
        ``save_dir/<tag>/`` (``save_16bit_model`` exports) are written at once with
        ``torch.save``, as DeepSpeed's default engine does.
        """
        self._check_open()
        self._commits.raise_failed()
        name = _name_in(self._open, path)
        if not self._writer and self._distributed and name:
            raise CheckpointError(
                f"DeepSpeed asked rank {dist.get_rank()} to save {path}, but its engine is a "
                "replica (writer=False) and would drop it; with ZeRO stages >= 1 every rank "
                "saves its own optimizer shard, so every rank must be a writer"
            )
        if not self._writer:
            return
        if self._open is None or not name:
            logger.debug("%s is outside any open tag; writing it synchronously", path)
            torch.save(state_dict, path)
            return
        engine = self._bind(self._open.info.save_dir)
        self._open.staged.append(engine.stage(state_dict, name, tag=self._open.info.tag))
        self._open.files += 1

    def load(self, path: str, map_location: Any = None) -> Any:
        """Load ``path`` once every commit still in flight is durable, safely.

        The file must belong to a committed aoffload tag: it is checked against the tag's
        manifest (``CorruptCheckpointError`` naming it on a mismatch), then loaded with
        ``torch.load(weights_only=True)``, DeepSpeed's own checkpoint classes allowed
        (:data:`~._load.DEEPSPEED_SAFE_GLOBALS`), never with ``weights_only=False``.
        Objects of yours in ``client_state`` need ``torch.serialization.add_safe_globals``.
        """
        self._check_open()
        self.wait()
        return load_verified(path, map_location, self._engines)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Wait for the tag's snapshot copy, start its commit, return; durable in the background.

        DeepSpeed calls this at the step boundary after ``save_checkpoint()``, before the
        optimizer step; the trainer waits for the copy (the fence), never for the disk.
        ``latest`` is updated only once the checkpoint is durable.
        """
        self._check_open()
        self._commits.raise_failed()
        opened = self._open
        if opened is None or info.tag != opened.info.tag or info.save_dir != opened.info.save_dir:
            raise CheckpointError(f"commit({info}) does not match the open checkpoint {opened}")
        self._open = None
        self._start_commit(opened)
        return True

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        """Whether data-parallel rank ``dp_rank`` writes the replicated (non-ZeRO) state."""
        return self._writer and dp_rank == 0

    def is_decoupled(self) -> bool:
        """Always true: DeepSpeed commits at the next step boundary."""
        return True

    def get_commit_info(self) -> CheckpointCommitInfo | None:
        """The open checkpoint for DeepSpeed to commit, with ``save_latest=False``.

        DeepSpeed writes ``latest`` itself right after ``commit()`` returns; since ``commit()``
        returns before the checkpoint is durable, this engine keeps that write to itself.
        """
        self._check_open()
        self._commits.raise_failed()
        if self._open is None:
            return None
        return dataclasses.replace(self._open.info, save_latest=False)

    def preserves_storage_sharing(self) -> bool:
        """False: aoffload's snapshot already copies each tensor, so DeepSpeed need not clone."""
        return False

    def wait(self) -> None:
        """Block until every started commit is durable and published; raise the first failure.

        Waits at most ``commit_timeout`` seconds in all, then raises :class:`CheckpointError`
        naming the checkpoint still in flight (its commit goes on in the background).
        """
        self._check_open()
        self._commits.wait(self._directory, distributed=self._distributed)

    def cleanup(self) -> None:
        """Commit the open checkpoint, wait until durable, and stop the writer; idempotent."""
        if self._closed:
            return
        try:
            if self._open is not None:
                opened, self._open = self._open, None
                self._start_commit(opened)
            self.wait()
        finally:
            self._closed = True
            self._close_engines()

    def _close_engines(self) -> None:
        engines, self._engines = list(self._engines.values()), {}
        failures: list[AoffloadError] = []
        for engine in engines:
            try:
                engine.close()
            except AoffloadError as exc:  # close the others, then raise the first
                logger.error("closing the checkpoint writer for %s failed", engine.directory)
                failures.append(exc)
        if failures:
            raise failures[0]


def _log_durable(commit: Handle[Any]) -> None:
    if commit.exception() is None:
        result = commit.result()
        logger.info("checkpoint %s is durable (%d bytes)", result.tag, result.bytes)


def install(
    engine: Any, directory: str | os.PathLike[str] | None = None, **options: Any
) -> AsyncCheckpointEngine:
    """Put an :class:`AsyncCheckpointEngine` on a ``DeepSpeedEngine`` and return it.

    DeepSpeed 0.19 builds its checkpoint engine from the config and has no hook for a custom
    one, so this assigns the engine's public ``checkpoint_engine`` attribute, after cleaning up
    the engine it replaces. Call it right after ``deepspeed.initialize``; ``options`` go to
    :class:`AsyncCheckpointEngine`.
    """
    new = AsyncCheckpointEngine(
        directory, config_params=getattr(engine, "_config", None), **options
    )
    old = getattr(engine, "checkpoint_engine", None)
    try:
        if old is not None:
            old.cleanup()
    except BaseException:
        new.cleanup()
        raise
    engine.checkpoint_engine = new
    return new
