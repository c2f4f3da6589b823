"""A checkpoint directory is untrusted input (#20): links, names, manifests, leftovers.

Each test names the finding of issue #20 it covers; each failed on 0bebd2f, the audit's
base. Directories are made hostile the way a download, another user or a crashed run
would leave them: links planted inside, manifests forged, tags with odd names.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import re
from pathlib import Path

import pytest
import torch
import xxhash

import aoffload
from aoffload._cli import EXIT_DAMAGED, EXIT_OK, main

MANIFEST = ".aoffload-manifest.json"


def small(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64,), float(step))}


async def commit(directory: Path, *tags: str) -> None:
    async with aoffload.CheckpointEngine(directory, durable=False) as engine:
        for step, tag in enumerate(tags):
            await engine.save(small(step), "model.pt", tag=tag)
            await engine.commit(tag)


def _run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(argv), out=out), out.getvalue()


async def run(*argv: str) -> tuple[int, str]:
    """The command line, on a thread of its own (it runs an event loop of its own)."""
    return await asyncio.to_thread(_run, *argv)


def tree(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


# -- 1. links -------------------------------------------------------------------------


async def test_a_symlinked_tag_directory_is_refused_and_nothing_outside_moves(
    tmp_path: Path,
) -> None:
    """#20.1: `ck/step-2 -> out/`: committing step-2 moved out's files and deleted them."""
    outside = tmp_path / "out"
    (outside / "sub").mkdir(parents=True)
    (outside / "precious.txt").write_text("keep me")
    (outside / "sub" / "also.txt").write_text("me too")
    directory = tmp_path / "ck"
    async with aoffload.CheckpointEngine(directory, durable=False) as engine:
        await engine.save(small(1), "model.pt", tag="step-1")
        await engine.commit("step-1")
        (directory / "step-2").symlink_to(outside, target_is_directory=True)
        await engine.save(small(2), "model.pt", tag="step-2")
        with pytest.raises(aoffload.CheckpointError, match=r"step-2.*symbolic link"):
            await engine.commit("step-2")
        assert engine.latest() == "step-1"
    assert tree(outside) == ["precious.txt", "sub", "sub/also.txt"]
    assert (outside / "precious.txt").read_text() == "keep me"
    assert (directory / "step-2").is_symlink()
    assert (directory / "latest").read_text().strip() == "step-1"
    assert not [e for e in os.listdir(directory) if e.startswith(".tmp-")]


async def test_a_link_inside_a_tag_directory_is_never_followed(tmp_path: Path) -> None:
    """#20.1: what others put in `<tag>/` (DeepSpeed's NVMe offload) is published only as
    plain files: a link to a file outside is refused, never hashed nor moved."""
    secret = tmp_path / "secret.txt"
    secret.write_text("private")
    directory = tmp_path / "ck"
    async with aoffload.CheckpointEngine(directory, durable=False) as engine:
        offloaded = directory / "step-1" / "offloaded_tensors"
        offloaded.mkdir(parents=True)
        (offloaded / "state.bin").symlink_to(secret)
        await engine.save(small(1), "model.pt", tag="step-1")
        with pytest.raises(aoffload.CheckpointError, match="symbolic link"):
            await engine.commit("step-1")
        assert engine.tags() == []
    assert secret.read_text() == "private"
    assert (offloaded / "state.bin").is_symlink()  # left where it was
    assert not (directory / "latest").exists()


# -- 6, 7. tags and names -------------------------------------------------------------


@pytest.mark.parametrize(
    "tag", [" step-1", "step-1 ", "step-1\n", "\tstep", "step\x1b[2J", "a\x7fb"]
)
async def test_tags_with_whitespace_at_an_end_or_control_characters_are_refused(
    aoffload_engine: aoffload.CheckpointEngine, tag: str
) -> None:
    """#20.6: `latest` was read back stripped, so such a tag was lost after a restart."""
    with pytest.raises(aoffload.InvalidStateError, match=r"whitespace|control characters"):
        aoffload_engine.stage(small(1), "model.pt", tag=tag)
    with pytest.raises(aoffload.InvalidStateError, match=r"whitespace|control characters"):
        aoffload_engine.stage(small(1), f"dir/{tag}", tag="ok")


