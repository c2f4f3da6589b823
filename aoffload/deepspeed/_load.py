"""What :meth:`AsyncCheckpointEngine.load` reads: verified files, ``weights_only=True``.

DeepSpeed's own engine loads every checkpoint file with ``torch.load(weights_only=False)``,
which runs whatever code a file's pickle names. The adapter loads the files DeepSpeed asks
for as aoffload loads any file: checked against its tag's manifest, then
``torch.load(weights_only=True)``. DeepSpeed's optimizer files hold a few of DeepSpeed's own
objects besides tensors; exactly those classes, and no others, are allowed while such a
file loads (:data:`DEEPSPEED_SAFE_GLOBALS`). Objects of your own in ``client_state`` need
``torch.serialization.add_safe_globals`` (or ``safe_globals``) on your side, as for any
``weights_only`` load.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .. import (
    CheckpointEngine,
    CheckpointError,
    CorruptCheckpointError,
    load_checkpoint,
    load_metadata,
)

__all__ = ["DEEPSPEED_SAFE_GLOBALS", "deepspeed_safe_globals", "load_verified", "locate"]

DEEPSPEED_SAFE_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
"""The non-tensor classes in DeepSpeed 0.19's checkpoint files (ZeRO stages 1-3: the loss
scaler, static or dynamic, the ZeRO stage and the parameter fragments' addresses), found
by saving real engines of every stage; stage 0 files hold none."""

_TAG_DEPTH = 4  # how far above a file its tag's directory may lie (<tag>/<a>/<b>/<file>)


def deepspeed_safe_globals() -> list[Any]:
    """The classes of :data:`DEEPSPEED_SAFE_GLOBALS`, imported."""
    import importlib

    found = []
    for qualified in DEEPSPEED_SAFE_GLOBALS:
        module, _, name = qualified.rpartition(".")
        found.append(getattr(importlib.import_module(module), name))
    return found


def locate(path: str) -> tuple[Path, str, str]:
    """``(directory, tag, name)`` of ``path``, a file of a committed aoffload tag.

    The tag is the nearest directory above ``path`` that is a committed checkpoint of its
    parent (its manifest is read); a file of no committed tag is a
    :class:`CheckpointError` (aoffload loads only verified files), an unreadable manifest a
    :class:`CorruptCheckpointError`.
    """
    file = Path(os.path.abspath(path))
    for folder in list(file.parents)[:_TAG_DEPTH]:
        try:
            load_metadata(folder.parent, folder.name).result()
        except CorruptCheckpointError:
            raise
        except CheckpointError:  # not a committed tag (nor a tag's name)
            continue
        return folder.parent, folder.name, file.relative_to(folder).as_posix()
    raise CheckpointError(
        f"{path} is not a file of a committed aoffload checkpoint (no manifest in "
        "the directories above it), so it cannot be verified; AsyncCheckpointEngine.load "
        "loads only verified files. A checkpoint written by DeepSpeed's own engine loads "
        "with that engine"
    )


def load_verified(
    path: str, map_location: Any, engines: Mapping[str, CheckpointEngine] | None = None
) -> Any:
    """Load ``path`` (blocking): verified against its tag's manifest, then
    ``torch.load(weights_only=True)`` with DeepSpeed's own classes allowed.

    A directory with a running engine among ``engines`` (by absolute path) is loaded by it
    (its writer loads a file with a large pickle); any other with
    :func:`aoffload.load_checkpoint`.
    """
    directory, tag, name = locate(path)
    engine = (engines or {}).get(os.path.abspath(directory))
    with torch.serialization.safe_globals(deepspeed_safe_globals()):
        if engine is not None:
            return engine.load(name, tag=tag, map_location=map_location).result()
        return load_checkpoint(directory, name, tag, map_location=map_location).result()
