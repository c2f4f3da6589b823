"""DeepSpeed adapters: aoffload's workers behind DeepSpeed's synchronous interfaces.

Import this module explicitly (``import aoffload.deepspeed``); ``import aoffload`` never imports
DeepSpeed. Both adapters own a private event loop on a daemon thread (a *portal*): their
synchronous methods submit coroutines to it and re-raise aoffload's exceptions in the caller's
thread. See ``docs/deepspeed.md`` for how to install them and why ``latest`` stays truthful.

- :class:`AsyncCheckpointEngine` is a DeepSpeed ``CheckpointEngine`` backed by
  :class:`aoffload.CheckpointEngine`; :func:`install` puts it on a ``DeepSpeedEngine``.
- :class:`SuperOffloadCPUOptimizer` is a drop-in for DeepSpeed's class of that name backed by
  :class:`aoffload.CPUAdam`; :func:`install_superoffload` puts it under a SuperOffload stage-3
  optimizer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import queue
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
)
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointEngine as _DeepSpeedCheckpointEngine,
)
from deepspeed.runtime.superoffload.superoffload_utils import EventTypes, ResultKeys, TaskKeys

from . import CheckpointEngine, CommitResult, CPUAdam, StepKind, StepResult
from ._errors import (
    AoffloadError,
    CheckpointError,
    ClosedError,
    OptimizerError,
    RemoteError,
    WorkerDiedError,
)
from ._portal import Portal

logger = logging.getLogger(__name__)

__all__ = (
    "AsyncCheckpointEngine",
    "SuperOffloadCPUOptimizer",
    "install",
    "install_superoffload",
)


@dataclasses.dataclass(slots=True)
class _Open:
    """The checkpoint between ``create()`` and ``commit()``."""

    info: CheckpointCommitInfo
    files: int = 0


class AsyncCheckpointEngine(_DeepSpeedCheckpointEngine):  # type: ignore[misc]
    """DeepSpeed decoupled checkpoint engine backed by :class:`aoffload.CheckpointEngine`.

    ``save()`` returns once the state is snapshotted into staging memory. DeepSpeed calls
    ``commit()`` at the next step boundary; it only *starts* aoffload's commit and returns, so
    the trainer keeps stepping while the files are written and fsynced. aoffload publishes the
    tag and moves ``save_dir/latest`` (the plain-text file DeepSpeed reads) only once the
    checkpoint is durable; ``get_commit_info()`` hands DeepSpeed ``save_latest=False`` so
    DeepSpeed never writes ``latest`` early. A failed background commit is raised from the next
    call (``save_checkpoint``, ``step``, :meth:`wait`, ``cleanup``).

    ``directory`` is DeepSpeed's ``save_dir``; DeepSpeed's ``save_dir/<tag>/<file>`` paths map
    onto aoffload's ``directory``, ``tag`` and ``name``. Without ``directory`` the engine binds to
    the first ``save_dir`` it sees. The other keyword arguments go to
    :class:`aoffload.CheckpointEngine`. ``writer=False`` makes a data-parallel replica that writes
    nothing.
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
        }
        self._writer = writer
        self._directory: str | None = None
        self._engines: dict[str, CheckpointEngine] = {}
        self._open: _Open | None = None
        self._commits: list[concurrent.futures.Future[CommitResult]] = []
        self._closed = False
        self._portal = Portal("deepspeed-checkpoint")
        if directory is not None and writer:
            try:
                self._bind(os.fspath(directory))
            except BaseException:
                self._portal.close()
                raise

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
            self._portal.call(engine.__aenter__())
            self._engines[directory] = engine
            if self._directory is None:
                self._directory = directory
            logger.debug("checkpoint writer started for %s (pid %s)", directory, engine.pid)
        return engine

    def _raise_failed(self) -> None:
        """Re-raise (once) the error of a background commit that has finished badly."""
        for future in list(self._commits):
            if future.done() and not future.cancelled() and future.exception() is not None:
                self._commits.remove(future)
                future.result()
        self._commits = [future for future in self._commits if not future.done()]

    def _in_open_tag(self, path: str) -> str | None:
        """``name`` when ``path`` is ``save_dir/<tag>/<name>`` of the open checkpoint."""
        if self._open is None:
            return None
        info = self._open.info
        relative = os.path.relpath(os.path.abspath(path), os.path.abspath(info.save_dir))
        tag, _, name = relative.partition(os.sep)
        return name if tag == info.tag else None

    @staticmethod
    async def _commit(engine: CheckpointEngine, tag: str) -> CommitResult:
        # aoffload publishes tags in commit order and moves `latest` (the same plain-text file
        # DeepSpeed reads) only once the tag is durable.
        result = await engine.commit(tag)
        logger.info("checkpoint %s is durable (%d bytes)", tag, result.bytes)
        return result

    def _start_commit(self, opened: _Open) -> None:
        if opened.files == 0:
            # Nothing of this tag went through aoffload (a replica, or only plain exports).
            return
        engine = self._bind(opened.info.save_dir)
        self._commits.append(self._portal.submit(self._commit(engine, opened.info.tag)))

    # -- DeepSpeed's CheckpointEngine interface ---------------------------------------------

    def create(self, info: CheckpointCommitInfo) -> None:
        """Begin checkpoint ``info.tag`` in ``info.save_dir``."""
        self._check_open()
        self._raise_failed()
        if self._open is not None and self._open.info != info:
            # save_checkpoint() twice without a step in between: commit the first one now.
            opened, self._open = self._open, None
            self._start_commit(opened)
        self._open = _Open(info)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """Create ``path``, except the open tag's directory, which aoffload publishes."""
        if self._in_open_tag(os.path.join(path, "")) is not None:
            return
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: object, path: str) -> None:
        """Snapshot ``state_dict`` for ``path``; returns before anything is written to disk.

        The writer for ``save_dir`` starts on the first save there. Paths outside
        ``save_dir/<tag>/`` (``save_16bit_model`` exports) are written at once with
        ``torch.save``, as DeepSpeed's default engine does.
        """
        self._check_open()
        self._raise_failed()
        if not self._writer:
            return
        name = self._in_open_tag(path)
        if self._open is None or not name:
            logger.debug("%s is outside any open tag; writing it synchronously", path)
            torch.save(state_dict, path)
            return
        engine = self._bind(self._open.info.save_dir)
        self._portal.call(engine.save(state_dict, name, tag=self._open.info.tag))
        self._open.files += 1

    def load(self, path: str, map_location: Any = None) -> Any:
        """Load ``path`` with ``torch.load`` after any commit still in flight is durable."""
        self._check_open()
        self.wait()
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Start committing ``info.tag`` and return at once; it becomes durable in the background.

        DeepSpeed calls this at the step boundary after ``save_checkpoint()``; the trainer does
        not wait for the disk. ``latest`` is updated only once the checkpoint is durable.
        """
        self._check_open()
        self._raise_failed()
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
        self._raise_failed()
        if self._open is None:
            return None
        return dataclasses.replace(self._open.info, save_latest=False)

    def preserves_storage_sharing(self) -> bool:
        """False: aoffload's snapshot already copies each tensor, so DeepSpeed need not clone."""
        return False

    def wait(self) -> None:
        """Block until every started commit is durable and published; raise the first failure."""
        self._check_open()
        while self._commits:
            future = self._commits[0]
            try:
                future.result()
            finally:
                if future.done():
                    self._commits.remove(future)

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
            try:
                self._close_engines()
            finally:
                self._portal.close()

    def _close_engines(self) -> None:
        engines, self._engines = list(self._engines.values()), {}
        failures: list[AoffloadError] = []
        for engine in engines:
            try:
                self._portal.call(engine.aclose())
            except AoffloadError as exc:  # close the others, then raise the first
                logger.error("closing the checkpoint writer for %s failed", engine.directory)
                failures.append(exc)
        if failures:
            raise failures[0]


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


