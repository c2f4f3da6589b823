"""Commit metadata: a small JSON mapping a commit stores in the tag's manifest.

``commit(tag, metadata={"step": 100, "loss": 1.25})`` keeps what a resume needs (the step,
the data position, a loss) next to the files, instead of in the tag's name.
:func:`validate` checks it on the caller's thread, when ``commit()`` or ``commit_soon()``
is called, and returns a private copy: the manifest gets what the mapping held then. Imports
no torch (the command line reads metadata).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from ..._errors import InvalidStateError

__all__ = ["METADATA_LIMIT", "Metadata", "differing", "validate"]

METADATA_LIMIT = 64 << 10
"""The largest metadata, in bytes of compact JSON: a manifest is read whole, on every
start, by every rank."""
_DEPTH = 32

Metadata = dict[str, Any]
"""Metadata as stored: a JSON object (str keys; JSON values; tuples become lists)."""


def _why(value: object) -> str | None:
    """Why ``value`` (not a container) cannot be stored as JSON, or ``None``."""
    if value is None or isinstance(value, (bool, int, str)):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{value!r} is not a JSON number"
    kind = f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")
    return f"{kind} is not JSON; convert it (int(), float(), str(), tensor.item(), ...)"


def _check(metadata: Mapping[Any, Any]) -> None:
    stack: list[tuple[object, str, int]] = [(metadata, "metadata", 0)]
    while stack:
        value, where, depth = stack.pop()
        if depth > _DEPTH:
            raise InvalidStateError(f"{where}: nested deeper than {_DEPTH} levels")
        if isinstance(value, Mapping):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise InvalidStateError(
                        f"{where}: key {key!r} is a {type(key).__name__}; JSON keys are strings"
                    )
                stack.append((item, f"{where}[{key!r}]", depth + 1))
        elif isinstance(value, (list, tuple)):
            stack.extend((item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value))
        else:
            why = _why(value)
            if why is not None:
                raise InvalidStateError(f"{where}: {why}")


def validate(metadata: object) -> Metadata | None:
    """``metadata`` checked and copied as it will be stored; ``None`` stays ``None``.

    Raises :class:`InvalidStateError` naming the key of a value JSON cannot hold (a numpy
    or torch scalar, a NaN, a non-string key), or when the whole is larger than
    :data:`METADATA_LIMIT`.
    """
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise InvalidStateError(
            f"metadata must be a mapping (a dict of JSON values), not {type(metadata).__name__}"
        )
    _check(metadata)
    text = json.dumps(metadata, allow_nan=False, separators=(",", ":"))
    if len(text.encode()) > METADATA_LIMIT:
        raise InvalidStateError(
            f"metadata is {len(text.encode())} bytes of JSON; at most {METADATA_LIMIT} are "
            "kept in a manifest: save large values in a file of the checkpoint instead"
        )
    copied: Metadata = json.loads(text)
    return copied


def differing(kept: Mapping[str, Any] | None, other: Mapping[str, Any] | None) -> list[str]:
    """The top-level keys whose values differ between ``kept`` and ``other`` (sorted)."""
    kept, other = kept or {}, other or {}
    return sorted(key for key in kept.keys() | other.keys() if kept.get(key) != other.get(key))
