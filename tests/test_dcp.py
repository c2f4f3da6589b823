"""aoffload.dcp.StorageReader: DCP loads from aoffload tags, verified, and safely.

Tags are written the way DCP writes them (``FileSystemWriter`` into ``DIR/<tag>``) and
committed by a ``CheckpointEngine``, which publishes the files it finds in an uncommitted
tag's directory with its own manifest (sizes and xxh3-64 of each, hashed by the engine).
Hostile directories are made as an attacker would: ``.metadata`` or a value's record
replaced by a pickle that runs code, with a manifest that matches. DCP's own
``FileSystemReader`` runs that code (checked here, so each test shows the threat is real);
``StorageReader`` must not.
"""

from __future__ import annotations

import asyncio
import io
import logging
import pickle
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

import aoffload
from aoffload.dcp import StorageReader
from tests import _dcp_scenarios as scenarios
from tests._ranks import run_ranks

# DCP warns on every call made without a process group; these tests run in one process.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def state(step: int) -> dict[str, Any]:
    return {
        "w": torch.arange(64, dtype=torch.float32) + step,
        "nested": {"b": torch.full((2, 3), float(step))},
        "cfg": {"lr": 0.1, "betas": (0.9, 0.99), "name": f"run-{step}"},
    }


def blank() -> dict[str, Any]:
    return {
        "w": torch.zeros(64),
        "nested": {"b": torch.zeros(2, 3)},
        "cfg": {"lr": 0.0, "betas": (0.0, 0.0), "name": ""},
    }


def same(got: Any, expected: Any) -> bool:
    """Equal values, tensors included (exactly, with dtypes and shapes)."""
    if isinstance(expected, torch.Tensor):
        return (
            isinstance(got, torch.Tensor)
            and got.dtype == expected.dtype
            and (torch.equal(got, expected))
        )
    if isinstance(expected, dict):
        return (
            isinstance(got, dict)
            and got.keys() == expected.keys()
            and all(same(got[k], v) for k, v in expected.items())
        )
    return bool(got == expected)


def save(directory: Path, value: dict[str, Any]) -> None:
    dcp.save(value, storage_writer=FileSystemWriter(directory), no_dist=True)


def commit(root: Path, tag: str) -> None:
    """Publish what DCP wrote into ``root / tag`` as a committed aoffload tag."""

    async def main() -> None:
        async with aoffload.CheckpointEngine(root, durable=False) as engine:
            await engine.save({"saved_by": "dcp"}, "owner.pt", tag=tag)
            await engine.commit(tag)

    asyncio.run(main())


def load(reader: Any, into: dict[str, Any]) -> dict[str, Any]:
    dcp.load(into, storage_reader=reader, no_dist=True)
    return into


def failure(reader: Any, into: dict[str, Any]) -> BaseException:
    """The error the reader raised, out of DCP's CheckpointException."""
    with pytest.raises(CheckpointException) as caught:
        load(reader, into)
    [(error, _)] = caught.value.failures.values()
    return error


