"""Commit metadata, and what the default load can read back: real engines, real files."""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import aoffload
from aoffload.checkpoint.core import plan as _plan
from aoffload.checkpoint.format.metadata import METADATA_LIMIT

from .test_checkpoint import _warm_up  # noqa: F401 - the module's warm-up

MANIFEST = ".aoffload-manifest.json"


def manifest(directory: Path, tag: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((directory / tag / MANIFEST).read_text())
    return loaded


# -- metadata ------------------------------------------------------------------------------


async def test_metadata_is_stored_in_the_manifest_and_read_back(tmp_path: Path) -> None:
    meta = {"step": 100, "loss": 1.25, "data": {"epoch": 2, "offsets": [3, 4]}, "ok": True}
    async with aoffload.CheckpointEngine(tmp_path, durable=False) as engine:
        await engine.save({"w": torch.ones(4)}, "m.pt", tag="step-100")
        result = await engine.commit("step-100", metadata=meta)
        assert result.metadata == meta
        assert engine.metadata() == meta
        assert engine.metadata("step-100") == meta
        await engine.save({"w": torch.zeros(4)}, "m.pt", tag="plain")
        assert (await engine.commit("plain")).metadata == {}
        assert engine.metadata() == {}  # `latest` names "plain", committed without any
        assert engine.metadata("step-100") == meta
        copy = engine.metadata("step-100")
        copy["step"] = -1  # a copy: the engine's view is unchanged
        assert engine.metadata("step-100")["step"] == 100
        with pytest.raises(aoffload.CheckpointError, match=r"no committed checkpoint 'nope'"):
            engine.metadata("nope")
    assert manifest(tmp_path, "step-100")["metadata"] == meta
    assert "metadata" not in manifest(tmp_path, "plain")
    # A new engine finds it in the manifests it scans; no engine needed either.
    async with aoffload.CheckpointEngine(tmp_path, durable=False) as engine:
        assert engine.metadata("step-100") == meta
        assert engine.metadata() == {}
    assert await aoffload.load_metadata(tmp_path, "step-100") == meta
    assert await aoffload.load_metadata(tmp_path) == {}
    with pytest.raises(aoffload.CheckpointError, match="no committed checkpoint 'nope'"):
        await aoffload.load_metadata(tmp_path, "nope")


async def test_metadata_of_an_empty_directory_is_an_error(tmp_path: Path) -> None:
    async with aoffload.CheckpointEngine(tmp_path, durable=False) as engine:
        with pytest.raises(aoffload.CheckpointError, match="holds no committed checkpoint"):
            engine.metadata()
    with pytest.raises(aoffload.CheckpointError, match="holds no committed checkpoint"):
        await aoffload.load_metadata(tmp_path)


class Opaque:
    pass


BAD_METADATA: list[tuple[object, str]] = [
    ({"loss": math.nan}, r"metadata\['loss'\]: nan is not a JSON number"),
    ({"loss": math.inf}, r"metadata\['loss'\]: inf is not a JSON number"),
    ({"step": np.int64(3)}, r"metadata\['step'\]: numpy.int64 is not JSON"),
    ({"loss": torch.tensor(0.5)}, r"metadata\['loss'\]: torch.Tensor is not JSON"),
    ({"a": {"b": [1, Opaque()]}}, r"metadata\['a'\]\['b'\]\[1\]: .*Opaque is not JSON"),
    ({1: "x"}, r"metadata: key 1 is a int; JSON keys are strings"),
    ([("step", 1)], r"metadata must be a mapping"),
    ({"blob": "x" * METADATA_LIMIT}, r"at most 65536 are kept"),
]


@pytest.mark.parametrize(("metadata", "match"), BAD_METADATA)
async def test_metadata_json_cannot_hold_is_refused_at_the_call(
    tmp_path: Path, metadata: object, match: str
) -> None:
    async with aoffload.CheckpointEngine(tmp_path, durable=False) as engine:
        await engine.save({"w": torch.ones(2)}, "m.pt", tag="t")
        with pytest.raises(aoffload.InvalidStateError, match=match):
            engine.commit("t", metadata=metadata)  # type: ignore[arg-type]  # raises at the call
        with pytest.raises(aoffload.InvalidStateError, match=match):
            engine.commit_soon("t", metadata=metadata)  # type: ignore[arg-type]
        assert engine.tags() == []  # nothing started: the tag is still open
        result = await engine.commit("t", metadata={"step": 1})
        assert result.metadata == {"step": 1}


async def test_metadata_is_taken_as_it_is_at_the_call(tmp_path: Path) -> None:
    meta: dict[str, Any] = {"step": 1, "seen": [1]}
    async with aoffload.CheckpointEngine(tmp_path, durable=False) as engine:
        await engine.save({"w": torch.ones(2)}, "m.pt", tag="t")
        engine.commit_soon("t", metadata=meta)
        meta["step"] = 2
        meta["seen"].append(2)
        assert (await engine.commit("t")).metadata == {"step": 1, "seen": [1]}
        assert await engine.commit("t", metadata={"step": 1, "seen": [1]})  # the same: fine
        with pytest.raises(aoffload.InvalidStateError, match="cannot change that"):
            engine.commit("t", metadata={"step": 2})
        await engine.save({"w": torch.ones(2)}, "m.pt", tag="u")
        engine.commit_soon("u", metadata={"step": 3})
        with pytest.raises(aoffload.InvalidStateError, match="cannot change that"):
            engine.commit("u", metadata={"step": 4})
        assert (await engine.commit("u")).metadata == {"step": 3}
    assert manifest(tmp_path, "t")["metadata"] == {"step": 1, "seen": [1]}


async def test_retired_tags_take_their_metadata_with_them(tmp_path: Path) -> None:
    async with aoffload.CheckpointEngine(tmp_path, durable=False, keep_last=2) as engine:
        for step in range(4):
            await engine.save({"w": torch.full((2,), float(step))}, "m.pt", tag=f"s{step}")
            await engine.commit(f"s{step}", metadata={"step": step})
        assert engine.tags() == ["s2", "s3"]
        assert [engine.metadata(tag)["step"] for tag in engine.tags()] == [2, 3]
        with pytest.raises(aoffload.CheckpointError, match="no committed checkpoint 's0'"):
            engine.metadata("s0")
        await engine.save({"w": torch.ones(2)}, "m.pt", tag="side")
        await engine.commit("side", metadata={"step": 99}, latest=False)
        assert engine.metadata() == {"step": 3}  # what `latest` names


async def test_a_replica_returns_the_metadata_it_was_given(tmp_path: Path) -> None:
    async with aoffload.CheckpointEngine(tmp_path, writer=False) as engine:
        await engine.save({"w": torch.ones(2)}, "m.pt", tag="t")
        assert (await engine.commit("t", metadata={"step": 5})).metadata == {"step": 5}


# -- loading what was saved ------------------------------------------------------------------


def rng_state() -> dict[str, object]:
    return {"w": torch.arange(6.0), "numpy": np.random.get_state(), "queue": collections.deque([1])}


async def test_weights_only_false_loads_what_the_default_refuses(tmp_path: Path) -> None:
    state = rng_state()
    async with aoffload.CheckpointEngine(tmp_path, durable=False, unloadable="ignore") as engine:
        await engine.save(state, "rng.pt", tag="t")
        await engine.commit("t")
        with pytest.raises(aoffload.CheckpointError, match=r"(?s)weights_only=True.*trust"):
            await engine.load("rng.pt")
        loaded = await engine.load("rng.pt", weights_only=False)
    for got in (loaded, await aoffload.load_checkpoint(tmp_path, "rng.pt", weights_only=False)):
        assert torch.equal(got["w"], state["w"])  # type: ignore[arg-type]
        assert got["queue"] == collections.deque([1])
        np.random.set_state(got["numpy"])
        expected = np.random.get_state()
        assert got["numpy"][0] == expected[0]
        assert np.array_equal(got["numpy"][1], expected[1])
    with pytest.raises(aoffload.CheckpointError, match=r"weights_only=True"):
        await aoffload.load_checkpoint(tmp_path, "rng.pt")


async def test_a_value_the_default_load_refuses_warns_at_the_fence(tmp_path: Path) -> None:
    async with aoffload.CheckpointEngine(tmp_path, durable=False) as engine:
        staged = engine.stage(rng_state(), "rng.pt", tag="t")
        with pytest.warns(UserWarning, match=r"'rng.pt': state\['numpy'\]\[1\] is pickled as"):
            await staged
        await staged  # once
        await engine.save({"w": torch.ones(2)}, "plain.pt", tag="t")  # no warning
        await engine.commit("t")


async def test_unloadable_error_fails_the_staging_and_the_tag_stays_usable(
    tmp_path: Path,
) -> None:
    async with aoffload.CheckpointEngine(tmp_path, durable=False, unloadable="error") as engine:
        staged = engine.stage({"w": torch.ones(2), "q": collections.deque()}, "m.pt", tag="t")
        with pytest.raises(
            aoffload.InvalidStateError, match=r"state\['q'\] is pickled as collections.deque"
        ):
            await staged
        await engine.save({"w": torch.ones(2), "q": []}, "m.pt", tag="t")  # the name is free
        result = await engine.commit("t")
        assert result.files == ("m.pt",)
        assert (await engine.load("m.pt"))["q"] == []


def test_unloadable_must_be_one_of_three(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unloadable must be"):
        aoffload.CheckpointEngine(tmp_path, unloadable="strict")  # type: ignore[arg-type]


@dataclasses.dataclass
class Point:
    x: int


Pair = collections.namedtuple("Pair", "a b")


def _function() -> None:
    pass


VALUES: dict[str, Any] = {
    "deque": collections.deque([1, 2]),
    "numpy array": np.arange(3),
    "numpy rng": np.random.get_state(),
    "numpy scalar": np.float32(1.5),
    "dataclass": Point(1),
    "defaultdict": collections.defaultdict(int, a=1),
    "namedtuple": Pair(1, 2),
    "a class": Point,
    "a function": _function,
    "ellipsis": ...,
    "OrderedDict": collections.OrderedDict(a=torch.ones(1)),
    "Counter": collections.Counter("aab"),
    "set": {1, 2},
    "complex": 1 + 2j,
    "bytes": b"\x00\xff",
    "bytearray": bytearray(b"ab"),
    "torch.Size": torch.Size([2, 3]),
    "dtype": torch.bfloat16,
    "device": torch.device("cpu"),
    "layout": torch.strided,
    "nested plain": {"a": [1, (2.5, "x")], "b": None, "c": True},
    "Parameter": torch.nn.Parameter(torch.ones(2)),
}


def loads_back(value: object, tmp_path: Path) -> bool:
    """The oracle: torch.save, then torch.load(weights_only=True)."""
    path = tmp_path / "oracle.pt"
    torch.save({"t": torch.ones(1), "v": value}, path)
    try:
        torch.load(path, weights_only=True)
    except Exception:  # noqa: BLE001 - refused, whatever torch raised
        return False
    return True


@pytest.mark.parametrize("kind", list(VALUES))
def test_the_planner_flags_exactly_what_torch_load_refuses(kind: str, tmp_path: Path) -> None:
    value = VALUES[kind]
    planned = _plan.plan({"t": torch.ones(1), "v": value}, "f.pt", check=True)
    assert (planned.unloadable is None) == loads_back(value, tmp_path), planned.unloadable
    if planned.unloadable is not None:
        assert "state['v']" in planned.unloadable
    assert _plan.plan({"v": value}, "f.pt").unloadable is None  # unchecked: never flagged


def test_allowed_safe_globals_are_not_flagged(tmp_path: Path) -> None:
    assert _plan.plan({"p": Point(2)}, "f.pt", check=True).unloadable is not None
    with torch.serialization.safe_globals([Point]):
        assert loads_back(Point(2), tmp_path)
        assert _plan.plan({"p": Point(2)}, "f.pt", check=True).unloadable is None


@pytest.mark.parametrize(
    ("state", "most"),
    [
        # the globals torch.save's pickle names, each met once (the pickle memoizes it):
        # _rebuild_tensor_v2, FloatStorage, OrderedDict
        ({f"layer{i}.weight": torch.ones(2) for i in range(500)}, 3),
        (torch.nn.Linear(4, 4).state_dict(), 3),
        ([{"step": 3, "exp_avg": torch.ones(2), "betas": (0.9, 0.99)}] * 100, 3),
    ],
    ids=["dict", "state_dict", "optimizer"],
)
def test_a_state_of_tensors_costs_the_check_almost_nothing(
    state: object, most: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check runs in the pickler's ``reducer_override``, which the pickler calls only for
    values outside its fast paths; it asks about each class or function the pickle names
    once: for tensor states, a few lookups whatever their size."""
    calls = 0
    check = _plan.refused

    def counting(obj: object, allowed: Any) -> str | None:
        nonlocal calls
        calls += 1
        return check(obj, allowed)

    monkeypatch.setattr(_plan, "refused", counting)
    pickler = _plan._CheckingPickler(_plan._Chunks())
    pickler.dump(state)
    assert pickler.refused is None
    assert calls <= most
