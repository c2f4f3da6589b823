"""Turning a state into what the writer needs: a pickled skeleton, a tensor list, a copy.

Pure functions. :func:`plan` runs on the engine's stage thread, never on the event loop,
since the pickling grows with the state:

* :func:`plan` pickles the state with every tensor replaced by a persistent id (the
  skeleton) and lays the skeleton and the tensors out, aligned, in one staging region.
  Large payloads of the skeleton (a 64 MB ``bytes`` value) are kept by reference, not
  copied: the pickler hands them to :class:`_Chunks` as they are;
* each tensor's version counter is recorded by :func:`versions` when ``stage()`` is called,
  on the caller's thread, before it returns (a walk of the state's dicts, lists and tuples:
  O(entries), nothing that grows with the bytes); :mod:`.copy` compares it after the copy,
  and :func:`key_of` names the key of a tensor that moved (the slow, error-only path). A
  tensor the walk cannot reach (inside another object) has its version read when the
  planner meets it;
* with ``check``, the pickler also notes a value that ``torch.load(weights_only=True)``
  could not read back (:mod:`.loadable`), at no cost for a state dict of tensors.

The copy itself is :mod:`.copy`'s, so nothing that grows with the state crosses the pipe.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Any

import torch

from ..._errors import InvalidStateError
from .loadable import Allowed, message, refused

__all__ = [
    "ALIGN",
    "Plan",
    "Structure",
    "Versions",
    "View",
    "aligned",
    "cpu_storages",
    "key_of",
    "plan",
    "restructured",
    "version_of",
    "versions",
]

ALIGN = 64
"""Byte alignment of every tensor inside a staging region (fits every dtype and AVX-512)."""
_BY_REFERENCE = 1 << 16  # bytes: CPython's pickler hands payloads this large to write() as is
_UNRECORDED: Any = object()


def aligned(nbytes: int, to: int = ALIGN) -> int:
    """``nbytes`` rounded up to a multiple of ``to``."""
    return (nbytes + to - 1) // to * to


def _tensor_problem(tensor: torch.Tensor) -> str | None:
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        return f"tensor subclass {type(tensor).__qualname__} is not supported"
    if tensor.layout is not torch.strided or tensor.is_nested:
        return f"tensors with layout {tensor.layout} are not supported (only dense tensors)"
    if tensor.is_quantized:
        return "quantized tensors are not supported"
    if tensor.device.type not in ("cpu", "cuda"):
        return f"tensors on device {tensor.device} are not supported (only cpu and cuda)"
    return None


class _Unsupported(Exception):
    pass


class _Chunks:
    """The pickler's file: small writes are gathered, large payloads kept by reference.

    CPython's pickler passes a payload of 64 KiB or more to ``write`` as the object
    itself; keeping a view of it instead of copying means the only copy of a large
    value is the GIL-free one into staging memory.
    """

    def __init__(self) -> None:
        self.chunks: list[bytes | memoryview] = []
        self.nbytes = 0
        self._small = bytearray()

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        if len(view) >= _BY_REFERENCE:
            self._flush()
            self.chunks.append(view)
        else:
            self._small += view
        self.nbytes += len(view)
        return len(view)

    def _flush(self) -> None:
        if self._small:
            self.chunks.append(bytes(self._small))
            self._small.clear()

    def close(self) -> tuple[bytes | memoryview, ...]:
        """Every chunk, in order."""
        self._flush()
        return tuple(self.chunks)


Versions = dict[int, int | None]
"""Each tensor's version counter when ``stage()`` was called, by ``id(tensor)``."""


Structure = list[tuple[dict[Any, Any] | list[Any], tuple[Any, ...] | int]]
"""Each dict of a state with its keys, each list with its length, when ``stage()`` was called."""


def versions(state: object, structure: Structure | None = None) -> Versions:
    """The version counter of every tensor in ``state``'s dicts, lists and tuples, by id.

    Runs on the caller's thread when ``stage()`` is called; O(entries). With
    ``structure``, also appends each dict and its keys, each list and its length, for
    :func:`restructured` to compare at the fence.
    """
    found: Versions = {}
    stack = [state]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            if id(value) not in found:
                found[id(value)] = version_of(value)
        elif isinstance(value, dict):
            if structure is not None:
                structure.append((value, tuple(value)))
            stack.extend(value.values())
        elif isinstance(value, list):
            if structure is not None:
                structure.append((value, len(value)))
            stack.extend(value)
        elif isinstance(value, tuple):
            stack.extend(value)
    return found


