"""OffloadAdam's state dict: ``torch.optim``'s layout, translated to and from the worker's.

``state_dict()`` has the layout of ``torch.optim.AdamW``'s, so a state saved by one loads
into the other::

    {"state": {param_index: {"step": Tensor[()] (float32),
                             "exp_avg": Tensor[param.shape], "exp_avg_sq": Tensor[param.shape],
                             "master": Tensor[param.shape]}},      # fp32; bf16/fp16 params only
     "param_groups": [{"lr", "betas", "eps", "weight_decay", ..., "params": [param_index]}],
     "offload": {"format": "aoffload.OffloadAdam/1", "backend": "torch" | "deepspeed",
                 "kernel": None | {...}}}                           # see CPUAdam's state

A parameter never stepped has no entry, as in torch. The moments are fp32 views of
memory the caller owns (later steps never change them); ``master`` is the fp32 value
the optimizer steps, kept for low-precision parameters so that a resumed run continues
from it rather than from the rounded parameter. ``kernel`` lets the ``deepspeed`` backend
resume bit-identically. The worker holds one step count per bucket: loading a state whose
parameters of one bucket have different step counts is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..._errors import OptimizerError
from .._state import FORMAT as CORE_FORMAT
from .._subgroups import group_config
from ..worker._calls import GroupConfig
from ._buckets import Bucket

__all__ = ["FORMAT", "Loaded", "config_of", "from_torch", "packed_groups", "to_torch"]

FORMAT = "aoffload.OffloadAdam/1"

_HYPER = ("lr", "betas", "eps", "weight_decay", "amsgrad")


def config_of(index: int, group: Mapping[str, Any]) -> GroupConfig:
    """Param group ``index``'s hyper-parameters, validated (other keys are the caller's)."""
    if group.get("maximize", False):
        raise OptimizerError(f"param group {index}: maximize=True is not supported")
    values = {key: group[key] for key in _HYPER if key in group}
    lr = values.get("lr")
    if isinstance(lr, torch.Tensor):
        values["lr"] = float(lr)
    return group_config(index, values)


def packed_groups(param_groups: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    packed, start = [], 0
    for group in param_groups:
        count = len(group["params"])
        entry = {key: value for key, value in group.items() if key != "params"}
        entry["params"] = list(range(start, start + count))
        packed.append(entry)
        start += count
    return packed


def to_torch(
    core_state: Mapping[str, Any],
    buckets: Sequence[Bucket],
    param_groups: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    """The torch-layout state of ``core_state`` (what :meth:`CPUAdam.state_dict` returns)."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    by_group = core_state["state"]
    for bucket in buckets:
        entry = by_group.get(bucket.group_id, {}).get(bucket.index)
        if entry is None or entry["step"] == 0:
            continue
        for position, (param, index, offset) in enumerate(
            zip(bucket.params, bucket.indices, bucket.offsets, strict=True)
        ):
            end = offset + param.numel()
            values = {
                "step": torch.tensor(float(entry["step"]), dtype=torch.float32),
                "exp_avg": entry["exp_avg"][offset:end].view(param.shape),
                "exp_avg_sq": entry["exp_avg_sq"][offset:end].view(param.shape),
            }
            if param.dtype != torch.float32:
                values["master"] = bucket.master_views[position].clone()
            state[index] = values
    kernel = core_state.get("kernel")
    return {
        "state": state,
        "param_groups": packed_groups(param_groups),
        "offload": {"format": FORMAT, "backend": core_state.get("backend"), "kernel": kernel},
    }


class Loaded:
    """A validated state dict: the groups' new hyper-parameters, the worker's state, the
    masters to copy in."""

    def __init__(
        self,
        groups: list[dict[str, Any]],
        configs: tuple[GroupConfig, ...],
        core_state: dict[str, Any],
        masters: list[tuple[Bucket, int, torch.Tensor]],
    ) -> None:
        self.groups = groups
        self.configs = configs
        self.core_state = core_state
        self.masters = masters


