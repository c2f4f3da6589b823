"""One file being written from its records, as their bytes arrive; no torch.

A :class:`FileStream` turns a :class:`~.calls.WriteRecords`'s records into a flat list
of *steps*: the parts whose bytes make the file (a pickle, its blobs, each storage, a raw
record) and the markers between them (a record starts; the pickle is complete; an archive
ends). It runs the steps in order: a part given as a span or bytes is consumed at once, a
:class:`~.calls.Streamed` part waits for :meth:`FileStream.feed`, which continues the
streamed parts (all of them, in order, as one stream) where the last feed stopped. A
``torch.save`` archive's ``data.pkl`` is written once its pickle and blobs are complete
(held in the writer's own memory when streamed: they are small but for large ``bytes``
values); a storage's bytes go to the sink as they come, so the writer holds none of
them. When the last step has run, :meth:`FileStream.done` is true.
"""

from __future__ import annotations

import codecs
import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .archive import Archive, Out
from .calls import Data, RawRecord, Record, Streamed, TorchRecord

__all__ = ["FileStream", "records_nbytes"]

_ENCODE_CHUNK = 16 << 20  # bytes of a blob encoded at a time
_BLOB_HEAD = b"c_codecs\nencode\nX"  # GLOBAL _codecs.encode, BINUNICODE <length> ...
_BLOB_TAIL = b"X\x06\x00\x00\x00latin1\x86R"  # ... BINUNICODE "latin1", TUPLE2, REDUCE


class _Kind(enum.Enum):
    RECORD = "record"  # a record starts: note its offset
    PICKLE = "pickle"  # data.pkl's pickle, held until the pickle is complete
    BLOB = "blob"  # a bytes value to encode into the pickle, held likewise
    PICKLED = "pickled"  # pickle and blobs complete: write data.pkl and the preamble
    STORAGE = "storage"  # archive/data/<i>, written as it comes
    CLOSE = "close"  # the archive's closing records and directory
    RAW = "raw"  # a raw record's bytes, written as they come
    END = "end"  # a record ends: note its length


@dataclass
class _Step:
    kind: _Kind
    data: Data | None = None
    number: int = 0  # a storage's index; a blob's offset in the pickle
    held: list[memoryview | bytes] = field(default_factory=list)
    filled: int = 0

    @property
    def nbytes(self) -> int:
        data = self.data
        if data is None:
            return 0
        return data.nbytes if not isinstance(data, bytes) else len(data)


def _steps(records: tuple[Record, ...]) -> list[_Step]:
    steps: list[_Step] = []
    for record in records:
        steps.append(_Step(_Kind.RECORD))
        if isinstance(record, TorchRecord):
            steps.append(_Step(_Kind.PICKLE, record.pickle))
            steps += [_Step(_Kind.BLOB, blob.data, blob.at) for blob in record.blobs]
            steps.append(_Step(_Kind.PICKLED))
            steps += [_Step(_Kind.STORAGE, s, i) for i, s in enumerate(record.storages)]
            steps.append(_Step(_Kind.CLOSE))
        elif isinstance(record, RawRecord):
            steps.append(_Step(_Kind.RAW, record.data))
        else:
            raise TypeError(f"not a record: {record!r}")
        steps.append(_Step(_Kind.END))
    return steps


def records_nbytes(records: tuple[Record, ...]) -> int:
    """The bytes the records' parts hold: the file's size but for its archive framing."""
    return sum(step.nbytes for step in _steps(records))


def _utf8_nbytes(data: memoryview | bytes) -> int:
    """Bytes of ``data``'s latin-1 text in UTF-8: one per byte, two from 0x80 on."""
    array = np.frombuffer(data, dtype=np.uint8)
    high = sum(
        int(np.count_nonzero(array[at : at + _ENCODE_CHUNK] >= 0x80))
        for at in range(0, len(array), _ENCODE_CHUNK)
    )
    return len(array) + high


def _joined(parts: list[memoryview | bytes]) -> memoryview | bytes:
    return parts[0] if len(parts) == 1 else b"".join(parts)


