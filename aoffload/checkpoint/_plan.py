"""Turning a state into what the writer needs: a pickled skeleton, a tensor list, a copy.

Pure functions, run on the engine's I/O thread (never on the event loop, since the
pickling and the copy both grow with the state):

* :func:`plan` pickles the state with every tensor replaced by a persistent id (the
  skeleton) and lays the skeleton and the tensors out, aligned, in one staging region.
  Large payloads of the skeleton (a 64 MB ``bytes`` value) are kept by reference, not
  copied: the pickler hands them to :class:`_Chunks` as they are;
* :func:`copy_into` copies the skeleton and the tensors into that region (CUDA tensors
  on a side stream), so nothing that grows with the state crosses the pipe.

A contiguous CPU tensor is copied with one ``memmove`` that releases the GIL; nothing
here changes torch's thread count, which would change it for the trainer's threads too.
"""

from __future__ import annotations

import ctypes
import io
import pickle
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._errors import ClosedError, InvalidStateError
from ._staging import Region, aligned

__all__ = ["Plan", "copy_into", "plan"]

_BY_REFERENCE = 1 << 16  # bytes: CPython's pickler hands payloads this large to write() as is


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


class _Pickler(pickle.Pickler):
    """Pickles the skeleton of a state; every tensor becomes a persistent id."""

    def __init__(self, file: io.BytesIO | _Chunks) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self._ids: dict[int, int] = {}

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
        return index


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
class Plan:
    """A state ready to stage: its skeleton and tensors, and where each goes in the region.

    The skeleton lies at offset 0 of the region, ``skeleton_nbytes`` long; tensor ``i``
    at ``offsets[i]``; ``nbytes`` is the whole region's size.
    """

    skeleton: tuple[bytes | memoryview, ...]
    skeleton_nbytes: int
    tensors: tuple[torch.Tensor, ...]
    offsets: tuple[int, ...]
    nbytes: int


def plan(state: object, name: str) -> Plan:
    """Pickle the skeleton of ``state`` and lay out its tensors; bad input names its key."""
    chunks = _Chunks()
    pickler = _Pickler(chunks)
    try:
        pickler.dump(state)
    except Exception as exc:
        found = _locate(state, "state")
        where, why = found if found is not None else ("state", f"{type(exc).__name__}: {exc}")
        raise InvalidStateError(f"cannot save {name!r}: {where}: {why}") from exc
    skeleton = chunks.close()
    offsets, total = [], aligned(chunks.nbytes)
    for tensor in pickler.tensors:
        offsets.append(total)
        total += aligned(tensor.numel() * tensor.element_size())
    return Plan(skeleton, chunks.nbytes, tuple(pickler.tensors), tuple(offsets), total)


def _memmove(target: int, source: bytes | memoryview) -> int:
    """Copy ``source`` to address ``target`` without holding the GIL; returns its size."""
    array = np.frombuffer(source, dtype=np.uint8)
    if array.size:
        ctypes.memmove(target, array.ctypes.data, array.size)
    return int(array.size)


def _copy_cpu(target: torch.Tensor, source: torch.Tensor) -> None:
    if source.is_contiguous():
        ctypes.memmove(target.data_ptr(), source.data_ptr(), target.numel() * target.element_size())
    else:
        target.copy_(source)


def copy_into(region: Region, plan: Plan) -> float:
    """Copy the plan's tensors into ``region``; returns the seconds it took."""
    started = time.perf_counter()
    array = region.segment.array
    if array is None:
        raise ClosedError("the checkpoint engine's staging memory was released")
    position = array.data_ptr() + region.offset
    for chunk in plan.skeleton:
        position += _memmove(position, chunk)
    cuda_streams: dict[torch.device, torch.cuda.Stream] = {}
    for tensor, offset in zip(plan.tensors, plan.offsets, strict=True):
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            continue
        start = region.offset + offset
        target = array[start : start + nbytes].view(tensor.dtype).view(tensor.shape)
        if tensor.is_cuda:
            region.segment.pin()
            stream = cuda_streams.get(tensor.device)
            if stream is None:
                stream = cuda_streams[tensor.device] = torch.cuda.Stream(tensor.device)  # type: ignore[no-untyped-call]
                stream.wait_stream(torch.cuda.default_stream(tensor.device))
            with torch.cuda.stream(stream):
                target.copy_(tensor.detach(), non_blocking=True)
        else:
            _copy_cpu(target, tensor.detach())
    for stream in cuda_streams.values():
        stream.synchronize()
    return time.perf_counter() - started