def _tensor(value: object, where: str, name: str, numel: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise OptimizerError(f"{where}: {name} must be a floating-point tensor")
    if value.numel() != numel:
        raise OptimizerError(
            f"{where}: {name} has {value.numel()} elements, the parameter {numel}: is this "
            "the same model?"
        )
    return value.detach().to("cpu", torch.float32).reshape(-1)


def _step(value: object, where: str) -> int:
    step = float(value) if isinstance(value, (torch.Tensor, int, float)) else -1.0
    if step < 0 or step != int(step):
        raise OptimizerError(f"{where}: step must be a whole number >= 0, got {value!r}")
    return int(step)


def from_torch(
    state_dict: object,
    buckets: Sequence[Bucket],
    param_groups: Sequence[Mapping[str, Any]],
) -> Loaded:
    """Validate a torch-layout ``state_dict`` (ours or ``torch.optim.AdamW``'s) against
    this optimizer's groups and buckets; nothing is changed here."""
    if not isinstance(state_dict, Mapping) or not isinstance(state_dict.get("state"), Mapping):
        raise OptimizerError(
            "not an optimizer state dict (a mapping with 'state' and 'param_groups')"
        )
    saved_groups = state_dict.get("param_groups")
    if not isinstance(saved_groups, Sequence) or len(saved_groups) != len(param_groups):
        count = len(saved_groups) if isinstance(saved_groups, Sequence) else saved_groups
        raise OptimizerError(
            f"the state has {count} param groups; this optimizer has {len(param_groups)}"
        )
    ids: dict[object, int] = {}
    groups: list[dict[str, Any]] = []
    start = 0
    for index, (saved, group) in enumerate(zip(saved_groups, param_groups, strict=True)):
        saved_ids = saved.get("params") if isinstance(saved, Mapping) else None
        if not isinstance(saved_ids, Sequence) or len(saved_ids) != len(group["params"]):
            raise OptimizerError(
                f"param group {index} of the state does not match this optimizer's group "
                f"{index} in size"
            )
        ids.update({saved_id: start + k for k, saved_id in enumerate(saved_ids)})
        start += len(saved_ids)
        merged = {**group, **{k: v for k, v in saved.items() if k not in ("params", "param_names")}}
        groups.append(merged)
    configs = tuple(config_of(i, group) for i, group in enumerate(groups))
    state = {ids[key]: value for key, value in state_dict["state"].items() if key in ids}

    core: dict[int, dict[int, dict[str, Any]]] = {}
    masters: list[tuple[Bucket, int, torch.Tensor]] = []
    for bucket in buckets:
        entries = [state.get(index) for index in bucket.indices]
        if all(entry is None for entry in entries):
            continue
        where = f"the state of parameters {bucket.indices}"
        present = [entry for entry in entries if isinstance(entry, Mapping)]
        if len(present) != len(entries):
            raise OptimizerError(
                f"{where}: some have a state and some do not; OffloadAdam steps them together "
                "(load a state saved with the same parameters trained together)"
            )
        steps = {_step(entry.get("step"), where) for entry in present}
        if len(steps) != 1:
            raise OptimizerError(f"{where}: their step counts differ ({sorted(steps)})")
        exp_avg = torch.zeros(bucket.numel)
        exp_avg_sq = torch.zeros(bucket.numel)
        for position, (entry, param, offset) in enumerate(
            zip(present, bucket.params, bucket.offsets, strict=True)
        ):
            numel, end = param.numel(), offset + param.numel()
            inner = f"the state of parameter {bucket.indices[position]}"
            exp_avg[offset:end] = _tensor(entry.get("exp_avg"), inner, "exp_avg", numel)
            exp_avg_sq[offset:end] = _tensor(entry.get("exp_avg_sq"), inner, "exp_avg_sq", numel)
            if entry.get("master") is not None:
                masters.append((bucket, position, _tensor(entry["master"], inner, "master", numel)))
        core.setdefault(bucket.group_id, {})[bucket.index] = {
            "step": steps.pop(),
            "exp_avg": exp_avg,
            "exp_avg_sq": exp_avg_sq,
        }
    offload = state_dict.get("offload")
    kernel = offload.get("kernel") if isinstance(offload, Mapping) else None
    core_state = {
        "format": CORE_FORMAT,
        "param_groups": [config.as_dict() for config in configs],
        "state": core,
        "kernel": kernel,
    }
    return Loaded(groups, configs, core_state, masters)
