"""CheckpointEngine.remove(): deleting a committed tag after the commits requested before it.

What the Lightning plugin's ``remove_checkpoint`` stands on, tested without Lightning, on the
engine's synchronous face from a plain thread (no event loop), as the plugin drives it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import aoffload
from aoffload.checkpoint.format import read


def save(engine: aoffload.CheckpointEngine, tag: str, value: float) -> None:
    engine.stage({"w": torch.full((8,), value)}, "m.pt", tag=tag).result()


def test_a_removal_moves_latest_back_and_deletes_the_tag(tmp_path: Path) -> None:
    with aoffload.CheckpointEngine(tmp_path, durable=False) as engine:
        for n, tag in enumerate(("a", "b", "c")):
            save(engine, tag, float(n))
            engine.commit(tag)
        assert engine.remove("c").result() is True  # `latest` named it: it moves to b
        assert engine.remove("a").result() is True
        assert engine.remove("a").result() is False  # gone already
        assert engine.tags() == ["b"]
        assert engine.latest() == "b"
        assert read.read_latest(tmp_path) == "b"
        with pytest.raises(aoffload.CheckpointError, match="no committed checkpoint 'c'"):
            engine.metadata("c")
        assert engine.remove("b").result() is True  # the last one: `latest` goes
        assert read.read_latest(tmp_path) is None
        with pytest.raises(aoffload.InvalidStateError):
            engine.remove("../x")
    # the close waited for the deletions
    assert read.scan(tmp_path, clean=False).tags == []
    assert not [e for e in tmp_path.iterdir() if e.name.startswith((".tmp-", ".trash-"))]


def test_a_tag_is_kept_when_a_commit_requested_before_its_removal_fails(tmp_path: Path) -> None:
    ran: list[str] = []
    with aoffload.CheckpointEngine(tmp_path, durable=False) as engine:
        save(engine, "old", 1.0)
        engine.commit("old").result()
        (tmp_path / "new").write_bytes(b"in the way")  # the publication of "new" fails
        save(engine, "new", 2.0)
        commit = engine.commit("new")
        removal = engine.remove("old", before=lambda: ran.append("before"))
        assert removal.result() is False
        assert ran == []
        with pytest.raises(aoffload.CheckpointError, match="could not publish checkpoint 'new'"):
            commit.result()  # seen here: the engine does not raise it again
        assert engine.tags() == ["old"]
        assert engine.remove("old", before=lambda: ran.append("before")).result() is True
        assert ran == ["before"]
        assert engine.pending() == []
