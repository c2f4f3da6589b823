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

import asyncio
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .._errors import OptimizerError
from .._runtime.bridge import Bridge
from .._runtime.threads import mark_retrieved
from ._calls import Allocate, GroupConfig, Kernel, Load, Release, Snapshot, StateInfo
from ._subgroups import Registry, SubGroup, group_config

__all__ = ["FORMAT", "LoadPlan", "StateTransfer", "parse"]

FORMAT = "aoffload.CPUAdam/1"

_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


def _uses(tensor: torch.Tensor) -> int:
    if _use_count is None:
        return 1 << 30  # unknown: never reuse
    return _use_count(tensor.untyped_storage()._cdata)


class _Buffer:
    """One shared state buffer: the trainer's mapping, and who still needs it."""

    __slots__ = ("baseline", "busy", "id", "numel", "tensor")

    def __init__(self, buffer_id: int, numel: int, tensor: asyncio.Future[torch.Tensor]) -> None:
        self.id = buffer_id
        self.numel = numel
        self.tensor = tensor
        self.busy = 1  # claimed by whoever allocated it
        self.baseline = 0
        tensor.add_done_callback(self._mapped)

    def _mapped(self, future: asyncio.Future[torch.Tensor]) -> None:
        if not future.cancelled() and future.exception() is None:
            self.baseline = _uses(future.result())

    def free(self) -> bool:
        """Nobody uses it: no call in flight, no tensor of a returned state dict alive."""
        if self.busy or not self.tensor.done() or self.tensor.exception() is not None:
            return False
        return _uses(self.tensor.result()) <= self.baseline

    def hold(self, future: asyncio.Future[Any]) -> None:
        """Keep the buffer busy until ``future`` is done."""
        self.busy += 1

        def release(_: object) -> None:
            self.busy -= 1

        future.add_done_callback(release)


class StateTransfer:
    """Snapshots and loads of the worker's state through a pool of shared buffers."""

    def __init__(self) -> None:
        self._buffers: dict[int, _Buffer] = {}
        self._ids = itertools.count()

    def _acquire(self, bridge: Bridge, numel: int) -> _Buffer:
        """A claimed buffer of at least ``numel`` floats; the caller unclaims it."""
        free = [b for b in self._buffers.values() if b.free()]
        fits = [b for b in free if b.numel >= numel]
        chosen = min(fits, key=lambda b: b.numel) if fits else None
        for buffer in free:
            if buffer is not chosen:  # keep one idle buffer at most
                self._forget(bridge, buffer)
        if chosen is not None:
            chosen.busy += 1
            return chosen
        buffer_id = next(self._ids)
        future = bridge.call(Allocate(buffer_id, numel))
        future.add_done_callback(mark_retrieved)  # a failed allocation fails the call after it
        buffer = self._buffers[buffer_id] = _Buffer(buffer_id, numel, future)
        return buffer

    def _forget(self, bridge: Bridge, buffer: _Buffer) -> None:
        self._buffers.pop(buffer.id, None)
        if not bridge.dead:
            bridge.call(Release(buffer.id)).add_done_callback(mark_retrieved)

    def clear(self) -> None:
        """Drop every buffer (the worker is gone or going)."""
        self._buffers.clear()

    async def snapshot(
        self, bridge: Bridge, subgroups: Mapping[tuple[int, int], SubGroup]
    ) -> dict[str, Any]:
        """Send the snapshot now (it covers every step sent before) and build the state dict."""
        keys = sorted(subgroups)
        numels = [subgroups[key].numel for key in keys]
        total = 2 * sum(numels)
        buffer = self._acquire(bridge, total) if total else None
        reply = bridge.call(Snapshot(-1 if buffer is None else buffer.id, tuple(keys)))
        if buffer is None:
            return _state_dict(await reply, keys, numels, torch.empty(0))
        buffer.hold(reply)  # busy until the worker wrote it, even if this wait is cancelled
        try:
            info = await reply
            # Still claimed here: the views exist before anyone else may take the buffer.
            state = _state_dict(info, keys, numels, buffer.tensor.result())
        finally:
            buffer.busy -= 1
        if _use_count is None:
            self._forget(bridge, buffer)  # cannot tell when it is free: never reuse it
        return state

    async def load_state_dict(
        self, bridge: Bridge, state_dict: object, groups: int, registry: Registry
    ) -> tuple[GroupConfig, ...]:
        """Check ``state_dict``, load it into the worker and return its param groups.

        ``groups`` is the number of param groups; the moments are staged on the
        ``registry``'s thread, and the state of sub-groups it does not hold yet is noted
        there, for their registration to check.
        """
        registered = {key: sub.numel for key, sub in registry.subgroups.items()}
        plan = parse(state_dict, groups, registered)
        await self.load(bridge, plan, registry.thread())
        registry.loaded = {
            (gid, sid): numel
            for gid, sid, numel, *_ in plan.entries
            if (gid, sid) not in registered
        }
        return plan.groups

    async def load(self, bridge: Bridge, plan: LoadPlan, executor: Any) -> None:
        """Stage ``plan``'s moments in a buffer (on ``executor``), then load them at once."""
        total = 2 * sum(entry[2] for entry in plan.entries)
        buffer = self._acquire(bridge, total) if total else None
        try:
            if buffer is not None:
                flat = await asyncio.shield(buffer.tensor)
                loop = asyncio.get_running_loop()
                copied = loop.run_in_executor(executor, plan.copy_into, flat)
                buffer.hold(copied)
                await copied
            call = Load(
                -1 if buffer is None else buffer.id,
                tuple(entry[:4] for entry in plan.entries),
                plan.groups,
                plan.kernel,
            )
            reply = bridge.call(call)
            if buffer is not None:
                buffer.hold(reply)
            await reply
        finally:
            if buffer is not None:
                buffer.busy -= 1


def _group_dict(group: GroupConfig) -> dict[str, Any]:
    return {
        "lr": group.lr,
        "betas": (group.beta1, group.beta2),
        "eps": group.eps,
        "weight_decay": group.weight_decay,
        "amsgrad": False,
        "bias_correction": group.bias_correction,
    }


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
        "param_groups": [_group_dict(group) for group in info.groups],
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
