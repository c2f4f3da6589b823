"""CPUAdam state: bit-identical resume from a checkpoint, validation, snapshots, streams."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import aoffload
from aoffload import CPUAdam, StepKind

# Two groups with the same betas: DeepSpeed's op then multiplies beta**step across every
# call, and a resume that recomputed it with pow would differ in the last bit at step 6.
GROUPS = [
    {"lr": 5e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01},
    {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.0},
]
SUBGROUPS = {(0, 0): 300, (0, 1): 200, (1, 2): 257}


@dataclass(frozen=True)
class Op:
    key: tuple[int, int]
    lr: float | None = None
    rollback: bool = False


def iteration(
    lr: dict[int, float] | None = None, rollback: tuple[int, int] | None = None
) -> list[Op]:
    lr = lr or {}
    ops = [Op(key, lr.get(key[0])) for key in SUBGROUPS]
    if rollback is not None:
        ops.append(Op(rollback, rollback=True))
    return ops


# N = 5 iterations, an lr change, ending with a rollback; then M = 4 more.
FIRST = [iteration(), iteration(), iteration({0: 2e-2}), iteration(), iteration(rollback=(0, 1))]
SECOND = [iteration(), iteration({1: 3e-3}, rollback=(1, 2)), iteration(), iteration()]


def grad_for(index: int, key: tuple[int, int]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * index + 10 * key[0] + key[1])
    return torch.randn(SUBGROUPS[key], generator=gen)


def initial_params() -> dict[tuple[int, int], torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {key: torch.randn(n, generator=gen) for key, n in SUBGROUPS.items()}


async def run(
    opt: CPUAdam,
    params: dict[tuple[int, int], torch.Tensor],
    grads: dict[tuple[int, int], torch.Tensor],
    iterations: list[list[Op]],
    first_index: int,
) -> None:
    for index, ops in enumerate(iterations, first_index):
        for op in ops:
            if not op.rollback:  # a rollback needs the gradient of the step it undoes
                grads[op.key].copy_(grad_for(index, op.key))
            opt.submit(*op.key, params[op.key], grads[op.key], lr=op.lr, rollback=op.rollback)
        results = await opt.drain()
        assert [r.kind for r in results] == [
            StepKind.ROLLBACK if op.rollback else StepKind.STEP for op in ops
        ]


def as_saved(params: dict[tuple[int, int], torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"{g}.{s}": p for (g, s), p in params.items()}


@contextlib.asynccontextmanager
async def optimizers(count: int, **options: Any) -> AsyncIterator[list[CPUAdam]]:
    opts = [CPUAdam(GROUPS, **options) for _ in range(count)]
    async with contextlib.AsyncExitStack() as stack:
        for opt in opts:
            stack.push_async_callback(opt.aclose)
        await asyncio.gather(*(opt.astart() for opt in opts))  # spawn them side by side
        yield opts


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["kernel"] == b["kernel"]
    assert a["state"].keys() == b["state"].keys()
    for gid, subgroups in a["state"].items():
        assert subgroups.keys() == b["state"][gid].keys()
        for sid, entry in subgroups.items():
            other = b["state"][gid][sid]
            assert entry["step"] == other["step"]
            assert torch.equal(entry["exp_avg"], other["exp_avg"])
            assert torch.equal(entry["exp_avg_sq"], other["exp_avg_sq"])


# The two heavy tests below spawn six workers each: they run on one loop (asyncio.run),
# not on both like the async tests, to keep the suite fast.


def _needs_deepspeed() -> list[pytest.MarkDecorator]:
    missing = importlib.util.find_spec("deepspeed") is None
    return [pytest.mark.deepspeed, pytest.mark.skipif(missing, reason="needs DeepSpeed")]


@pytest.mark.parametrize("backend", ["torch", pytest.param("deepspeed", marks=_needs_deepspeed())])
def test_resume_from_a_checkpoint_is_bit_identical(backend: str, tmp_path: Path) -> None:
    asyncio.run(resume_both_ways(backend, tmp_path))


async def resume_both_ways(backend: str, tmp_path: Path) -> None:
    async with (
        aoffload.CheckpointEngine(tmp_path) as engine,
        optimizers(2, backend=backend) as (plain, resumed),
        optimizers(2, backend=backend, exact_rollback=True) as exact,
    ):
        for tag, (a, b) in {"algebraic": (plain, resumed), "exact": tuple(exact)}.items():
            params = initial_params()
            grads = {key: torch.zeros(n) for key, n in SUBGROUPS.items()}
            await run(a, params, grads, FIRST, 0)
            await engine.save(as_saved(params), "model.pt", tag=tag)
            await engine.save(await a.state_dict(), "optim.pt", tag=tag)
            await engine.commit(tag)
            await run(a, params, grads, SECOND, len(FIRST))

            saved = await engine.load("model.pt", tag=tag)
            again = {key: saved[f"{key[0]}.{key[1]}"] for key in SUBGROUPS}
            fresh = {key: torch.zeros(n) for key, n in SUBGROUPS.items()}
            if tag == "algebraic":  # registered before the load; else on their first submit
                for key in SUBGROUPS:
                    await b.register(*key, again[key], fresh[key])
            await b.load_state_dict(await engine.load("optim.pt", tag=tag))
            await run(b, again, fresh, SECOND, len(FIRST))

            for key in SUBGROUPS:
                assert torch.equal(params[key], again[key]), (tag, key)
            assert_same_state(await a.state_dict(), await b.state_dict())


@pytest.mark.deepspeed
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs DeepSpeed")
def test_cross_backend_resume_loads_the_same_state() -> None:
    """Across backends the state round-trips exactly; the steps after it agree closely
    (the two backends' kernels round differently, so bits may differ)."""
    asyncio.run(cross_backend())


async def cross_backend() -> None:
    async with (
        optimizers(1, backend="torch") as (torch_opt,),
        optimizers(1, backend="deepspeed") as (ds_opt,),
    ):
        runs = {}
        for opt in (torch_opt, ds_opt):
            params = initial_params()
            grads = {key: torch.zeros(n) for key, n in SUBGROUPS.items()}
            await run(opt, params, grads, FIRST, 0)
            runs[opt] = (params, grads, await opt.state_dict())
        assert runs[torch_opt][2]["kernel"] is None
        assert runs[ds_opt][2]["kernel"] is not None
        # Swap: each backend resumes the other's run (state, and params copied in).
        for opt, other in ((torch_opt, ds_opt), (ds_opt, torch_opt)):
            await opt.load_state_dict(runs[other][2])
            loaded = await opt.state_dict()
            for gid, subgroups in runs[other][2]["state"].items():
                for sid, entry in subgroups.items():
                    assert torch.equal(entry["exp_avg"], loaded["state"][gid][sid]["exp_avg"])
                    assert torch.equal(entry["exp_avg_sq"], loaded["state"][gid][sid]["exp_avg_sq"])
                    assert entry["step"] == loaded["state"][gid][sid]["step"]
            assert loaded["param_groups"] == runs[other][2]["param_groups"]
        for key in SUBGROUPS:
            mine, theirs = runs[torch_opt][0][key], runs[ds_opt][0][key]
            held = mine.clone()
            mine.copy_(theirs)
            theirs.copy_(held)
        for opt in (torch_opt, ds_opt):
            await run(opt, runs[opt][0], runs[opt][1], SECOND, len(FIRST))
        for key in SUBGROUPS:
            torch.testing.assert_close(
                runs[torch_opt][0][key], runs[ds_opt][0][key], rtol=1e-5, atol=1e-6
            )


async def test_load_validates_everything_first_and_changes_nothing() -> None:
    async with optimizers(1, backend="torch") as (opt,):
        params = initial_params()
        grads = {key: torch.zeros(n) for key, n in SUBGROUPS.items()}
        await run(opt, params, grads, FIRST[:2], 0)
        good = await opt.state_dict()
        before = {k: v for k, v in good.items() if k != "state"}

        def variant(**changes: Any) -> dict[str, Any]:
            state = {g: {s: dict(e) for s, e in subs.items()} for g, subs in good["state"].items()}
            for (gid, sid, name), value in changes.get("entries", {}).items():
                state.setdefault(gid, {}).setdefault(sid, dict(good["state"][0][0]))[name] = value
            return {**good, "state": state, **changes.get("top", {})}

        bad = [
            (variant(entries={(5, 0, "step"): 1}), "unknown param group id 5"),
            (variant(entries={(0, 0, "exp_avg"): torch.zeros(299)}), "shape"),
            (variant(entries={(0, 1, "exp_avg_sq"): torch.zeros(200).double()}), "float64"),
            (variant(entries={(1, 2, "step"): -1}), "step must be"),
            (variant(top={"param_groups": good["param_groups"][:1]}), "1 param groups"),
            (variant(top={"format": "torch"}), "not a CPUAdam state dict"),
            ({"state": {}}, "not a CPUAdam state dict"),
        ]
        for state_dict, message in bad:
            with pytest.raises(aoffload.OptimizerError, match=message):
                await opt.load_state_dict(state_dict)
        after = await opt.state_dict()
        assert_same_state(good, after)
        assert {k: v for k, v in after.items() if k != "state"} == before
        # A sub-group the state holds but nobody registered yet is checked on registration.
        await opt.load_state_dict(variant(entries={(0, 9, "exp_avg"): torch.zeros(300)}))
        with pytest.raises(aoffload.OptimizerError, match="the state loaded for it holds 300"):
            opt.submit(0, 9, torch.zeros(10), torch.zeros(10))


async def test_snapshot_covers_steps_in_flight_and_never_changes_afterwards() -> None:
    async with optimizers(1, backend="torch") as (opt,):
        p, g = torch.zeros(1000), torch.ones(1000)
        for _ in range(3):
            opt.submit(0, 0, p, g)  # in flight when state_dict() is called
        sd = await opt.state_dict()
        assert sd["state"][0][0]["step"] == 3
        assert [r.step for r in await opt.drain()] == [1, 2, 3]  # results still delivered
        kept = sd["state"][0][0]["exp_avg"].clone()
        opt.submit(0, 0, p, g)
        later = await opt.state_dict()  # the first dict is alive: another buffer is used
        await opt.drain()
        assert torch.equal(sd["state"][0][0]["exp_avg"], kept)
        assert later["state"][0][0]["step"] == 4
        assert not torch.equal(later["state"][0][0]["exp_avg"], kept)
        loading = asyncio.ensure_future(opt.load_state_dict(sd))
        await asyncio.sleep(0)  # the load runs up to its first wait
        with pytest.raises(aoffload.OptimizerError, match="in progress"):
            opt.submit(0, 0, p, g)
        with pytest.raises(aoffload.OptimizerError, match="in progress"):
            await opt.register(0, 1, torch.zeros(10), torch.ones(10))  # it would miss its state
        await loading
        assert (await opt.state_dict())["state"][0][0]["step"] == 3


async def test_follow_stream_lives_until_close_and_drain_reports_every_failure() -> None:
    opt = CPUAdam([{"lr": 0.1}], backend="torch")
    await opt.astart()
    p, g = torch.ones(8), torch.ones(8)
    opt.submit(0, 0, p, g, rollback=True)  # nothing to undo
    opt.submit(0, 1, p.clone(), g.clone())
    opt.submit(0, 2, p.clone(), g.clone(), rollback=True)
    with pytest.raises(ExceptionGroup) as info:
        await opt.drain()
    assert len(info.value.exceptions) == 2
    assert all(isinstance(e, aoffload.RemoteError) for e in info.value.exceptions)
    [kept] = await opt.drain()  # the step that succeeded was not dropped
    assert (kept.subgroup_id, kept.step) == (1, 1)

    seen: list[int] = []
    two = asyncio.Event()

    async def consume() -> None:
        async for result in opt.results(follow=True):
            seen.append(result.step)
            if len(seen) == 2:
                two.set()

    consumer = asyncio.create_task(consume())
    await asyncio.sleep(0.05)  # started before the first submit: it must not have ended
    assert not consumer.done()
    for _ in range(2):
        opt.submit(0, 0, p, g)
    await asyncio.wait_for(two.wait(), 5)
    await asyncio.sleep(0.05)  # idle again: the consumer still waits
    assert not consumer.done()
    opt.submit(0, 0, p, g)
    await opt.aclose()  # the close finishes the step sent; the consumer gets it, then ends
    await asyncio.wait_for(consumer, 5)
    assert seen == [1, 2, 3]