async def test_tags_are_capped_at_what_the_retirement_rename_can_hold(tmp_path: Path) -> None:
    """#20.7: a 256-character tag raised a raw OSError; a 240-character one committed but
    could never be retired (`.trash-<tag>-<id>` is 16 bytes longer than the tag)."""
    async with aoffload.CheckpointEngine(tmp_path, keep_last=1, durable=False) as engine:
        for too_long in ("x" * 240, "x" * 256, "é" * 120):
            with pytest.raises(aoffload.InvalidStateError, match="over the limit of 239"):
                engine.stage(small(1), "model.pt", tag=too_long)
        with pytest.raises(aoffload.InvalidStateError, match="over the limit of 255"):
            engine.stage(small(1), "n" * 256, tag="ok")
        for letter in "ab":  # the longest tags commit, and the older one is retired
            await engine.save(small(1), "model.pt", tag=letter * 239)
            await engine.commit()
        assert engine.tags() == ["b" * 239]
    assert sorted(os.listdir(tmp_path)) == [
        ".aoffload.lock",
        ".aoffload.writer",
        "b" * 239,
        "latest",
    ]


async def test_an_os_error_at_start_is_a_checkpoint_error_naming_the_path(tmp_path: Path) -> None:
    """#20.7: OS errors surface as aoffload errors that name the path."""
    (tmp_path / "file").write_text("not a directory")
    engine = aoffload.CheckpointEngine(tmp_path / "file" / "ck")
    with pytest.raises(aoffload.CheckpointError, match=re.escape(str(tmp_path / "file" / "ck"))):
        await engine.astart()


# -- 8. manifests -----------------------------------------------------------------------


def forge(directory: Path, tag: str, manifest: object | bytes) -> None:
    (directory / tag).mkdir()
    data = manifest if isinstance(manifest, bytes) else json.dumps(manifest).encode()
    (directory / tag / MANIFEST).write_bytes(data)


def forge_all(directory: Path) -> None:
    for tag, manifest in HOSTILE.items():
        forge(directory, tag, manifest)


FORMAT = "aoffload-checkpoint/1"
HOSTILE: dict[str, object | bytes] = {
    "not-json": b"{not json",
    "no-sequence": {"format": FORMAT, "files": {}},
    "word-sequence": {"format": FORMAT, "sequence": "seven", "files": {}},
    "no-bytes": {"format": FORMAT, "sequence": 5, "files": {"m.pt": {"xxh3_64": "0" * 16}}},
    "nested": b"[" * 100_000,
    # bytes, not json.dumps: encoding 20 MiB holds the GIL long enough to stall the loop
    "huge": b'{"format": "%s", "sequence": 9, "files": {}, "pad": "' % FORMAT.encode()
    + b"x" * (20 << 20)
    + b'"}',
}


async def test_a_corrupt_manifest_quarantines_its_tag_and_the_engine_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """#20.8: one corrupt or huge manifest stopped every engine start (KeyError, ValueError),
    and a 60 MB one added seconds and hundreds of MB to each start."""
    await commit(tmp_path, "step-1")
    await asyncio.to_thread(forge_all, tmp_path)  # 20 MiB of JSON: off the loop
    with caplog.at_level(logging.WARNING, logger="aoffload.checkpoint.format.read"):
        async with aoffload.CheckpointEngine(tmp_path, durable=False) as engine:
            assert engine.tags() == ["step-1"]
            assert engine.latest() == "step-1"
            assert torch.equal((await engine.load("model.pt"))["w"], small(0)["w"])
            await engine.save(small(2), "model.pt", tag="step-2")
            await engine.commit("step-2")
            await engine.save(small(3), "model.pt", tag="not-json")  # a quarantined tag's name
            with pytest.raises(aoffload.CheckpointError, match="never rewritten"):
                await engine.commit("not-json")
    warned = "\n".join(r.getMessage() for r in caplog.records if "quarantined" in r.getMessage())
    for tag in HOSTILE:
        assert f"checkpoint {tag!r} in {tmp_path} is quarantined" in warned
    assert "over the limit of 16777216" in warned
    assert (tmp_path / "not-json" / MANIFEST).read_bytes() == b"{not json"  # left as it was


async def test_ls_verify_and_inspect_survive_hostile_manifests(tmp_path: Path) -> None:
    """#20.8: `ls` crashed on a manifest whose entries were not as expected."""
    await commit(tmp_path, "step-1")
    await asyncio.to_thread(forge_all, tmp_path)  # 20 MiB of JSON: off the loop
    status, out = await run("ls", str(tmp_path))
    assert status == EXIT_OK
    for tag in HOSTILE:
        assert re.search(rf"^{tag} +unreadable manifest", out, re.MULTILINE), tag
    status, out = await run("verify", str(tmp_path), "--all")
    assert status == EXIT_DAMAGED
    assert f"{len(HOSTILE)} of {len(HOSTILE) + 1} files failed verification" in out
    status, out = await run("inspect", str(tmp_path), "--tag", "no-bytes")
    assert status == EXIT_DAMAGED
    assert "unreadable manifest" in out


