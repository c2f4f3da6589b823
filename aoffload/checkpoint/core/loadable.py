"""Can the default load read a staged value back? The check made while the state is planned.

``load()`` reads a file with ``torch.load(weights_only=True)``, whose unpickler accepts only
the globals torch allows (its tensors, dtypes, ``OrderedDict``, ``set``, ...) and those the
user allowed with ``torch.serialization.add_safe_globals``. A state holding anything else
(``np.random.get_state()``, a ``collections.deque``, a dataclass) saves and commits fine,
then fails to load. The planner's pickler (:mod:`.plan`) finds such a value as it pickles
the state, through ``reducer_override``: CPython's pickler calls it for every class and
function it is about to pickle by name (once: the pickle memoizes it), and never for the
values it has a fast path for (dicts, lists, tuples, str, int, float, bytes, None). The
instances it meets once per tensor (the tensor, its empty hooks ``OrderedDict``) are never
refused and not asked about, so a state dict of tensors costs a few lookups whatever its
size. The error path alone (:func:`locate`) walks the state to name the key; it pickles
with ``torch.save``'s protocol (2), as the planner does, so what it finds (a ``frozenset``,
pickled by name there) is what the load refuses.
"""

from __future__ import annotations

import pickle
import types
from typing import Any, Literal, get_args

import torch

__all__ = ["UNLOADABLE", "Allowed", "Unloadable", "locate", "message", "refused"]

Unloadable = Literal["warn", "error", "ignore"]
"""What ``stage()`` does with a value ``torch.load(weights_only=True)`` cannot read back."""
UNLOADABLE: tuple[Unloadable, ...] = get_args(Unloadable)
"""Its values."""

_whichmodule: Any = pickle.whichmodule  # type: ignore[attr-defined]  # public, untyped

_BY_NAME = (
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodDescriptorType,
    types.WrapperDescriptorType,
    types.ClassMethodDescriptorType,
)


class Allowed:
    """The globals ``torch.load(weights_only=True)`` accepts, read when first needed.

    torch keeps them in its private ``torch._weights_only_unpickler``; where that is
    missing (another torch), :meth:`known` is false and nothing is flagged.
    """

    __slots__ = ("_builtin", "_user", "known")

    def __init__(self) -> None:
        self._builtin: Any = None
        self._user: Any = None
        self.known = True

    def __contains__(self, name: str) -> bool:
        if self._builtin is None:
            try:
                from torch import _weights_only_unpickler as unpickler

                self._builtin = unpickler._get_allowed_globals()
                self._user = unpickler._get_user_allowed_globals()  # type: ignore[no-untyped-call]
            except (ImportError, AttributeError, TypeError, ValueError):
                self.known, self._builtin, self._user = False, {}, {}
        return not self.known or name in self._builtin or name in self._user


def refused(obj: object, allowed: Allowed) -> str | None:
    """The global ``obj`` is pickled as, if the default load refuses it; else ``None``.

    Called for what the pickler meets beyond its fast paths; an instance is judged by
    the class or function its reduction names, which the pickler meets next.
    """
    if isinstance(obj, torch.dtype):
        name = str(obj)  # pickled by name: torch.float32
    elif isinstance(obj, _BY_NAME):
        qualname = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
        if not isinstance(qualname, str):
            return None
        module = getattr(obj, "__module__", None) or _whichmodule(obj, qualname)
        name = f"{module}.{qualname}"
    elif obj is Ellipsis or obj is NotImplemented:
        name = f"builtins.{obj!r}"
    else:
        return None
    return None if name in allowed else name


class _Sink:
    def write(self, data: bytes | bytearray | memoryview) -> int:
        return len(data)


_SKIPPED = frozenset({bytes, str})


class _Checker(pickle.Pickler):
    """Pickles one value into nothing, noting the first global the default load refuses."""

    def __init__(self, allowed: Allowed) -> None:
        super().__init__(_Sink(), protocol=torch.serialization.DEFAULT_PROTOCOL)
        self.allowed = allowed
        self.refused: str | None = None

    def persistent_id(self, obj: Any) -> int | None:
        # what names no global is skipped: a tensor, and the bytes and str whose encoding
        # (a large bytes value's protocol-2 UTF-8) would hold the GIL for nothing
        return 0 if type(obj) in _SKIPPED or isinstance(obj, torch.Tensor) else None

    def reducer_override(self, obj: Any) -> Any:
        if self.refused is None:
            self.refused = refused(obj, self.allowed)
        return NotImplemented


def _refused_in(value: object, allowed: Allowed) -> str | None:
    checker = _Checker(allowed)
    try:
        checker.dump(value)
    except Exception:  # noqa: BLE001 - the planner already pickled it; only a global is sought
        return None
    return checker.refused


def locate(state: object, allowed: Allowed) -> tuple[str, str] | None:
    """The first key of ``state`` whose value the default load refuses, and the global it
    needs (the slow, warning-only path)."""
    stack: list[tuple[object, str]] = [(state, "state")]
    while stack:
        value, key = stack.pop()
        plain = type(value) in (dict, list, tuple)
        if not plain and isinstance(value, (dict, list, tuple)):
            name = refused(type(value), allowed)
            if name is not None:
                return key, name
        if isinstance(value, dict):
            items = [(v, f"{key}[{k!r}]") for k, v in value.items()]
            stack.extend(reversed(items))
        elif isinstance(value, (list, tuple)):
            stack.extend(reversed([(v, f"{key}[{i}]") for i, v in enumerate(value)]))
        elif not isinstance(value, torch.Tensor):
            name = _refused_in(value, allowed)
            if name is not None:
                return key, name
    return None


def message(name: str, state: object, found: str, allowed: Allowed) -> str:
    """Say that file ``name`` holds a value the default load refuses (``found``: its global)."""
    where = locate(state, allowed)
    key, found = where if where is not None else ("a value of the state", found)
    return (
        f"{name!r}: {key} is pickled as {found}, which torch.load(weights_only=True) refuses, "
        "so the default load() of this file will fail. Save it as tensors or plain Python "
        "values (a numpy array as torch.from_numpy(...)), allow it with "
        f"torch.serialization.add_safe_globals([{found}]), or load the file with "
        "load(..., weights_only=False) if you trust it"
    )
