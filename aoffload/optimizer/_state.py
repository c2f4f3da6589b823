"""CPUAdam's state on the trainer's side: the state-dict layout, its checks, its transport.

One layout for both backends (so a run can resume on the other one)::

    {"format": "aoffload.CPUAdam/1",
     "backend": "torch" | "deepspeed",                  # informative
     "param_groups": [{"lr", "betas", "eps", "weight_decay", "amsgrad", "bias_correction"}],
     "state": {group_id: {subgroup_id: {"step": int,
                                        "exp_avg": Tensor[numel], "exp_avg_sq": Tensor[numel]}}},
     "kernel": None | {"anchor": int, "step": int, "betas": (float, float)}}

Every registered sub-group is listed (``step`` 0 and zero moments before its first step);
``lr`` is the group's current rate, overrides included. ``kernel`` is the bias-correction
state of DeepSpeed's op (``None`` from the torch backend).

Transport: the moments never cross the pipe. The worker allocates *state buffers* in
shared memory that both processes map; a snapshot is one copy in the worker into a
buffer, and the state dict's tensors are views of it that the caller owns from then on:
a buffer is reused only once no tensor refers to its memory (the storage's use count),
so a returned state dict never changes, while the steady state reuses warm pages
(copying into fresh shared pages measured 4-5x slower than into mapped ones).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .._errors import OptimizerError
from .._runtime.core import WorkerCore
from .._runtime.threads import mark_retrieved, running_future
from ._subgroups import Registry, group_config
from .worker._calls import Allocate, GroupConfig, Kernel, Load, Release, Snapshot, StateInfo

__all__ = ["FORMAT", "LoadPlan", "StateTransfer", "parse"]

FORMAT = "aoffload.CPUAdam/1"

_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


def _uses(tensor: torch.Tensor) -> int:
    if _use_count is None:
        return 1 << 30  # unknown: never reuse
    return _use_count(tensor.untyped_storage()._cdata)


class _Baseline:
    """The storage's use count of a new buffer, taken when the allocation's reply arrives
    (before anyone can make a view of it). A callable of its own, not a method of the
    buffer: a concurrent future keeps its callbacks, and a cycle between the buffer and its
    future would keep the mapping (an fd) alive until a collection."""

    __slots__ = ("uses",)

    def __init__(self) -> None:
        self.uses = 0

    def __call__(self, future: concurrent.futures.Future[torch.Tensor]) -> None:
        if future.exception() is None:
            self.uses = _uses(future.result())


def _ignore(value: object, error: BaseException | None) -> None:
    """The callback of a call whose outcome nobody needs (a failed Release only leaks a buffer)."""


class _Buffer:
    """One shared state buffer: the trainer's mapping, and who still needs it.

    ``busy`` is guarded by the transfer's lock; ``baseline`` holds the storage's use count
    with no view of it alive.
    """

    __slots__ = ("baseline", "busy", "id", "numel", "tensor")

    def __init__(
        self, buffer_id: int, numel: int, tensor: concurrent.futures.Future[torch.Tensor]
    ) -> None:
        self.id = buffer_id
        self.numel = numel
        self.tensor = tensor
        self.busy = 1  # claimed by whoever allocated it
        self.baseline = _Baseline()
        tensor.add_done_callback(self.baseline)

    def free(self) -> bool:
        """Nobody uses it: no call in flight, no tensor of a returned state dict alive."""
        if self.busy or not self.tensor.done() or self.tensor.exception() is not None:
            return False
        return _uses(self.tensor.result()) <= self.baseline.uses


class StateTransfer:
    """Snapshots and loads of the worker's state through a pool of shared buffers.

    Thread-safe: a snapshot is sent from any thread and built on the core's reader thread
    when its reply arrives; a load runs on a thread that may block.
    """

    def __init__(self) -> None:
        self._buffers: dict[int, _Buffer] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def _acquire(self, worker: WorkerCore, numel: int) -> _Buffer:
        """A claimed buffer of at least ``numel`` floats; the caller unclaims it."""
        with self._lock:
            free = [b for b in self._buffers.values() if b.free()]
            fits = [b for b in free if b.numel >= numel]
            chosen = min(fits, key=lambda b: b.numel) if fits else None
            for buffer in free:
                if buffer is not chosen:  # keep one idle buffer at most
                    self._forget(worker, buffer)
            if chosen is not None:
                chosen.busy += 1
                return chosen
            buffer_id = next(self._ids)
            future = worker.submit(Allocate(buffer_id, numel))
            future.add_done_callback(mark_retrieved)  # a failed allocation fails the call after it
            buffer = self._buffers[buffer_id] = _Buffer(buffer_id, numel, future)
            return buffer

    def _forget(self, worker: WorkerCore, buffer: _Buffer) -> None:
        self._buffers.pop(buffer.id, None)
        if worker.death is None:
            worker.submit_callback(Release(buffer.id), _ignore)

    def _hold(self, buffer: _Buffer, future: concurrent.futures.Future[Any]) -> None:
        """Keep ``buffer`` busy until ``future`` is done (whoever waits for it, or nobody)."""
        with self._lock:
            buffer.busy += 1

        def release(_: object) -> None:
            self._unclaim(buffer)

        future.add_done_callback(release)

    def _unclaim(self, buffer: _Buffer) -> None:
        with self._lock:
            buffer.busy -= 1

    def clear(self) -> None:
        """Drop every buffer (the worker is gone or going)."""
        with self._lock:
            self._buffers.clear()

    def snapshot(
        self, worker: WorkerCore, registry: Registry
    ) -> concurrent.futures.Future[dict[str, Any]]:
        """Send the snapshot now (it covers every step sent before) and return the future
        of the state dict, which the reply builds on the core's reader thread."""
        with registry.lock:  # no registration between the listing and the call
            keys = sorted(registry.subgroups)
            numels = [registry.subgroups[key].numel for key in keys]
            total = 2 * sum(numels)
            buffer = self._acquire(worker, total) if total else None
            try:
                reply = worker.submit(Snapshot(-1 if buffer is None else buffer.id, tuple(keys)))
            except BaseException:
                if buffer is not None:
                    self._unclaim(buffer)
                raise
        state: concurrent.futures.Future[dict[str, Any]] = running_future()

        def built(reply: concurrent.futures.Future[StateInfo]) -> None:
            try:
                flat = torch.empty(0) if buffer is None else buffer.tensor.result()
                # Still claimed here: the views exist before anyone else may take the buffer.
                state.set_result(_state_dict(reply.result(), keys, numels, flat))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for the state
                state.set_exception(exc)
            finally:
                if buffer is not None:
                    self._unclaim(buffer)
                    if _use_count is None:  # cannot tell when it is free: never reuse it
                        with self._lock:
                            self._forget(worker, buffer)

        reply.add_done_callback(built)
        return state

    def load(self, worker: WorkerCore, plan: LoadPlan) -> None:
        """Stage ``plan``'s moments in a buffer, then load them at once; blocking (a thread's)."""
        total = 2 * sum(entry[2] for entry in plan.entries)
        buffer = self._acquire(worker, total) if total else None
        try:
            if buffer is not None:
                plan.copy_into(buffer.tensor.result())
            call = Load(
                -1 if buffer is None else buffer.id,
                tuple(entry[:4] for entry in plan.entries),
                plan.groups,
                plan.kernel,
            )
            reply = worker.submit(call)
            if buffer is not None:
                self._hold(buffer, reply)
            reply.result()
        finally:
            if buffer is not None:
                self._unclaim(buffer)


