"""The CPU optimizer's worker service: dispatches :mod:`._calls` to a backend."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import torch

from .._runtime.protocol import Call
from .._runtime.serve import Handler, Service
from ._backends import Backup, DeepSpeedBackend, NoStepError, TorchBackend
from ._calls import AdamConfig, Done, GetInfo, Info, Register, Step

__all__ = ["TARGET", "AdamService", "create"]

logger = logging.getLogger(__name__)


class AdamService(Service):
    """Serves the optimizer's calls with one backend."""

    def __init__(self, config: AdamConfig) -> None:
        if config.cores is not None and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, config.cores)
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        self._cores = config.cores
        self._backend: TorchBackend | DeepSpeedBackend = self._make_backend(config)
        self._exact = config.exact_rollback
        self._backups: dict[tuple[int, int], Backup] = {}
        self._registered: set[tuple[int, int]] = set()
        logger.info(
            "CPUAdam worker: %s backend, %d threads, cores %s",
            self._backend.name,
            torch.get_num_threads(),
            "inherited" if config.cores is None else list(config.cores),
        )

    @staticmethod
    def _make_backend(config: AdamConfig) -> TorchBackend | DeepSpeedBackend:
        if config.backend == "torch":
            return TorchBackend(config.groups)
        if config.backend == "deepspeed":
            return DeepSpeedBackend(config.groups)
        try:
            return DeepSpeedBackend(config.groups)
        except Exception as exc:  # noqa: BLE001 - "auto" falls back, and says why
            logger.info("DeepSpeed's CPU Adam is unavailable (%s); using the torch backend", exc)
            return TorchBackend(config.groups)

    def handlers(self) -> Mapping[type[Call[Any]], Handler]:
        """Step, register, report what runs."""
        return {Step: self._step, Register: self._register, GetInfo: self._info}

    def _register(self, request: Register) -> None:
        key = (request.group_id, request.subgroup_id)
        self._backend.register(*key, request.param, request.grad)
        self._registered.add(key)
        if self._exact:
            self._backups[key] = Backup(request.param.numel())

    def _info(self, request: GetInfo) -> Info:
        return Info(self._backend.name, torch.get_num_threads(), self._cores)

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
                self._backend.snapshot(*key, backup)
                backup.valid = True
            step = self._backend.step(*key)
        elif backup is not None:
            if not backup.valid:
                raise NoStepError(
                    f"cannot roll back sub-group {request.subgroup_id} of group "
                    f"{request.group_id}: no step since its last rollback (exact rollback "
                    "keeps one pre-step copy)"
                )
            step = self._backend.restore(*key, backup)
            backup.valid = False
        else:
            step = self._backend.rollback(*key)
        return Done(step, time.perf_counter() - started)

    def close(self) -> None:
        """Drop the tensors (the shared memory is released with the last reference)."""
        self._backups.clear()
        self._registered.clear()


def create(config: object) -> AdamService:
    """Worker-side factory named by :data:`TARGET`."""
    if not isinstance(config, AdamConfig):
        raise TypeError(f"expected an AdamConfig, got {type(config)!r}")
    return AdamService(config)


TARGET = f"{__name__}:create"
