"""The CPU optimizer's worker service: dispatches :mod:`._calls` to a backend.

The deepspeed backend loads DeepSpeed's op from its build when that provably is DeepSpeed's
op, without importing DeepSpeed (:mod:`._deepspeed_op`); otherwise through DeepSpeed, after
quieting its notice that it fell back to the CPU accelerator (the right one for a CPU
optimizer; any other DeepSpeed warning is kept, see :mod:`._deepspeed_start`).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

import torch

from ..._runtime.protocol import Call
from ..._runtime.serve import Handler, Service, target
from ._backend import Backup, NoStepError, SubGroupBackend
from ._calls import (
    AdamConfig,
    Allocate,
    Done,
    GetInfo,
    Hurry,
    Info,
    Load,
    Register,
    Release,
    SetGroups,
    Settle,
    Snapshot,
    StateInfo,
    Step,
)
from ._deepspeed_backend import DeepSpeedBackend
from ._stepper import Stepper
from ._torch_backend import TorchBackend

__all__ = ["TARGET", "AdamService"]

logger = logging.getLogger(__name__)


class AdamService(Service):
    """Serves the optimizer's calls with one backend."""

    config_type = AdamConfig

    def __init__(self, config: AdamConfig) -> None:
        if config.cores is not None and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, config.cores)
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        self._cores = config.cores
        self._fallback: str | None = None
        self._backend = self._make_backend(config)
        # The torch backend steps sub-groups side by side, one core each (see _stepper);
        # DeepSpeed's op keeps state across calls and steps one sub-group at a time.
        threads = torch.get_num_threads()
        side_by_side = config.side_by_side and isinstance(self._backend, TorchBackend)
        self._stepper = Stepper(threads) if side_by_side and threads > 1 else None
        self._exact = config.exact_rollback
        self._backups: dict[tuple[int, int], Backup] = {}
        self._registered: dict[tuple[int, int], int] = {}  # numel of each sub-group
        self._buffers: dict[int, torch.Tensor] = {}  # state buffers, shared with the trainer
        # Loaded state of sub-groups that register later: (step, exp_avg, exp_avg_sq).
        self._waiting: dict[tuple[int, int], tuple[int, torch.Tensor, torch.Tensor]] = {}
        logger.info(
            "CPUAdam worker: %s backend, %d threads, cores %s",
            self._backend.name,
            torch.get_num_threads(),
            "inherited" if config.cores is None else list(config.cores),
        )

    def _make_backend(self, config: AdamConfig) -> SubGroupBackend:
        """The backend asked for; ``"auto"``: DeepSpeed's op if it loads without a build,
        else the torch backend, and :attr:`_fallback` says why."""
        if config.backend == "torch":
            return TorchBackend(config.groups)
        if config.backend == "deepspeed":
            return DeepSpeedBackend(config.groups, build=True)
        try:
            return DeepSpeedBackend(config.groups, build=False)
        except Exception as exc:
            self._fallback = str(exc)
            logger.debug("backend 'auto': the torch backend, as %s", exc, exc_info=True)
            return TorchBackend(config.groups)

    def handlers(self) -> Mapping[type[Call[Any]], Handler]:
        """Step, register, report what runs."""
        others: dict[type[Call[Any]], Handler] = {
            Register: self._register,
            GetInfo: self._info,
            Allocate: self._allocate,
            Release: self._release,
            Snapshot: self._snapshot,
            Load: self._load,
            SetGroups: self._set_groups,
        }
        stepper = self._stepper
        if stepper is None:
            return {Step: self._step, Hurry: _nothing, Settle: self._settle, **others}
        # Any other call runs once the steps sent before it have ended.
        after = {kind: _after(stepper, handle) for kind, handle in others.items()}
        return {Step: self._submit, Hurry: lambda _: stepper.hurry(), Settle: self._settle, **after}

    def _settle(self, request: Settle) -> None:
        """Copy every sub-group's moments into its backup, behind its steps sent (on the
        stepping threads while the trainer runs its next forward)."""
        for key, backup in self._backups.items():
            if backup.moments:
                continue
            keep = functools.partial(self._keep_moments, key, backup)
            if self._stepper is None:
                keep()
            else:
                self._stepper.submit(key, keep)

    def _keep_moments(self, key: tuple[int, int], backup: Backup) -> None:
        try:
            self._backend.keep_moments(key, backup)
        except Exception:  # the next step copies them itself
            logger.exception("could not copy the moments of sub-group %s ahead of its step", key)

    def _submit(self, request: Step) -> concurrent.futures.Future[Done]:
        if self._stepper is None:
            raise RuntimeError("no stepping threads")  # a bug of ours
        key = (request.group_id, request.subgroup_id)
        return self._stepper.submit(key, functools.partial(self._step, request))

    def quiesce(self) -> None:
        """Every step sent has ended (its reply is on its way)."""
        if self._stepper is not None:
            self._stepper.wait_idle()

    def _register(self, request: Register) -> None:
        key = (request.group_id, request.subgroup_id)
        numel = request.param.numel()
        waiting = self._waiting.pop(key, None)
        if waiting is not None and waiting[1].numel() != numel:
            raise ValueError(
                f"sub-group {key[1]} of group {key[0]} has {numel} elements but the loaded "
                f"state holds {waiting[1].numel()}"
            )
        self._backend.register(key, request.param, request.grad, request.pieces)
        self._registered[key] = numel
        if self._exact:
            self._backups[key] = Backup(numel)
        if waiting is not None:
            self._backend.load(key, waiting[0], waiting[1:])

    def _allocate(self, request: Allocate) -> torch.Tensor:
        buffer = torch.empty(request.numel, dtype=torch.float32)
        buffer.share_memory_()  # type: ignore[no-untyped-call]
        self._buffers[request.buffer_id] = buffer
        return buffer

    def _release(self, request: Release) -> None:
        self._buffers.pop(request.buffer_id, None)

    def _buffer(self, buffer_id: int, needed: bool) -> torch.Tensor:
        buffer = self._buffers.get(buffer_id)
        if buffer is None:
            if needed:
                raise KeyError(f"no state buffer {buffer_id} (its allocation failed)")
            return torch.empty(0)
        return buffer

    def _snapshot(self, request: Snapshot) -> StateInfo:
        buffer = self._buffer(request.buffer_id, bool(request.keys))
        steps, offset = [], 0
        for key in request.keys:
            numel = self._registered[key]
            exp_avg = buffer[offset : offset + numel]
            exp_avg_sq = buffer[offset + numel : offset + 2 * numel]
            steps.append(self._backend.export(key, exp_avg, exp_avg_sq))
            offset += 2 * numel
        return StateInfo(
            self._backend.name, tuple(steps), self._backend.groups(), self._backend.kernel()
        )

    def _load(self, request: Load) -> None:
        buffer = self._buffer(request.buffer_id, bool(request.entries))
        for group_id, subgroup_id, numel, _ in request.entries:  # validate everything first
            known = self._registered.get((group_id, subgroup_id))
            if known is not None and known != numel:
                raise ValueError(
                    f"sub-group {subgroup_id} of group {group_id} has {known} elements; "
                    f"the state holds {numel}"
                )
        listed = {(g, s) for g, s, _, _ in request.entries}
        self._backend.set_groups(request.groups)
        self._backend.set_kernel(request.kernel)
        self._waiting.clear()
        for key in self._registered.keys() - listed:
            self._backend.load(key, 0, None)  # not in the state: starts afresh
        offset = 0
        for group_id, subgroup_id, numel, step in request.entries:
            key = (group_id, subgroup_id)
            exp_avg = buffer[offset : offset + numel]
            exp_avg_sq = buffer[offset + numel : offset + 2 * numel]
            offset += 2 * numel
            if key in self._registered:
                self._backend.load(key, step, (exp_avg, exp_avg_sq))
            else:  # the buffer is reused: keep a private copy until the sub-group registers
                self._waiting[key] = (step, exp_avg.clone(), exp_avg_sq.clone())
        for backup in self._backups.values():
            backup.valid = backup.moments = False  # they belong to the state replaced

    def _set_groups(self, request: SetGroups) -> None:
        self._backend.set_groups(request.groups)

    def _info(self, request: GetInfo) -> Info:
        backend = self._backend
        library = backend.op.library if isinstance(backend, DeepSpeedBackend) else None
        return Info(
            self._backend.name,
            torch.get_num_threads(),
            self._cores,
            op_library=library,
            deepspeed_imported="deepspeed" in sys.modules,
            fallback=self._fallback,
        )

    def _step(self, request: Step) -> Done:
        key = (request.group_id, request.subgroup_id)
        if key not in self._registered:
            raise KeyError(
                f"sub-group {request.subgroup_id} of group {request.group_id} is not registered"
            )
        started = time.perf_counter()
        if request.lr is not None:
            self._backend.set_lr(request.group_id, request.lr)
        backup = self._backups.get(key)
        if not request.rollback:
            if backup is not None:
                self._backend.snapshot(key, backup)
                backup.valid, backup.moments = True, False
            step = self._backend.step(key)
        elif backup is not None:
            if not backup.valid:
                raise NoStepError(
                    f"cannot roll back sub-group {request.subgroup_id} of group "
                    f"{request.group_id}: no step since its last rollback or state load "
                    "(exact rollback keeps one pre-step copy)"
                )
            step = self._backend.restore(key, backup)
            backup.valid, backup.moments = False, True  # its moments are the current ones
        else:
            step = self._backend.rollback(key)
        return Done(step, time.perf_counter() - started)

    def close(self) -> None:
        """Drop the tensors (the shared memory is released with the last reference)."""
        if self._stepper is not None:
            self._stepper.close()
        self._backend.close()
        self._backups.clear()
        self._registered.clear()
        self._buffers.clear()
        self._waiting.clear()


def _nothing(request: Any) -> None:
    return None


def _after(stepper: Stepper, handle: Handler) -> Handler:
    def run(request: Any) -> object:
        stepper.wait_idle()
        return handle(request)

    return run


TARGET = target(AdamService)
"""The name a bridge spawns the service by."""