class FileStream:
    """The records of one file, written into ``out`` as their bytes arrive (see the module).

    ``bytes_of`` gives the bytes of a span (a view of staging memory) or of bytes.
    """

    def __init__(
        self,
        records: tuple[Record, ...],
        out: Out,
        bytes_of: Callable[[Data], memoryview],
    ) -> None:
        self._out = out
        self._bytes_of = bytes_of
        self._steps = _steps(records)
        self._at = 0
        self._archive: Archive | None = None
        self._record_start = 0
        self._pickle: _Step | None = None
        self._blobs: list[_Step] = []
        self.spans: list[tuple[int, int]] = []
        """Each finished record's ``(offset, length)`` in the file."""
        self._advance()

    @property
    def done(self) -> bool:
        """Whether every step has run (the file holds all its records)."""
        return self._at == len(self._steps)

    def feed(self, view: memoryview) -> None:
        """The next bytes of the streamed parts; raises :class:`ValueError` beyond them."""
        taken = 0
        while taken < len(view):
            if self.done:
                raise ValueError(f"{len(view) - taken} bytes fed beyond the file's parts")
            step = self._steps[self._at]
            if not isinstance(step.data, Streamed):  # pragma: no cover - _advance ran them
                raise RuntimeError("a fed part is not a streamed one")
            take = min(len(view) - taken, step.nbytes - step.filled)
            self._take(step, view[taken : taken + take])
            taken += take
            if step.filled == step.nbytes:
                self._complete(step)
                self._advance()

    # -- the steps ------------------------------------------------------------------------

    def _advance(self) -> None:
        """Run the steps whose bytes are here, up to a streamed part that waits for bytes."""
        while not self.done:
            step = self._steps[self._at]
            data = step.data
            if isinstance(data, Streamed):
                if step.filled == 0:
                    self._begin(step)
                if step.filled < step.nbytes:
                    return  # feed() goes on from here
            elif data is not None:
                self._begin(step)
                self._take(step, self._bytes_of(data))
            else:
                self._marker(step)
            self._complete(step)

    def _begin(self, step: _Step) -> None:
        if step.kind is _Kind.STORAGE:
            if self._archive is None:  # pragma: no cover - PICKLED made it
                raise RuntimeError("a storage outside an archive")
            self._archive.begin(f"data/{step.number}", step.nbytes)

    def _take(self, step: _Step, view: memoryview) -> None:
        if step.kind in (_Kind.PICKLE, _Kind.BLOB):
            streamed = isinstance(step.data, Streamed)
            step.held.append(bytes(view) if streamed else view)  # staging is reused
        else:
            self._out.write(view)
        step.filled += len(view)

    def _complete(self, step: _Step) -> None:
        """``step`` has all its bytes: end what it began; the next step comes."""
        if step.kind is _Kind.STORAGE and self._archive is not None:
            self._archive.end()
        elif step.kind is _Kind.PICKLE:
            self._pickle = step
        elif step.kind is _Kind.BLOB:
            self._blobs.append(step)
        self._at += 1

    def _marker(self, step: _Step) -> None:
        if step.kind is _Kind.RECORD:
            self._record_start = self._out.nbytes
            self._pickle, self._blobs = None, []
        elif step.kind is _Kind.PICKLED:
            self._archive = Archive(self._out)
            self._write_pickle(self._archive)
            self._archive.preamble()
        elif step.kind is _Kind.CLOSE:
            if self._archive is not None:
                self._archive.close()
            self._archive = None
        elif step.kind is _Kind.END:
            self.spans.append((self._record_start, self._out.nbytes - self._record_start))

    def _write_pickle(self, archive: Archive) -> None:
        """``data.pkl``: the pickle with each blob encoded where it goes (protocol 2 pickles
        a ``bytes`` value as ``_codecs.encode(<its latin-1 text>, "latin1")``)."""
        pickle = self._pickle.held if self._pickle is not None else []
        whole = memoryview(_joined(pickle)) if pickle else memoryview(b"")
        blobs = [(blob.number, _joined(blob.held) if blob.held else b"") for blob in self._blobs]
        encoded = [_utf8_nbytes(value) for _, value in blobs]
        if any(nbytes > 0xFFFFFFFF for nbytes in encoded):
            raise OverflowError(
                "a bytes value of the state is too large for torch.save's pickle protocol "
                "2 (over 4 GiB once encoded); save it as a uint8 tensor"
            )
        size = len(whole) + sum(len(_BLOB_HEAD) + 4 + n + len(_BLOB_TAIL) for n in encoded)
        archive.begin("data.pkl", size)
        taken = 0
        for (at, value), nbytes in zip(blobs, encoded, strict=True):
            if not taken <= at <= len(whole):
                raise ValueError(f"a blob at {at} of a {len(whole)}-byte pickle, after {taken}")
            self._out.write(whole[taken:at])
            self._out.write(_BLOB_HEAD + nbytes.to_bytes(4, "little"))
            view = memoryview(value)
            for start in range(0, len(view), _ENCODE_CHUNK):
                text = codecs.latin_1_decode(view[start : start + _ENCODE_CHUNK])[0]
                self._out.write(text.encode("utf-8"))
            self._out.write(_BLOB_TAIL)
            taken = at
        self._out.write(whole[taken:])
        archive.end()