_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad")


def _param_groups(optimizer_config: object) -> list[dict[str, Any]]:
    configs = optimizer_config if isinstance(optimizer_config, Sequence) else [optimizer_config]
    groups = []
    for index, config in enumerate(configs):
        if not isinstance(config, Mapping):
            raise OptimizerError(f"optimizer_config[{index}] must be a mapping, got {config!r}")
        missing = [key for key in _GROUP_KEYS if key not in config]
        if missing:
            raise OptimizerError(f"optimizer_config[{index}] lacks required keys {missing}")
        groups.append({key: config[key] for key in _GROUP_KEYS})
    if not groups:
        raise OptimizerError("optimizer_config holds no parameter group")
    return groups


def _as_result(result: StepResult) -> dict[str, Any]:
    event = EventTypes.ROLLBACK if result.kind is StepKind.ROLLBACK else EventTypes.ADAM_STEP
    return {
        TaskKeys.PARAM_GROUP_ID: result.group_id,
        TaskKeys.SUB_GROUP_ID: result.subgroup_id,
        ResultKeys.UPDATED_PARAM: result.param,
        ResultKeys.EVENT_TYPE: event,
    }


class SuperOffloadCPUOptimizer:
    """Drop-in for DeepSpeed's ``SuperOffloadCPUOptimizer``, backed by :class:`aoffload.CPUAdam`.

    Same constructor, ``async_step`` / ``get_result`` / ``close``, result keys (``TaskKeys``,
    ``ResultKeys``) and event types (``"adam_step"``, ``"rollback"``) as DeepSpeed's class. The
    step runs in aoffload's worker on ``fp32_param`` in place (its storage moves to shared
    memory on the first step), and the result's ``updated_param`` is that same tensor.

    Differences, all deliberate: ``get_result()`` stays non-blocking but raises
    :class:`aoffload.WorkerDiedError` once the worker is dead (instead of returning ``None``
    forever); an exception in one step raises :class:`aoffload.RemoteError` from
    ``get_result()`` and the worker keeps serving; bad configuration or a gradient larger than
    ``max_grad_numel`` raises :class:`aoffload.OptimizerError` at once instead of killing the
    worker. ``backend`` and ``exact_rollback`` are passed to :class:`aoffload.CPUAdam`;
    ``pin_memory`` is accepted for compatibility (there is no accelerator copy to speed up).
    """

    def __init__(
        self,
        optimizer_config: Mapping[str, Any] | Sequence[Mapping[str, Any]],
        cpuadam_cores_perc: float = 0.8,
        max_grad_numel: int = 1000000,
        pin_memory: bool = True,
        *,
        backend: str = "deepspeed",
        exact_rollback: bool = False,
        start_timeout: float = 60.0,
    ) -> None:
        if not 0 < cpuadam_cores_perc <= 1:
            raise OptimizerError("cpuadam_cores_perc must be between 0 and 1")
        self.max_grad_numel = max_grad_numel
        self.pin_memory = pin_memory
        self._results: queue.SimpleQueue[dict[str, Any] | BaseException] = queue.SimpleQueue()
        self._pump: asyncio.Task[None] | None = None
        self._closed = False
        self._optimizer = CPUAdam(
            param_groups=_param_groups(optimizer_config),
            backend=backend,
            worker_cores=cpuadam_cores_perc,
            exact_rollback=exact_rollback,
            start_timeout=start_timeout,
        )
        self._portal = Portal("superoffload")
        try:
            self._portal.call(self._optimizer.__aenter__())
        except BaseException:
            self._portal.close()
            raise
        self._pid = self._optimizer.pid

    @property
    def pid(self) -> int | None:
        """The worker's process id while it runs, else ``None``."""
        return self._optimizer.pid

    def _check_alive(self) -> None:
        if self._closed:
            raise ClosedError("the SuperOffloadCPUOptimizer is closed")
        if self._optimizer.pid is None:
            raise WorkerDiedError("cpu-adam", self._pid, None)

    async def _submit(
        self,
        param_group_id: int,
        sub_group_id: int,
        fp32_param: torch.Tensor,
        fp32_grad: torch.Tensor,
        rollback: bool,
        lr: float | None,
    ) -> None:
        self._optimizer.submit(
            param_group_id, sub_group_id, fp32_param, fp32_grad, lr=lr, rollback=rollback
        )
        if self._pump is None or self._pump.done():
            self._pump = asyncio.get_running_loop().create_task(self._pump_results())

    async def _settle(self) -> None:
        if self._pump is not None:
            await asyncio.wait({self._pump})

    async def _pump_results(self) -> None:
        # results() ends when nothing is outstanding; the next _submit starts a new pump.
        while True:
            try:
                async for result in self._optimizer.results():
                    self._results.put(_as_result(result))
            except RemoteError as exc:
                self._results.put(exc)
                continue
            except AoffloadError as exc:
                self._results.put(exc)
            return

    def async_step(
        self,
        param_group_id: int,
        sub_group_id: int,
        fp32_param: torch.Tensor,
        fp32_grad: torch.Tensor,
        rollback: bool = False,
        lr: float | None = None,
    ) -> None:
        """Queue one step (or, with ``rollback=True``, its undo) of a sub-group; never waits."""
        self._check_alive()
        if fp32_grad.numel() > self.max_grad_numel:
            raise OptimizerError(
                f"gradient of {fp32_grad.numel()} elements exceeds max_grad_numel="
                f"{self.max_grad_numel}"
            )
        self._portal.call(
            self._submit(param_group_id, sub_group_id, fp32_param, fp32_grad, rollback, lr)
        )

    def get_result(self, expected_event_type: str | None = None) -> dict[str, Any] | None:
        """The next finished step's result dict, or ``None`` when none has finished yet.

        Raises :class:`aoffload.WorkerDiedError` once the worker is dead and every result it
        produced has been returned, :class:`aoffload.RemoteError` for a step that failed, and
        :class:`aoffload.OptimizerError` when ``expected_event_type`` does not match.
        """
        try:
            item = self._results.get_nowait()
        except queue.Empty:
            if self._closed or self._optimizer.pid is not None:
                self._check_alive()
                return None
            # Dead: first let through the results that finished before the death.
            self._portal.call(self._settle())
            try:
                item = self._results.get_nowait()
            except queue.Empty:
                raise WorkerDiedError("cpu-adam", self._pid, None) from None
        if isinstance(item, BaseException):
            raise item
        if expected_event_type is not None and item[ResultKeys.EVENT_TYPE] != expected_event_type:
            raise OptimizerError(
                f"Event type mismatch: expected {expected_event_type!r}, "
                f"got {item[ResultKeys.EVENT_TYPE]!r}"
            )
        return item

    def close(self) -> None:
        """Stop the worker (draining queued steps, with a bound) and the portal; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._portal.call(self._optimizer.aclose())
        finally:
            self._portal.close()


def install_superoffload(target: Any, **options: Any) -> SuperOffloadCPUOptimizer:
    """Make a SuperOffload stage-3 optimizer step through :class:`SuperOffloadCPUOptimizer`.

    ``target`` is the ``DeepSpeedEngine`` (or its ``optimizer``, a
    ``SuperOffloadOptimizer_Stage3``). Call it after ``deepspeed.initialize`` and before the
    first step: it closes DeepSpeed's CPU optimizer process and assigns the stage-3 optimizer's
    ``superoffload_cpu_optimizer`` attribute (DeepSpeed has no hook for this), building the
    replacement from the same parameter groups, ``max_grad_numel`` and ``pin_memory``.
    ``options`` (``cpuadam_cores_perc``, ``backend``, ``exact_rollback``) go to the constructor.
    """
    optimizer = getattr(target, "optimizer", target)
    if not hasattr(optimizer, "superoffload_cpu_optimizer"):
        optimizer = target
    old = getattr(optimizer, "superoffload_cpu_optimizer", None)
    if old is None:
        raise OptimizerError(f"{type(optimizer).__name__} is not a SuperOffload stage-3 optimizer")
    if getattr(optimizer, "async_cpuadam_num", 0):
        raise OptimizerError("install_superoffload() must run before the first step")
    configs = [
        {key: group[key] for key in _GROUP_KEYS} for group in optimizer.optimizer.param_groups
    ]
    new = SuperOffloadCPUOptimizer(
        configs,
        max_grad_numel=optimizer.max_grad_numel,
        pin_memory=getattr(optimizer, "offload_optimizer_pin_memory", True),
        **options,
    )
    try:
        old.close()
    except BaseException:
        new.close()
        raise
    optimizer.superoffload_cpu_optimizer = new
    return new