def _state_dict(
    info: StateInfo, keys: list[tuple[int, int]], numels: list[int], flat: torch.Tensor
) -> dict[str, Any]:
    state: dict[int, dict[int, dict[str, Any]]] = {}
    offset = 0
    for (group_id, subgroup_id), numel, step in zip(keys, numels, info.steps, strict=True):
        state.setdefault(group_id, {})[subgroup_id] = {
            "step": step,
            "exp_avg": flat[offset : offset + numel],
            "exp_avg_sq": flat[offset + numel : offset + 2 * numel],
        }
        offset += 2 * numel
    kernel = None
    if info.kernel is not None:
        anchor, step, beta1, beta2 = info.kernel
        kernel = {"anchor": anchor, "step": step, "betas": (beta1, beta2)}
    return {
        "format": FORMAT,
        "backend": info.backend,
        "param_groups": [group.as_dict() for group in info.groups],
        "state": state,
        "kernel": kernel,
    }


@dataclass(frozen=True)
class LoadPlan:
    """A validated state dict: what :meth:`StateTransfer.load` sends."""

    groups: tuple[GroupConfig, ...]
    # (group_id, subgroup_id, numel, step, exp_avg, exp_avg_sq)
    entries: tuple[tuple[int, int, int, int, torch.Tensor, torch.Tensor], ...]
    kernel: Kernel | None

    def copy_into(self, flat: torch.Tensor) -> None:
        """Copy the moments into ``flat`` in the :class:`~._calls.Load` layout (a thread's work)."""
        offset = 0
        for _, _, numel, _, exp_avg, exp_avg_sq in self.entries:
            flat[offset : offset + numel].copy_(exp_avg.reshape(-1))
            flat[offset + numel : offset + 2 * numel].copy_(exp_avg_sq.reshape(-1))
            offset += 2 * numel


