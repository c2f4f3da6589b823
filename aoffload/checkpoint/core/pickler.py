"""The state's pickle in ``torch.save``'s own format, made in the trainer's process.

:class:`TorchPickler` pickles a state as ``torch.save`` does (``torch.serialization._save``,
torch 2.13): pickle protocol 2, every storage a persistent id
``("storage", <storage type>, "<key>", "cpu", <numel>)``, with keys ``"0"``, ``"1"``, ...
in the order the storages are first met, and a tensor reduced by torch's own rules
(``_rebuild_tensor_v2`` with a typed storage, ``_rebuild_tensor_v3`` for the dtypes torch
saves untyped, ``_rebuild_parameter`` for an ``nn.Parameter``). The writer process then
writes the archive around that pickle (``writer/archive.py``) and never unpickles it: a
class defined in the training script's ``__main__`` saves as it does with ``torch.save``.
The location is always ``"cpu"``: what is written is the staged copy in host memory, so
a CUDA tensor loads on the CPU unless ``map_location`` says otherwise.

Three departures from ``torch.save``'s code path, none from its output:

* a plain tensor or ``Parameter`` without Python state or hooks is reduced here, without
  torch's generic ``__reduce_ex__`` (about 56 us a tensor, which would hold the GIL for
  0.1 s per 2,000 tensors); the pickle is byte for byte what torch's reduction makes
  (``tests/test_checkpoint_format.py`` compares them); any other tensor goes through
  torch's own reduction;
* every tensor met is also recorded, with its version counter (the mutation check), and
  refused when aoffload cannot stage it (:func:`tensor_problem`);
* a ``bytes`` value of :data:`BLOB` bytes or more is not encoded here: protocol 2 pickles
  it as ``_codecs.encode(<its latin-1 text>, "latin1")``, whose UTF-8 encoding holds the
  GIL for about 5 ms per MB. It is pickled as a one-off persistent id instead, cut out of
  the pickle afterwards (:meth:`TorchPickler.pieces`), staged as raw bytes, and encoded by
  the writer where the id stood, which gives the same opcodes torch writes.
"""

from __future__ import annotations

import collections
import pickle
import re
import secrets
from typing import Any

import torch

__all__ = [
    "BLOB",
    "PROTOCOL",
    "Blob",
    "StorageRef",
    "TorchPickler",
    "Unsupported",
    "tensor_problem",
    "version_of",
]

PROTOCOL: int = torch.serialization.DEFAULT_PROTOCOL
"""``torch.save``'s pickle protocol (2), the one its weights-only unpickler reads."""
BLOB = 1 << 16
"""Bytes from which a ``bytes`` value is encoded by the writer (see the module)."""

_V3_DTYPES = frozenset(torch.storage._new_dtypes())
_rebuild_tensor_v2: Any = torch._utils._rebuild_tensor_v2
_rebuild_tensor_v3: Any = torch._utils._rebuild_tensor_v3
_rebuild_parameter: Any = torch._utils._rebuild_parameter
_get_tensor_metadata: Any = torch._C._get_tensor_metadata  # type: ignore[attr-defined]
_STORAGE_TYPES: dict[torch.dtype, Any] = {
    dtype: getattr(torch, name)
    for dtype, name in torch.storage._dtype_to_storage_type_map().items()
}
_PLAIN = frozenset(
    {int, float, str, bool, type(None), tuple, list, dict, collections.OrderedDict, torch.Tensor}
)


