"""A DCP data file's records, as DCP's ``FileSystemWriter`` writes them, made for aoffload's writer.

``FileSystemWriter`` writes each tensor item as a whole ``torch.save`` of the tensor (a
view first cloned to its own bytes) and each other item as the planner's bytes, one after
the other; ``_StorageInfo(file, offset, length)`` is where each landed. Here each tensor
item is a :class:`~aoffload.checkpoint.writer.calls.TorchRecord`: the pickle
``torch.save`` makes for the tensor alone (:func:`tensor_pickle`: its storage
``("storage", <type>, "0", "cpu", <numel>)``, offset 0) and one span of staging memory,
the tensor's own bytes; the writer process writes the archive around them. Any reader of
DCP checkpoints (``FileSystemReader``, ``torch.load`` of the record) reads the result.
"""

from __future__ import annotations

import collections
import functools
import io
import pickle
from typing import Any

import torch

from ..checkpoint.core.pickler import PROTOCOL

__all__ = ["dense", "tensor_pickle"]

_V3_DTYPES = frozenset(torch.storage._new_dtypes())
_rebuild_tensor_v2: Any = torch._utils._rebuild_tensor_v2
_rebuild_tensor_v3: Any = torch._utils._rebuild_tensor_v3
_STORAGE_TYPES: dict[torch.dtype, Any] = {
    dtype: getattr(torch, name)
    for dtype, name in torch.storage._dtype_to_storage_type_map().items()
}


class _Storage:
    """The record's one storage, pickled as its persistent id."""


_STORAGE = _Storage()


class _Tensor:
    """A tensor as ``torch.save`` reduces it, without the tensor."""

    def __init__(self, rebuild: Any, args: tuple[Any, ...]) -> None:
        self.rebuild, self.args = rebuild, args

    def __reduce__(self) -> tuple[Any, ...]:
        return self.rebuild, self.args


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, pid: tuple[Any, ...]) -> None:
        super().__init__(file, protocol=PROTOCOL)
        self._pid = pid

    def persistent_id(self, obj: Any) -> Any:
        return self._pid if obj is _STORAGE else None


@functools.lru_cache(maxsize=4096)
def _pickle(dtype: torch.dtype, size: tuple[int, ...], stride: tuple[int, ...]) -> bytes:
    numel = 1
    for n in size:
        numel *= n
    hooks: Any = collections.OrderedDict()
    args: tuple[Any, ...] = (_STORAGE, 0, size, stride, False, hooks)
    if dtype in _V3_DTYPES:
        pid = ("storage", torch.UntypedStorage, "0", "cpu", numel * dtype.itemsize)
        rebuild, args = _rebuild_tensor_v3, (*args, dtype)
    else:
        pid = ("storage", _STORAGE_TYPES[dtype], "0", "cpu", numel)
        rebuild = _rebuild_tensor_v2
    out = io.BytesIO()
    _Pickler(out, pid).dump(_Tensor(rebuild, args))
    return out.getvalue()


def tensor_pickle(tensor: torch.Tensor) -> bytes:
    """``data.pkl`` of ``torch.save(tensor)`` for a tensor whose storage is exactly its
    own bytes (what DCP's writer saves: the tensor, cloned first if it is a view), for
    the ``tensor``'s dtype, size and stride. ``tensor`` must be :func:`dense`."""
    return _pickle(tensor.dtype, tuple(tensor.size()), tuple(tensor.stride()))


def dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements are exactly the ``numel * itemsize`` bytes from its
    first element (contiguous, or a permutation of a contiguous tensor), so that those
    bytes are its whole storage in a record."""
    if not (
        type(tensor) in (torch.Tensor, torch.nn.Parameter)
        and tensor.layout == torch.strided
        and not tensor.is_quantized
        and not tensor.is_conj()
        and not tensor.is_neg()
    ):
        return False
    expected = 1
    for size, stride in sorted(
        (d for d in zip(tensor.size(), tensor.stride(), strict=True) if d[0] != 1),
        key=lambda d: d[1],
    ):
        if stride != expected:
            return False
        expected *= size
    return True