def _moment(entry: Mapping[str, Any], name: str, where: str, numel: int | None) -> torch.Tensor:
    tensor = entry.get(name)
    if not isinstance(tensor, torch.Tensor):
        raise OptimizerError(f"{where}: {name} must be a tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu" or tensor.dtype != torch.float32:
        raise OptimizerError(
            f"{where}: {name} is a {tensor.dtype} tensor on {tensor.device}; the state holds "
            "CPU float32 moments (load the checkpoint with map_location='cpu')"
        )
    if tensor.dim() != 1 or (numel is not None and tensor.numel() != numel):
        expected = "a 1-D tensor" if numel is None else f"shape ({numel},)"
        raise OptimizerError(
            f"{where}: {name} has shape {tuple(tensor.shape)}, expected {expected} (the "
            "sub-group registered here has another size: is this the same model and split?)"
        )
    return tensor


def parse(state_dict: object, groups: int, registered: Mapping[tuple[int, int], int]) -> LoadPlan:
    """Validate ``state_dict`` against ``groups`` groups and the ``registered`` numels."""
    if not isinstance(state_dict, Mapping) or state_dict.get("format") != FORMAT:
        raise OptimizerError(
            f"not a CPUAdam state dict (expected a mapping with format {FORMAT!r}); pass what "
            "`await opt.state_dict()` returned, as saved and loaded"
        )
    param_groups = state_dict.get("param_groups")
    if not isinstance(param_groups, list | tuple) or len(param_groups) != groups:
        count = len(param_groups) if isinstance(param_groups, list | tuple) else param_groups
        raise OptimizerError(f"the state has {count} param groups; this CPUAdam has {groups}")
    configs = tuple(group_config(i, g) for i, g in enumerate(param_groups))
    state = state_dict.get("state")
    if not isinstance(state, Mapping):
        raise OptimizerError("the state dict's 'state' must map group ids to sub-groups")
    entries = []
    for group_id, subgroups in sorted(state.items()):
        if not isinstance(group_id, int) or not 0 <= group_id < groups:
            raise OptimizerError(
                f"the state names unknown param group id {group_id!r}: this CPUAdam has "
                f"groups 0..{groups - 1}"
            )
        if not isinstance(subgroups, Mapping):
            raise OptimizerError(f"state[{group_id}] must map sub-group ids to their state")
        for subgroup_id, entry in sorted(subgroups.items()):
            where = f"state of sub-group {subgroup_id!r} of group {group_id}"
            if not isinstance(subgroup_id, int) or not isinstance(entry, Mapping):
                raise OptimizerError(f"{where}: expected an int id and a mapping")
            step = entry.get("step")
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise OptimizerError(f"{where}: step must be an int >= 0, got {step!r}")
            known = registered.get((group_id, subgroup_id))
            exp_avg = _moment(entry, "exp_avg", where, known)
            exp_avg_sq = _moment(entry, "exp_avg_sq", where, exp_avg.numel())
            entries.append((group_id, subgroup_id, exp_avg.numel(), step, exp_avg, exp_avg_sq))
    return LoadPlan(configs, tuple(entries), _kernel(state_dict.get("kernel")))


def _kernel(kernel: object) -> Kernel | None:
    if kernel is None:
        return None
    try:
        anchor, step = kernel["anchor"], kernel["step"]  # type: ignore[index]
        beta1, beta2 = kernel["betas"]  # type: ignore[index]
        if not (isinstance(anchor, int) and isinstance(step, int) and 0 <= anchor <= step):
            raise ValueError("0 <= anchor <= step")
        return (anchor, step, float(beta1), float(beta2))
    except (KeyError, TypeError, ValueError) as exc:
        raise OptimizerError(
            f"the state dict's 'kernel' must be None or {{'anchor', 'step', 'betas'}}: {exc}"
        ) from exc