# -- 9. forged names, inspect -------------------------------------------------------------


async def test_verify_never_reads_a_file_a_forged_manifest_names_outside_the_tag(
    tmp_path: Path,
) -> None:
    """#20.9: `verify` hashed the files a forged manifest named outside the tag (`../../x`):
    with the right size and checksum, it passed."""
    directory = tmp_path / "ck"
    await commit(directory, "step-1")
    secret = b"s" * 100
    (tmp_path / "secret.bin").write_bytes(secret)
    path = directory / "step-1" / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["files"]["../../secret.bin"] = {
        "bytes": len(secret),
        "xxh3_64": xxhash.xxh3_64(secret).hexdigest(),
    }
    path.write_text(json.dumps(manifest))
    status, out = await run("verify", str(directory))
    assert status == EXIT_DAMAGED
    assert "'../../secret.bin': must be relative and must not contain '..'" in out
    with pytest.raises(aoffload.CorruptCheckpointError, match="cannot be in the tag"):
        await aoffload.load_checkpoint(directory, "model.pt")


async def test_inspect_verifies_a_file_before_it_loads_it(tmp_path: Path) -> None:
    """#20.9: `inspect` ran torch.load on a corrupt file and exited 0."""
    directory = tmp_path / "ck"
    async with aoffload.CheckpointEngine(directory, durable=False) as engine:
        await engine.save({"w": torch.zeros(4096)}, "model.pt", tag="step-1")
        await engine.commit()
    model = directory / "step-1" / "model.pt"
    data = bytearray(model.read_bytes())
    data[data.find(bytes(4096)) + 100] = 1  # inside the tensor's bytes: torch.load still works
    model.write_bytes(data)
    assert float(torch.load(model, weights_only=True)["w"].sum()) != 0.0
    status, out = await run("inspect", str(directory))
    assert status == EXIT_DAMAGED
    assert "checksum mismatch" in out
    assert "tensors:" not in out


# -- 11. leftovers ----------------------------------------------------------------------


async def test_start_up_and_clean_remove_a_leftover_link_never_its_target(tmp_path: Path) -> None:
    """#20.11: start-up clean-up and `clean` crashed with a raw OSError on a `.tmp-*` link."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "data.bin").write_bytes(b"d" * 10)
    directory = tmp_path / "ck"
    await commit(directory, "step-1")
    (directory / ".tmp-step-2-0123abcd").symlink_to(outside, target_is_directory=True)
    async with aoffload.CheckpointEngine(directory, durable=False) as engine:  # alone: cleans
        assert engine.tags() == ["step-1"]
    assert ".tmp-step-2-0123abcd" not in os.listdir(directory)
    (directory / ".trash-step-0-0123abcd").symlink_to(outside, target_is_directory=True)
    (directory / ".tmp-step-3-0123abcd").symlink_to(outside / "data.bin")
    status, out = await run("clean", str(directory))
    assert status == EXIT_OK
    assert "removed 2 leftovers" in out
    assert tree(outside) == ["data.bin"]
    assert (outside / "data.bin").read_bytes() == b"d" * 10
    assert sorted(os.listdir(directory)) == [
        ".aoffload.lock",
        ".aoffload.writer",
        "latest",
        "step-1",
    ]


async def test_a_crashed_runs_tag_directory_without_a_manifest_is_removed(tmp_path: Path) -> None:
    """#20.11: a crashed run's tag directory holding DeepSpeed's NVMe offload copies was
    never removed; a directory that is not one is left alone."""
    directory = tmp_path / "ck"
    await commit(directory, "step-1")
    orphan = directory / "step-2" / "offloaded_tensors" / "rank0"
    orphan.mkdir(parents=True)
    (orphan / "state.bin").write_bytes(b"o" * 4096)
    (directory / "notes").mkdir()
    (directory / "notes" / "readme.txt").write_text("mine")
    assert "1 leftover of interrupted runs" in (await run("ls", str(directory)))[1]
    async with aoffload.CheckpointEngine(directory, durable=False) as engine:  # alone: cleans
        assert engine.tags() == ["step-1"]
    assert not (directory / "step-2").exists()
    assert (directory / "notes" / "readme.txt").read_text() == "mine"
