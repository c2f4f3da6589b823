"""EngineCore.remove(): deleting a committed tag after the commits requested before it.

What the Lightning plugin's ``remove_checkpoint`` stands on, tested without Lightning, on the
synchronous core from a plain thread (no event loop), as the plugin drives it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import aoffload
from aoffload.checkpoint.core.engine import EngineCore
from aoffload.checkpoint.format import read


def save(engine: EngineCore, tag: str, value: float) -> None:
    job = engine.stage({"w": torch.full((8,), value)}, "m.pt", tag)
    assert job is not None
    job.staged.result()
    engine.seal(job)


def test_a_removal_moves_latest_back_and_deletes_the_tag(tmp_path: Path) -> None:
    engine = EngineCore(tmp_path, durable=False)
    engine.start()
    try:
        for n, tag in enumerate(("a", "b", "c")):
            save(engine, tag, float(n))
            engine.commit(tag)
        assert engine.remove("c").result() is True  # `latest` named it: it moves to b
        assert engine.remove("a").result() is True
        assert engine.remove("a").result() is False  # gone already
        assert engine.catalog.tags == ["b"]
        assert engine.catalog.latest == "b"
        assert read.read_latest(tmp_path) == "b"
        with pytest.raises(aoffload.CheckpointError, match="no committed checkpoint 'c'"):
            engine.metadata("c")
        assert engine.remove("b").result() is True  # the last one: `latest` goes
        assert read.read_latest(tmp_path) is None
    finally:
        engine.close()  # waits for the deletions
    assert read.scan(tmp_path, clean=False).tags == []
    assert not [e for e in tmp_path.iterdir() if e.name.startswith((".tmp-", ".trash-"))]


def test_a_tag_is_kept_when_a_commit_requested_before_its_removal_fails(tmp_path: Path) -> None:
    engine = EngineCore(tmp_path, durable=False)
    engine.start()
    ran: list[str] = []
    try:
        save(engine, "old", 1.0)
        engine.commit("old").result()
        (tmp_path / "new").write_bytes(b"in the way")  # the publication of "new" fails
        save(engine, "new", 2.0)
        commit = engine.commit("new")
        removal = engine.remove("old", lambda: ran.append("before"))
        assert removal.result() is False
        assert ran == []
        with pytest.raises(aoffload.CheckpointError, match="could not publish checkpoint 'new'"):
            commit.result()
        engine.tags.commit_seen(commit)
        assert engine.catalog.tags == ["old"]
        assert engine.remove("old", lambda: ran.append("before")).result() is True
        assert ran == ["before"]
    finally:
        engine.close()