def tensor_problem(tensor: torch.Tensor) -> str | None:
    """Why aoffload cannot stage ``tensor``, or ``None``."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        return f"tensor subclass {type(tensor).__qualname__} is not supported"
    if tensor.layout is not torch.strided or tensor.is_nested:
        return f"tensors with layout {tensor.layout} are not supported (only dense tensors)"
    if tensor.is_quantized:
        return "quantized tensors are not supported"
    if tensor.device.type not in ("cpu", "cuda"):
        return f"tensors on device {tensor.device} are not supported (only cpu and cuda)"
    return None


class Unsupported(Exception):
    """A value of the state that aoffload cannot stage (the planner names its key)."""


class StorageRef:
    """A storage as the fast reduction names it: pickled as its persistent id."""

    __slots__ = ("dtype", "storage")

    def __init__(self, storage: torch.UntypedStorage, dtype: torch.dtype) -> None:
        self.storage = storage
        self.dtype = dtype


class Blob:
    """A large ``bytes`` value, pickled as a one-off persistent id: ``pid``, an int of 64
    random bits and more, which the pickle spells as ``marker`` (``LONG1``, 9 bytes,
    ``BINPERSID``): a sequence no other part of the pickle spells but by a 2**-64 chance,
    which :meth:`TorchPickler.pieces` checks."""

    __slots__ = ("marker", "pid", "value")

    def __init__(self, value: bytes) -> None:
        self.value = value
        self.pid = secrets.randbits(64) | 1 << 63
        self.marker = pickle.dumps(self.pid, PROTOCOL)[2:-1] + pickle.BINPERSID


class TorchPickler(pickle.Pickler):
    """Pickles a state as ``torch.save`` does; collects its tensors, storages and blobs.

    ``versions`` are the counters recorded at ``stage()`` by ``id(tensor)``; a tensor
    not among them has its counter read when it is met.
    """

    def __init__(self, file: Any, versions: dict[int, int | None] | None = None) -> None:
        super().__init__(file, protocol=PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self.versions: list[int | None] = []
        self.storages: list[torch.UntypedStorage] = []
        self.blobs: list[Blob] = []
        self._seen: set[int] = set()
        self._keys: dict[int, str] = {}
        self._dtypes: dict[int, torch.dtype] = {}
        self._recorded = versions or {}

    # -- tensors ----------------------------------------------------------------------

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        if id(obj) not in self._seen:
            problem = tensor_problem(obj)
            if problem is not None:
                raise Unsupported(problem)
            self._seen.add(id(obj))
            self.tensors.append(obj)  # alive while the plan is: ids are not reused
            recorded = self._recorded.get(id(obj), _UNRECORDED)
            self.versions.append(version_of(obj) if recorded is _UNRECORDED else recorded)
        if obj.__dict__ or obj._backward_hooks:
            return NotImplemented  # Python state or hooks: torch's own reduction (it warns)
        if type(obj) is torch.nn.Parameter:
            return _rebuild_parameter, (obj.data, obj.requires_grad, collections.OrderedDict())
        dtype = obj.dtype
        args: tuple[Any, ...] = (
            StorageRef(obj.untyped_storage(), dtype),
            obj.storage_offset(),
            tuple(obj.size()),
            obj.stride(),
            obj.requires_grad,
            collections.OrderedDict(),
        )
        rebuild = _rebuild_tensor_v2
        if dtype in _V3_DTYPES:
            rebuild, args = _rebuild_tensor_v3, (*args, dtype)
        metadata = _get_tensor_metadata(obj)
        return rebuild, ((*args, metadata) if metadata else args)

    # -- persistent ids -----------------------------------------------------------------

    def persistent_id(self, obj: Any) -> Any:
        kind = type(obj)  # called for every object pickled: the usual ones leave at once
        if kind in _PLAIN:
            return None
        if kind is StorageRef:
            return self._storage(obj.storage, obj.dtype, typed=obj.dtype not in _V3_DTYPES)
        if kind is bytes:
            if len(obj) < BLOB:
                return None
            blob = Blob(obj)
            self.blobs.append(blob)
            return blob.pid
        if isinstance(obj, torch.storage.TypedStorage):
            return self._storage(obj._untyped_storage, obj.dtype, typed=True)
        if isinstance(obj, torch.UntypedStorage):
            return self._storage(obj, torch.uint8, typed=False)
        return None

    def _storage(self, storage: torch.UntypedStorage, dtype: torch.dtype, typed: bool) -> Any:
        nbytes = storage.nbytes()
        if storage.device.type not in ("cpu", "cuda"):
            raise Unsupported(f"storages on device {storage.device} are not supported")
        address = storage.data_ptr()
        if address:  # as torch.save: one storage, one dtype
            known = self._dtypes.setdefault(address, dtype)
            if known != dtype:
                raise Unsupported(
                    "cannot save multiple tensors or storages that view the same data as "
                    f"different types ({known} and {dtype}), as torch.save cannot"
                )
        key = self._keys.get(storage._cdata)
        if key is None:
            key = self._keys[storage._cdata] = str(len(self._keys))
            self.storages.append(storage)
        if not typed:
            return ("storage", torch.UntypedStorage, key, "cpu", nbytes)
        return ("storage", _STORAGE_TYPES[dtype], key, "cpu", nbytes // dtype.itemsize)

    # -- the pickle, cut around its blobs -------------------------------------------------

    def pieces(
        self, chunks: tuple[bytes | memoryview, ...]
    ) -> tuple[list[bytes | memoryview], list[tuple[int, bytes]]]:
        """The pickle ``chunks`` (what this pickler wrote) with every blob's persistent id
        cut out, and each blob with where it goes: its offset in the cut pickle.

        Raises :class:`RuntimeError` if a marker is not found exactly once."""
        if not self.blobs:
            return list(chunks), []
        cuts: dict[int, list[tuple[int, Blob]]] = {}  # chunk number -> (index, blob)
        for blob in self.blobs:
            pattern = re.compile(re.escape(blob.marker))
            hits = [
                (number, found.start())
                for number, chunk in enumerate(chunks)
                for found in pattern.finditer(chunk)
            ]
            if len(hits) != 1:
                raise RuntimeError(
                    f"the marker of a bytes value occurs {len(hits)} times in the pickle"
                )
            number, index = hits[0]
            cuts.setdefault(number, []).append((index, blob))
        out: list[bytes | memoryview] = []
        blobs: list[tuple[int, bytes]] = []
        position = 0
        for number, chunk in enumerate(chunks):
            view, taken = memoryview(chunk).cast("B"), 0
            for index, blob in sorted(cuts.get(number, ()), key=lambda cut: cut[0]):
                out.append(view[taken:index])
                position += index - taken
                blobs.append((position, blob.value))
                taken = index + len(blob.marker)
            out.append(view[taken:] if taken else chunk)
            position += len(view) - taken
        return [piece for piece in out if len(piece)], blobs


_UNRECORDED: Any = object()


def version_of(tensor: torch.Tensor) -> int | None:
    """The tensor's in-place version counter, or ``None`` where it keeps none (inference mode)."""
    try:
        return int(tensor._version)
    except RuntimeError:
        return None
