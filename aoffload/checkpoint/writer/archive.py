"""``torch.save``'s zip archive, written record by record into a stream; no torch.

A ``torch.save`` file is a zip archive of stored (uncompressed) records, all named
``archive/...``, in this order (torch 2.13's ``torch.serialization._save`` and its
``PyTorchFileWriter``)::

    data.pkl               the state, pickled (protocol 2) with a persistent id per storage
    .format_version        "1"
    .storage_alignment     "64"
    byteorder              "little" (this machine's)
    data/0, data/1, ...    each storage's bytes, in the order the pickle first names them
    version                "3\\n"
    .data/serialization_id 40 digits
    central directory, zip64 end of central directory, its locator, end of central directory

Every record's data starts on a 64-byte boundary of the archive (a ``FB`` extra field in
its local header pads it, so ``torch.load(mmap=True)`` maps aligned tensors); each local
header has zero sizes and is followed by the data and a data descriptor, as torch's miniz
writes them; CRC-32s are zero (what ``torch.serialization.set_crc32_options(False)``
writes, and ``torch.load`` reads: the manifest's xxh3-64 of the whole file guards it).
Records of 4 GiB or more, and records past 4 GiB, carry zip64 extra fields.

:class:`Archive` writes one archive into an :class:`Out` (the writer's hashing sink), as
data arrives: :meth:`Archive.begin` a record of known size, write exactly that many
bytes, :meth:`Archive.end` it; :meth:`Archive.close` writes the closing records and the
directory. Offsets are counted from where the archive starts in its file, so an archive
can be one record of a larger file (DCP's data files hold one archive per tensor).
"""

from __future__ import annotations

import secrets
import struct
import sys
from dataclasses import dataclass
from typing import Protocol

__all__ = ["ALIGNMENT", "Archive", "Out"]

ALIGNMENT = 64
"""Where each record's data starts: a multiple of this, from the archive's first byte."""
_PREFIX = "archive/"
_MAX32 = 0xFFFFFFFF
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # local file header, 30 bytes
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory header, 46 bytes
_END64 = struct.Struct("<IQHHIIQQQQ")  # zip64 end of central directory record, 56 bytes
_LOCATOR = struct.Struct("<IIQI")  # zip64 end of central directory locator, 20 bytes
_END = struct.Struct("<IHHHHIIH")  # end of central directory record, 22 bytes
_UTF8 = 0x0800  # bit 11: UTF-8 names
_DESCRIBED = _UTF8 | 0x0008  # bit 3: the sizes follow the data, in a data descriptor
_ZIP64_MADE_BY, _ZIP64_NEEDED = 0x031E, 45


class Out(Protocol):
    """Where an archive goes: ``write`` appends, ``nbytes`` counts what was written."""

    @property
    def nbytes(self) -> int: ...

    def write(self, data: bytes | memoryview) -> int: ...


@dataclass(frozen=True, slots=True)
class _Entry:
    name: bytes
    offset: int  # of its local header, from the archive's start
    nbytes: int


def _zip64_extra(nbytes: int | None, offset: int | None) -> bytes:
    values = ([nbytes, nbytes] if nbytes is not None else []) + (
        [offset] if offset is not None else []
    )
    if not values:
        return b""
    return struct.pack(f"<HH{len(values)}Q", 0x0001, 8 * len(values), *values)


