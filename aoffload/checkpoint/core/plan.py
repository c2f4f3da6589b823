"""Turning a state into what the writer needs: ``torch.save``'s pickle, its storages, a layout.

Pure functions. :func:`plan` runs on the engine's stage thread, never on the event loop,
since the pickling grows with the state:

* :func:`plan` pickles the state as ``torch.save`` does (:mod:`.pickler`: protocol 2, a
  persistent id per storage) and lays the pickle, its large ``bytes`` values and the
  storages out, aligned, in one staging region. Large payloads of the pickle (a big
  ``str``) are kept by reference, not copied: the pickler hands them to :class:`_Chunks`
  as they are; large ``bytes`` values are cut out of it, staged raw, and encoded by the
  writer (:meth:`.pickler.TorchPickler.pieces`);
* each tensor's version counter is recorded by :func:`versions` when ``stage()`` is called,
  on the caller's thread, before it returns (a walk of the state's dicts, lists and tuples:
  O(entries), nothing that grows with the bytes); :mod:`.copy` compares it after the copy,
  and :func:`key_of` names the key of a tensor that moved (the slow, error-only path). A
  tensor the walk cannot reach (inside another object) has its version read when the
  pickler meets it;
* with ``check``, the pickler also notes a value that ``torch.load(weights_only=True)``
  could not read back (:mod:`.loadable`), at a dictionary lookup per class met.

The copy itself is :mod:`.copy`'s, so nothing that grows with the state crosses the pipe.
"""

from __future__ import annotations

import collections
import io
from dataclasses import dataclass
from typing import Any

import torch

from ..._errors import InvalidStateError
from .loadable import Allowed, message, refused
from .pickler import TorchPickler, version_of

__all__ = [
    "ALIGN",
    "Plan",
    "Structure",
    "Versions",
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


def aligned(nbytes: int, to: int = ALIGN) -> int:
    """``nbytes`` rounded up to a multiple of ``to``."""
    return (nbytes + to - 1) // to * to


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


_NEVER_REFUSED = frozenset({torch.Tensor, torch.nn.Parameter, collections.OrderedDict})
"""Instances met once per tensor, which :func:`.loadable.refused` never refuses."""


class _CheckingPickler(TorchPickler):
    """:class:`.pickler.TorchPickler` that also notes the first global the default load
    refuses."""

    def __init__(self, file: _Chunks, recorded: Versions | None = None) -> None:
        super().__init__(file, recorded)
        self.allowed = Allowed()
        self.refused: str | None = None

    def reducer_override(self, obj: Any) -> Any:
        if self.refused is None and type(obj) not in _NEVER_REFUSED:
            self.refused = refused(obj, self.allowed)
        return super().reducer_override(obj)


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
        TorchPickler(io.BytesIO()).dump(value)
    except Exception as exc:  # noqa: BLE001 - reported to the caller with its key
        return key, f"{type(exc).__name__}: {exc}"
    return None


def _flat(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat ``uint8`` tensor over all of ``storage`` (on its device), for the copy."""
    return torch.empty((0,), dtype=torch.uint8, device=storage.device).set_(storage)


@dataclass(frozen=True, slots=True)
class Plan:
    """A state ready to stage: its pickle, blobs and storages, and where each goes.

    The pickle (``torch.save``'s ``data.pkl`` with the blobs cut out) lies at offset 0 of
    the region, ``pickle_nbytes`` long; blob ``i`` (a large ``bytes`` value the writer
    encodes into the pickle at ``blobs[i][0]``) at ``blob_offsets[i]``; storage ``i`` (a
    flat ``uint8`` tensor over all of it, ``data/<i>`` of the archive) at
    ``storage_offsets[i]``; ``nbytes`` is the whole region's size. Tensor ``i`` of the
    state had version counter ``versions[i]`` when recorded. ``state`` is kept to name a
    key on the error path only. ``unloadable`` says why ``torch.load(weights_only=True)``
    would not read the file back (``None``: it would, or nobody checked).
    """

    pickle: tuple[bytes | memoryview, ...]
    pickle_nbytes: int
    blobs: tuple[tuple[int, bytes], ...]
    blob_offsets: tuple[int, ...]
    storages: tuple[torch.Tensor, ...]
    storage_offsets: tuple[int, ...]
    nbytes: int
    tensors: tuple[torch.Tensor, ...]
    versions: tuple[int | None, ...]
    state: object
    unloadable: str | None = None

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
    """Pickle ``state`` as ``torch.save`` does and lay it out; bad input names its key.

    ``recorded`` holds the version counters :func:`versions` read at ``stage()``;
    ``check`` looks for values the default load could not read back.
    """
    chunks = _Chunks()
    pickler = _CheckingPickler(chunks, recorded) if check else TorchPickler(chunks, recorded)
    try:
        pickler.dump(state)
        pieces, blobs = pickler.pieces(chunks.close())
    except Exception as exc:
        found = _locate(state, "state")
        where, why = found if found is not None else ("state", f"{type(exc).__name__}: {exc}")
        raise InvalidStateError(f"cannot save {name!r}: {where}: {why}") from exc
    unloadable = None
    if isinstance(pickler, _CheckingPickler) and pickler.refused is not None:
        unloadable = message(name, state, pickler.refused, pickler.allowed)
    pickle_nbytes = sum(len(piece) for piece in pieces)
    total = aligned(pickle_nbytes)
    blob_offsets, storage_offsets = [], []
    for _, value in blobs:
        blob_offsets.append(total)
        total += aligned(len(value))
    storages = tuple(_flat(storage) for storage in pickler.storages)
    for storage in storages:
        storage_offsets.append(total)
        total += aligned(storage.numel())
    return Plan(
        tuple(pieces),
        pickle_nbytes,
        tuple(blobs),
        tuple(blob_offsets),
        storages,
        tuple(storage_offsets),
        total,
        tuple(pickler.tensors),
        tuple(pickler.versions),
        state,
        unloadable,
    )
