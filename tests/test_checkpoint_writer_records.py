"""The writer's one call for a file, ``WriteRecords``, as the DCP route will use it: records of
``torch.save`` archives and raw bytes, from staging spans, bytes in the call, or streamed in
(``FeedFile``) in pieces that cut across records; and ``AbortFile``. The oracles are
``torch.load`` of each record's bytes, the xxh3-64 library, and the bytes written."""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from aoffload._errors import RemoteError
from aoffload._runtime.core import WorkerCore
from aoffload.checkpoint.core.plan import plan
from aoffload.checkpoint.core.staging import Segment
from aoffload.checkpoint.writer.calls import (
    LARGE_BUFFERS,
    LARGE_CAP,
    TARGET,
    AbortFile,
    Blob,
    FeedFile,
    FileRecord,
    MapSegment,
    RawRecord,
    Span,
    Streamed,
    TorchRecord,
    WriterConfig,
    WriteRecords,
    staging_room,
)
from aoffload.checkpoint.writer.sink import (
    BOUNCE_BYTES,
    LARGE_BOUNCE_BYTES,
    LARGE_FILE,
    bounce_bytes,
)


@pytest.fixture
def writer() -> Iterator[WorkerCore]:
    core = WorkerCore(
        TARGET, WriterConfig(durable=False), name="checkpoint-writer", close_timeout=30
    )
    core.start(60)
    try:
        yield core
    finally:
        core.stop()
        core.release()


@pytest.fixture
def segment(writer: WorkerCore) -> Iterator[Segment]:
    made = Segment(8 << 20)
    writer.request(MapSegment(made.path, made.size), timeout=60)
    made.unlink()
    try:
        yield made
    finally:
        made.close()