class Archive:
    """One ``torch.save`` archive written into ``out`` (see the module)."""

    def __init__(self, out: Out) -> None:
        self._out = out
        self._start = out.nbytes
        self._entries: list[_Entry] = []
        self._open: _Entry | None = None

    @property
    def _cursor(self) -> int:
        return self._out.nbytes - self._start

    def begin(self, record: str, nbytes: int) -> None:
        """Start record ``archive/<record>`` of ``nbytes`` bytes: its local header, padded
        so that its data starts aligned. The caller then writes exactly ``nbytes``."""
        if self._open is not None:
            raise RuntimeError(f"record {self._open.name!r} is still open")
        name = (_PREFIX + record).encode()
        offset = self._cursor
        zip64 = _zip64_extra(
            nbytes if nbytes >= _MAX32 else None, offset if offset >= _MAX32 else None
        )
        data_at = offset + _LOCAL.size + len(name) + len(zip64) + 4  # 4: the FB field's head
        padding = -data_at % ALIGNMENT
        fb = b"FB" + struct.pack("<H", padding) + b"Z" * padding
        sizes = _MAX32 if nbytes >= _MAX32 else 0
        flags = _DESCRIBED if nbytes else _UTF8  # an empty record has no descriptor
        header = _LOCAL.pack(
            0x04034B50, 0, flags, 0, 0, 0, 0, sizes, sizes, len(name), len(zip64) + len(fb)
        )
        self._out.write(header + name + zip64 + fb)
        self._open = _Entry(name, offset, nbytes)
        self._data_at = self._cursor

    def end(self) -> None:
        """End the open record: check its size, write its data descriptor."""
        entry, self._open = self._open, None
        if entry is None:
            raise RuntimeError("no record is open")
        written = self._cursor - self._data_at
        if written != entry.nbytes:
            raise RuntimeError(
                f"record {entry.name.decode()!r} got {written} bytes, not {entry.nbytes}"
            )
        if not entry.nbytes:
            descriptor = b""
        elif entry.nbytes >= _MAX32 or entry.offset >= _MAX32:
            descriptor = struct.pack("<IIQQ", 0x08074B50, 0, entry.nbytes, entry.nbytes)
        else:
            descriptor = struct.pack("<IIII", 0x08074B50, 0, entry.nbytes, entry.nbytes)
        if descriptor:
            self._out.write(descriptor)
        self._entries.append(entry)

    def record(self, record: str, data: bytes) -> None:
        """A whole small record."""
        self.begin(record, len(data))
        self._out.write(data)
        self.end()

    def preamble(self) -> None:
        """The records between ``data.pkl`` and the storages (torch 2.13 writes them there)."""
        self.record(".format_version", b"1")
        self.record(".storage_alignment", str(ALIGNMENT).encode())
        self.record("byteorder", sys.byteorder.encode())

    def close(self) -> None:
        """The closing records (``version``, ``.data/serialization_id``) and the directory."""
        self.record("version", b"3\n")
        self.record(".data/serialization_id", f"{secrets.randbits(128):040d}".encode())
        directory = self._cursor
        parts = []
        for entry in self._entries:
            large, far = entry.nbytes >= _MAX32, entry.offset >= _MAX32
            extra = _zip64_extra(entry.nbytes if large else None, entry.offset if far else None)
            size = _MAX32 if large else entry.nbytes
            parts.append(
                _CENTRAL.pack(
                    0x02014B50,
                    0,
                    _ZIP64_NEEDED if extra else 0,
                    _DESCRIBED if entry.nbytes else _UTF8,
                    0,
                    0,
                    0,
                    0,
                    size,
                    size,
                    len(entry.name),
                    len(extra),
                    0,
                    0,
                    0,
                    0,
                    _MAX32 if far else entry.offset,
                )
                + entry.name
                + extra
            )
        central = b"".join(parts)
        end64 = directory + len(central)
        count = len(self._entries)
        self._out.write(
            central
            + _END64.pack(
                0x06064B50,
                _END64.size - 12,
                _ZIP64_MADE_BY,
                _ZIP64_NEEDED,
                0,
                0,
                count,
                count,
                len(central),
                directory,
            )
            + _LOCATOR.pack(0x07064B50, 0, end64, 1)
            + _END.pack(
                0x06054B50,
                0,
                0,
                min(count, 0xFFFF),
                min(count, 0xFFFF),
                min(len(central), _MAX32),
                min(directory, _MAX32),
                0,
            )
        )