def restructured(structure: Structure, state: object) -> str | None:
    """What changed in ``state``'s structure since ``structure`` was recorded (a key added
    to or removed from a dict, a list grown or shrunk), naming the key; ``None`` if nothing.

    O(entries) where nothing changed; ``state`` names the key (the error path only).
    """
    for container, recorded in structure:
        if isinstance(recorded, int):
            if len(container) != recorded:
                where = key_of(state, container) or "a list of the state"
                return f"{where} changed length from {recorded} to {len(container)}"
            continue
        if len(container) == len(recorded) and tuple(container) == recorded:
            continue
        before = set(recorded)
        added = [key for key in container if key not in before]
        removed = [key for key in recorded if key not in container]
        if not added and not removed:
            continue  # the same keys, reordered: the same state
        where = key_of(state, container) or "a dict of the state"
        key, change = (added[0], "added") if added else (removed[0], "removed")
        return f"{where}[{key!r}] was {change}"
    return None


class _Pickler(pickle.Pickler):
    """Pickles the skeleton of a state; every tensor becomes a persistent id."""

    def __init__(self, file: io.BytesIO | _Chunks, recorded: Versions | None = None) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self.versions: list[int | None] = []
        self._ids: dict[int, int] = {}
        self._recorded = recorded or {}

    def persistent_id(self, obj: Any) -> int | None:
        if not isinstance(obj, torch.Tensor):
            return None
        index = self._ids.get(id(obj))
        if index is None:
            problem = _tensor_problem(obj)
            if problem is not None:
                raise _Unsupported(problem)
            index = self._ids[id(obj)] = len(self.tensors)
            self.tensors.append(obj)
            recorded = self._recorded.get(id(obj), _UNRECORDED)
            self.versions.append(version_of(obj) if recorded is _UNRECORDED else recorded)
        return index


class _CheckingPickler(_Pickler):
    """:class:`_Pickler` that also notes the first global the default load refuses."""

    def __init__(self, file: _Chunks, recorded: Versions | None = None) -> None:
        super().__init__(file, recorded)
        self.allowed = Allowed()
        self.refused: str | None = None

    def reducer_override(self, obj: Any) -> Any:
        if self.refused is None:
            self.refused = refused(obj, self.allowed)
        return NotImplemented


def cpu_storages(state: object) -> set[int]:
    """The addresses of the CPU storages of ``state``'s tensors (its dicts, lists and tuples).

    Runs on the caller's thread when ``stage()`` is called and something is guarded
    (:mod:`aoffload._runtime.gate`); O(entries).
    """
    found: set[int] = set()
    stack = [state]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            if value.device.type == "cpu" and value.layout == torch.strided:
                try:
                    found.add(value.untyped_storage().data_ptr())
                except (RuntimeError, NotImplementedError):
                    continue  # no storage of its own (a subclass, a functional tensor)
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    return found


def version_of(tensor: torch.Tensor) -> int | None:
    """The tensor's in-place version counter, or ``None`` where it keeps none (inference mode)."""
    try:
        return int(tensor._version)
    except RuntimeError:
        return None