class Staging:
    """Puts bytes into a segment, one after the other, and says where (a Span)."""

    def __init__(self, segment: Segment) -> None:
        self.segment, self.used = segment, 0

    def put(self, data: bytes) -> Span:
        array = self.segment.array
        assert array is not None
        start = self.used
        if data:
            array[start : start + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.used += (len(data) + 63) // 64 * 64
        return Span(self.segment.path, start, len(data))


def pieces_of(state: Any) -> tuple[bytes, list[bytes], list[tuple[int, bytes]]]:
    """torch.save's pickle of ``state`` (as the trainer's side makes it), its storages'
    bytes, and its blobs."""
    planned = plan(state, "record")
    pickled = b"".join(bytes(piece) for piece in planned.pickle)
    storages = [bytes(s.numpy().tobytes()) for s in planned.storages]
    return pickled, storages, [(at, bytes(value)) for at, value in planned.blobs]


def states() -> list[dict[str, Any]]:
    return [
        {"w": torch.arange(12.0).view(3, 4), "name": "first"},
        {"v": torch.ones(5, dtype=torch.bfloat16), "blob": bytes(range(256)) * 512},
        {"empty": torch.empty(0), "p": torch.nn.Parameter(torch.rand(2, 2))},
    ]


def check_file(path: Path, record: FileRecord, expected: list[Any]) -> None:
    data = path.read_bytes()
    assert record.nbytes == len(data)
    assert record.xxh3_64 == xxhash.xxh3_64(data).hexdigest()
    assert len(record.spans) == len(expected)
    assert [start for start, _ in record.spans] == sorted(s for s, _ in record.spans)
    assert sum(length for _, length in record.spans) == len(data)  # consecutive, no gaps
    for (start, length), want in zip(record.spans, expected, strict=True):
        piece = data[start : start + length]
        if isinstance(want, bytes):
            assert piece == want
            continue
        loaded = torch.load(io.BytesIO(piece), weights_only=True)
        assert loaded.keys() == want.keys()
        for key, value in want.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(loaded[key].detach(), value.detach()), key
            else:
                assert loaded[key] == value, key


def test_records_from_spans_and_bytes(tmp_path: Path, writer: WorkerCore, segment: Segment) -> None:
    """A DCP-like data file: torch.save archives from staging memory and raw bytes, in order."""
    staging = Staging(segment)
    records: list[Any] = []
    expected: list[Any] = []
    for number, state in enumerate(states()):
        pickled, storages, blobs = pieces_of(state)
        records.append(
            TorchRecord(
                pickled if number == 0 else staging.put(pickled),  # bytes, or a span
                tuple(staging.put(s) for s in storages),
                tuple(Blob(at, staging.put(value)) for at, value in blobs),
            )
        )
        expected.append(state)
        raw = pickle.dumps({"item": number})
        records.append(RawRecord(raw if number % 2 else staging.put(raw)))
        expected.append(raw)
    path = tmp_path / "__0_0.distcp"
    answer = writer.request(WriteRecords(str(path), tuple(records)), timeout=60)
    assert isinstance(answer, FileRecord)
    check_file(path, answer, expected)


def test_streamed_records_fed_in_pieces_across_their_boundaries(
    tmp_path: Path, writer: WorkerCore, segment: Segment
) -> None:
    pickled, storages, blobs = pieces_of(states()[1])
    raw = os.urandom(3000)
    stream = pickled + b"".join(value for _, value in blobs) + b"".join(storages) + raw
    records = (
        TorchRecord(
            Streamed(len(pickled)),
            tuple(Streamed(len(s)) for s in storages),
            tuple(Blob(at, Streamed(len(value))) for at, value in blobs),
        ),
        RawRecord(Streamed(len(raw))),
    )
    path = tmp_path / "streamed.pt"
    answer = writer.submit(WriteRecords(str(path), records))
    staging = Staging(segment)
    for start in range(0, len(stream), 7777):  # pieces that cut parts anywhere
        piece = stream[start : start + 7777]
        writer.request(FeedFile(str(path), (staging.put(piece),)), timeout=60)
        staging.used = 0  # the piece's memory is free again once the feed is answered
    record = answer.result(timeout=60)
    check_file(path, record, [states()[1], raw])


def test_an_aborted_stream_fails_and_leaves_no_file(
    tmp_path: Path, writer: WorkerCore, segment: Segment
) -> None:
    pickled, storages, _ = pieces_of(states()[0])
    path = tmp_path / "tag" / "sub" / "m.pt"
    records = (TorchRecord(Streamed(len(pickled)), tuple(Streamed(len(s)) for s in storages)),)
    answer = writer.submit(WriteRecords(str(path), records, root=str(tmp_path)))
    writer.request(FeedFile(str(path), (Staging(segment).put(pickled[:10]),)), timeout=60)
    writer.request(AbortFile(str(path), "a test"), timeout=60)
    with pytest.raises(RemoteError, match="a test"):
        answer.result(timeout=60)
    assert not path.exists()
    assert os.listdir(tmp_path) == []  # the directories made for it went too
    writer.request(FeedFile(str(path), (Staging(segment).put(b"x"),)), timeout=60)  # dropped


def test_a_large_file_goes_through_the_large_buffers_and_a_small_one_after_it(
    tmp_path: Path, writer: WorkerCore, segment: Segment
) -> None:
    """A file of LARGE_FILE bytes or more is written in 64 MiB blocks (both buffers, and a
    padded last block), a small one after it through the same kept buffers: each file holds
    exactly what was fed, as the xxh3-64 of the bytes fed says."""
    array = segment.array
    assert array is not None
    piece = segment.size
    for nbytes in (LARGE_FILE + 12345, 3 * piece + 777):
        path = tmp_path / f"{nbytes}.bin"
        answer = writer.submit(WriteRecords(str(path), (RawRecord(Streamed(nbytes)),)))
        expected = xxhash.xxh3_64()
        for number, start in enumerate(range(0, nbytes, piece)):
            size = min(piece, nbytes - start)
            array[:size] = torch.arange(size, dtype=torch.uint8) + number  # differs per piece
            expected.update(array[:size].numpy().tobytes())
            writer.request(FeedFile(str(path), (Span(segment.path, 0, size),)), timeout=60)
        record = answer.result(timeout=120)
        assert record.nbytes == nbytes == path.stat().st_size
        written = xxhash.xxh3_64()
        with path.open("rb") as file:
            while block := file.read(64 << 20):
                written.update(block)
        assert record.xxh3_64 == written.hexdigest() == expected.hexdigest()
        path.unlink()


def _buffers(pid: int | None) -> list[int]:
    """The sizes of the writer's mappings of a pair of write buffers (small or large)."""
    sizes = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        start, end = (int(part, 16) for part in line.split()[0].split("-"))
        if end - start in (2 * BOUNCE_BYTES, 2 * LARGE_BOUNCE_BYTES):
            sizes.append(end - start)
    return sorted(sizes)


def test_one_large_file_at_a_time_gets_the_large_buffers(
    tmp_path: Path, writer: WorkerCore, segment: Segment
) -> None:
    """The engine's cap keeps room for one pair of large buffers: a second large file open
    at the same time is written through small ones, and both hold what was fed."""
    array = segment.array
    assert array is not None
    nbytes, piece = LARGE_FILE + 4097, segment.size
    paths = [tmp_path / "first.bin", tmp_path / "second.bin"]
    answers = [
        writer.submit(
            WriteRecords(str(path), (RawRecord(Streamed(nbytes)),), staging_cap=LARGE_CAP)
        )
        for path in paths
    ]
    expected = [xxhash.xxh3_64(), xxhash.xxh3_64()]
    for number, start in enumerate(range(0, nbytes, piece)):
        size = min(piece, nbytes - start)
        for which, path in enumerate(paths):
            array[:size] = torch.arange(size, dtype=torch.uint8) + number + which
            expected[which].update(array[:size].numpy().tobytes())
            writer.request(FeedFile(str(path), (Span(segment.path, 0, size),)), timeout=60)
        if number == 0:
            assert _buffers(writer.pid) == [2 * BOUNCE_BYTES, 2 * LARGE_BOUNCE_BYTES]
    for answer, path, hashed in zip(answers, paths, expected, strict=True):
        record = answer.result(timeout=120)
        assert record.nbytes == nbytes == path.stat().st_size
        assert record.xxh3_64 == hashed.hexdigest()


def test_the_write_size_follows_the_file_and_the_staging_cap() -> None:
    assert bounce_bytes(0) == bounce_bytes(LARGE_FILE - 1) == BOUNCE_BYTES
    assert bounce_bytes(LARGE_FILE) == bounce_bytes(1 << 40) == LARGE_BOUNCE_BYTES
    assert bounce_bytes(LARGE_FILE, LARGE_CAP) == LARGE_BOUNCE_BYTES
    assert bounce_bytes(LARGE_FILE, LARGE_CAP - 1) == BOUNCE_BYTES  # memory is scarce
    # the cap that pays for the large buffers keeps them out of its staging chunks
    assert LARGE_BUFFERS == 2 * LARGE_BOUNCE_BYTES <= LARGE_CAP // 4
    assert staging_room(LARGE_CAP) == LARGE_CAP - LARGE_BUFFERS
    assert staging_room(LARGE_CAP - 1) == LARGE_CAP - 1