class Exploit:
    """Unpickling it creates ``marker``: what a hostile pickle would do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def test_a_committed_tag_loads_verified_and_equal(tmp_path: Path) -> None:
    save(tmp_path / "step-1", state(1))
    commit(tmp_path, "step-1")
    save(tmp_path / "step-2", state(2))
    commit(tmp_path, "step-2")

    latest = load(StorageReader(tmp_path), blank())
    older = load(StorageReader(tmp_path, tag="step-1"), blank())
    one_tag = load(StorageReader(tmp_path / "step-1"), blank())

    for loaded, step in ((latest, 2), (older, 1), (one_tag, 1)):
        assert same(loaded, state(step)), (step, loaded)
    # the tag is a plain DCP checkpoint too
    plain = load(FileSystemReader(tmp_path / "step-2"), blank())
    assert same(plain, state(2))


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_a_damaged_file_is_named_before_dcp_reads_it(tmp_path: Path, damage: str) -> None:
    save(tmp_path / "t", state(1))
    commit(tmp_path, "t")
    data = tmp_path / "t" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    if damage == "flip":
        raw[len(raw) // 2] ^= 0x01
        data.write_bytes(raw)
    elif damage == "truncate":
        data.write_bytes(raw[:-10])
    else:
        data.unlink()

    into = blank()
    error = failure(StorageReader(tmp_path), into)

    assert isinstance(error, aoffload.CorruptCheckpointError), error
    assert str(data) in str(error)
    assert same(into, blank())  # nothing was read


def test_a_damaged_metadata_is_named_when_the_reader_is_made(tmp_path: Path) -> None:
    save(tmp_path / "t", state(1))
    commit(tmp_path, "t")
    metadata = tmp_path / "t" / ".metadata"
    raw = bytearray(metadata.read_bytes())
    raw[-5] ^= 0x01
    metadata.write_bytes(raw)

    with pytest.raises(aoffload.CorruptCheckpointError, match="checksum mismatch") as caught:
        StorageReader(tmp_path)
    assert str(metadata) in str(caught.value)


@pytest.mark.parametrize("committed", [False, True], ids=["plain", "committed"])
def test_a_hostile_metadata_cannot_run_code(tmp_path: Path, committed: bool) -> None:
    marker = tmp_path / "pwned"
    save(tmp_path / "t", state(1))
    (tmp_path / "t" / ".metadata").write_bytes(pickle.dumps(Exploit(marker)))
    if committed:
        commit(tmp_path, "t")  # the attacker's manifest matches its files
    where = tmp_path if committed else tmp_path / "t"

    with pytest.raises(aoffload.CorruptCheckpointError, match=r"builtins\.exec"):
        StorageReader(where)
    assert not marker.exists()
    with pytest.raises(BaseException):  # noqa: B017, PT011 - DCP's reader: whatever follows
        load(FileSystemReader(tmp_path / "t"), blank())
    assert marker.exists()  # DCP's own reader ran the attacker's code


def test_a_hostile_value_cannot_run_code(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    directory = tmp_path / "t"
    save(directory, state(1))
    metadata = pickle.loads((directory / ".metadata").read_bytes())  # the attacker's own
    record = io.BytesIO()
    torch.save({"lr": Exploit(marker)}, record)
    [info] = [s for i, s in metadata.storage_data.items() if i.fqn == "cfg.lr"]
    data = directory / info.relative_path
    info.offset, info.length = data.stat().st_size, len(record.getvalue())
    with data.open("ab") as f:
        f.write(record.getvalue())
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    commit(tmp_path, "t")

    error = failure(StorageReader(tmp_path), blank())

    assert isinstance(error, aoffload.CheckpointError), error
    assert "'cfg.lr'" in str(error)
    assert "weights_only=False" in str(error)
    assert not marker.exists()
    load(FileSystemReader(directory), blank())
    assert marker.exists()  # DCP's own reader ran the attacker's code


def test_a_file_name_leaving_the_directory_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "t"
    save(directory, state(1))
    secret = tmp_path / "secret.distcp"
    secret.write_bytes((directory / "__0_0.distcp").read_bytes())
    metadata = pickle.loads((directory / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../secret.distcp"
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))

    error = failure(StorageReader(directory), blank())

    assert isinstance(error, aoffload.CorruptCheckpointError), error
    assert "'../secret.distcp'" in str(error)
    assert same(load(FileSystemReader(directory), blank()), state(1))  # DCP reads it


def test_a_plain_dcp_directory_loads_unverified_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    save(tmp_path / "dcp", state(3))
    with caplog.at_level(logging.WARNING, logger="aoffload.dcp"):
        loaded = load(StorageReader(tmp_path / "dcp"), blank())
    assert same(loaded, state(3))
    [record] = [r for r in caplog.records if r.name.startswith("aoffload.dcp")]
    assert record.levelno == logging.WARNING
    assert str(tmp_path / "dcp") in record.getMessage()
    assert "without verification" in record.getMessage()


def test_an_uncommitted_tag_is_refused(tmp_path: Path) -> None:
    save(tmp_path / "step-1", state(1))
    commit(tmp_path, "step-1")
    save(tmp_path / "step-2", state(2))  # a save that never committed

    with pytest.raises(aoffload.CheckpointError, match="never committed"):
        StorageReader(tmp_path / "step-2")
    with pytest.raises(aoffload.CheckpointError, match="not a committed checkpoint"):
        StorageReader(tmp_path, tag="step-2")
    assert same(load(StorageReader(tmp_path), blank()), state(1))


def test_a_remote_tier_is_read_verified_and_leaves_nothing(
    tmp_path: Path, aoffload_s3: str
) -> None:
    with aoffload.CheckpointEngine(tmp_path / "local", remote=aoffload_s3) as engine:
        for step in (1, 2):
            engine.dcp.save(state(step), checkpoint_id=f"step-{step}").result()
        engine.uploaded("step-2").result()
    scratch = set(Path(tempfile.gettempdir()).glob("aoffload-remote-*"))

    latest = load(StorageReader(aoffload_s3), blank())
    older = load(StorageReader(aoffload_s3, tag="step-1"), blank())

    assert same(latest, state(2))
    assert same(older, state(1))
    assert set(Path(tempfile.gettempdir()).glob("aoffload-remote-*")) == scratch
    with pytest.raises(aoffload.CheckpointError, match="no published checkpoint 'step-9'"):
        StorageReader(aoffload_s3, tag="step-9")


@pytest.mark.timeout(240)
def test_saved_on_two_ranks_loads_on_four_verified(tmp_path: Path) -> None:
    for outcome in run_ranks(2, "tests._dcp_scenarios:save", tmp_path, steps=[1, 2]):
        outcome.check()
    commit(tmp_path, "step-1")
    commit(tmp_path, "step-2")

    loaded = [o.check() for o in run_ranks(4, "tests._dcp_scenarios:load", tmp_path)]

    for seen in loaded:
        assert seen["step"] == 2
        assert seen["meta"] == {"step": 2, "name": "run-7"}
        assert seen["shard_rows"] == scenarios.ROWS // 4
        assert seen["shard_equal"]
        assert seen["bias"] == [2.0, 2.0, 2.0]
        mixed = seen["different_tags"]  # ranks that read different tags fail together
        assert mixed["failed"]
        assert mixed["untouched"]
        assert any("resolved different checkpoints" in e for e in mixed["errors"]), mixed