def key_of(value: object, target: object, key: str = "state") -> str | None:
    """The key path of ``target`` inside ``value`` (by identity), or ``None``."""
    if value is target:
        return key
    items: Any = ()
    if isinstance(value, dict):
        items = ((f"{key}[{k!r}]", v) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{key}[{i}]", v) for i, v in enumerate(value))
    for path, item in items:
        found = key_of(item, target, path)
        if found is not None:
            return found
    return None


def _locate(value: object, key: str) -> tuple[str, str] | None:
    """Find the first key whose value cannot be saved, and why (the slow, error-only path)."""
    if isinstance(value, dict):
        for k, v in value.items():
            found = _locate(v, f"{key}[{k!r}]")
            if found is not None:
                return found
        return None
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = _locate(v, f"{key}[{i}]")
            if found is not None:
                return found
        return None
    try:
        _Pickler(io.BytesIO()).dump(value)
    except Exception as exc:  # noqa: BLE001 - reported to the caller with its key
        return key, f"{type(exc).__name__}: {exc}"
    return None


@dataclass(frozen=True, slots=True)
class View:
    """How one tensor of the state lies in its storage (``storage``: an index into
    :attr:`Plan.storages`), and what it is (``parameter``: an ``nn.Parameter``)."""

    storage: int
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    parameter: bool


def _storages(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[View]]:
    """Each distinct storage of ``tensors`` once, as a flat ``uint8`` tensor over all of
    it, and each tensor's :class:`View` of it: tensors that share a storage (views of one
    tensor) are staged once and share it again when loaded, as with ``torch.save``."""
    storages: list[torch.Tensor] = []
    index: dict[object, int] = {}
    views: list[View] = []
    for tensor in tensors:
        source = tensor.detach()
        if source.is_conj() or source.is_neg():  # bits of the tensor, not of its storage
            source = source.resolve_conj().resolve_neg()
        storage = source.untyped_storage()
        key: object = storage._cdata if storage.nbytes() else ("empty", len(views))
        if key not in index:
            index[key] = len(storages)
            whole = torch.empty((0,), dtype=torch.uint8, device=source.device)
            storages.append(whole.set_(storage))
        views.append(
            View(
                index[key],
                int(source.storage_offset()),
                tuple(source.shape),
                tuple(source.stride()),
                source.dtype,
                tensor.requires_grad,
                isinstance(tensor, torch.nn.Parameter),
            )
        )
    return storages, views


@dataclass(frozen=True, slots=True)
class Plan:
    """A state ready to stage: its skeleton and tensors, and where each goes in the region.

    The skeleton lies at offset 0 of the region, ``skeleton_nbytes`` long; storage ``i``
    (a flat ``uint8`` tensor over all of it) at ``offsets[i]``; tensor ``i`` is
    ``views[i]`` of its storage, with version counter ``versions[i]`` as recorded;
    ``nbytes`` is the whole region's size. ``state`` is kept to name a key on the error path only.
    ``unloadable`` says why ``torch.load(weights_only=True)`` would not read the file
    back (``None``: it would, or nobody checked).
    """

    skeleton: tuple[bytes | memoryview, ...]
    skeleton_nbytes: int
    tensors: tuple[torch.Tensor, ...]
    offsets: tuple[int, ...]
    nbytes: int
    versions: tuple[int | None, ...]
    state: object
    unloadable: str | None = None
    storages: tuple[torch.Tensor, ...] = ()
    views: tuple[View, ...] = ()

    def modified(self) -> tuple[str, int | None, int | None] | None:
        """The first tensor whose version counter moved since it was recorded: its key,
        the recorded and the current counter; ``None`` if none moved."""
        for tensor, recorded in zip(self.tensors, self.versions, strict=True):
            now = version_of(tensor)
            if recorded is not None and now != recorded:
                key = key_of(self.state, tensor) or f"a tensor of shape {tuple(tensor.shape)}"
                return key, recorded, now
        return None


def plan(state: object, name: str, recorded: Versions | None = None, check: bool = False) -> Plan:
    """Pickle the skeleton of ``state`` and lay out its tensors; bad input names its key.

    ``recorded`` holds the version counters :func:`versions` read at ``stage()``;
    ``check`` looks for values the default load could not read back.
    """
    chunks = _Chunks()
    pickler = _CheckingPickler(chunks, recorded) if check else _Pickler(chunks, recorded)
    try:
        pickler.dump(state)
    except Exception as exc:
        found = _locate(state, "state")
        where, why = found if found is not None else ("state", f"{type(exc).__name__}: {exc}")
        raise InvalidStateError(f"cannot save {name!r}: {where}: {why}") from exc
    skeleton = chunks.close()
    unloadable = None
    if isinstance(pickler, _CheckingPickler) and pickler.refused is not None:
        unloadable = message(name, state, pickler.refused, pickler.allowed)
    storages, views = _storages(pickler.tensors)
    offsets, total = [], aligned(chunks.nbytes)
    for storage in storages:
        offsets.append(total)
        total += aligned(storage.numel())
    return Plan(
        skeleton,
        chunks.nbytes,
        tuple(pickler.tensors),
        tuple(offsets),
        total,
        tuple(pickler.versions),
        state,
        unloadable,
        tuple(storages),
        tuple(views),
    )
