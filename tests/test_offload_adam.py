"""OffloadAdam against torch.optim.AdamW: the same numbers, bit for bit with the torch backend,
with a scheduler, clipping that triggers, an overflow, gradient accumulation, bf16 parameters;
the sync and async forms agree; the state dict resumes exactly and loads across the two."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import aoffload
from aoffload import OffloadAdam

from . import _offload as o

Results = dict[str, list[torch.Tensor]]


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread: on a loaded 2-core host, every two-thread op of a tiny model waits
    for a second core (100+ ms a backward); the loop guard is for the library, not for that."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


RUNS = {
    "plain": o.Run(),
    "clip": o.Run(clip=15.0),  # the norm starts near 5 and grows past 15
    "overflow": o.Run(clip=1.0, overflow_at=7),
    "nonfinite": o.Run(skip_nonfinite=True, overflow_at=3),
    "accumulation": o.Run(micro=4, clip=1.0),
    "bf16": o.Run(dtype=torch.bfloat16, clip=1.0),
}


@pytest.fixture(scope="module")
def expected() -> dict[str, list[torch.Tensor]]:
    """torch.optim.AdamW's results for every run, computed once, outside any event loop."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        found = {name: o.reference(run) for name, run in RUNS.items()}
        found["foreach"] = o.reference(RUNS["plain"], fused=False)
        return found
    finally:
        torch.set_num_threads(threads)


async def test_matches_adamw_fused_bit_for_bit_over_24_steps(expected: Results) -> None:
    got, reports = await o.offloaded(RUNS["plain"])
    o.assert_identical(got, expected["plain"])
    assert all(r == aoffload.StepReport(None, False, False) for r in reports)


async def test_is_within_1e6_of_adamw_foreach(expected: Results) -> None:
    got, _ = await o.offloaded(RUNS["plain"])
    o.assert_relative(got, expected["foreach"], rtol=1e-6)
    different = zip(expected["plain"], expected["foreach"], strict=True)
    assert any(not torch.equal(a, b) for a, b in different)  # the check is not vacuous


@pytest.mark.deepspeed
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs DeepSpeed")
@pytest.mark.parametrize("name", ["plain", "clip", "overflow"])
async def test_the_deepspeed_backend_is_within_its_tolerance_of_adamw(
    expected: Results, name: str
) -> None:
    """DeepSpeed's CPU Adam is AdamW's math in its own vectorised order: not bit-identical.
    Measured here at about 2e-6 relative after 24 steps; 1e-5 leaves room."""
    run = dataclasses.replace(RUNS[name], backend="deepspeed")
    got, reports = await o.offloaded(run)
    o.assert_relative(got, expected[name], rtol=1e-5)
    assert any(not torch.equal(a, b) for a, b in zip(got, expected[name], strict=True))
    if name == "clip":
        assert any(r.clipped for r in reports)
    if name == "overflow":
        assert [i for i, r in enumerate(reports) if r.skipped] == [7]


async def test_clipping_is_bit_identical_to_clipping_first_then_stepping(
    expected: Results,
) -> None:
    run = RUNS["clip"]
    got, reports = await o.offloaded(run)
    o.assert_identical(got, expected["clip"])
    clipped = [r.clipped for r in reports]
    assert any(clipped), clipped  # clipping triggers...
    assert not all(clipped), clipped  # ...and not always
    model = o.mlp()
    o.backward(model, 0, run, lambda: None)  # the first step's norm, as torch takes it
    ordered = [p for group in o.groups(model) for p in group["params"]]  # type: ignore[attr-defined]
    norm = torch.nn.utils.get_total_norm([p.grad for p in ordered])
    assert reports[0].grad_norm == norm.item()


async def test_an_overflowed_step_is_skipped_exactly(expected: Results) -> None:
    got, reports = await o.offloaded(RUNS["overflow"])
    o.assert_identical(got, expected["overflow"])
    assert [i for i, r in enumerate(reports) if r.skipped] == [7]


async def test_skip_nonfinite_without_clipping(expected: Results) -> None:
    got, reports = await o.offloaded(RUNS["nonfinite"])
    o.assert_identical(got, expected["nonfinite"])
    assert reports[3].skipped
    assert not any(r.clipped for r in reports)


async def test_gradient_accumulation_under_no_sync(expected: Results) -> None:
    got, _ = await o.offloaded(RUNS["accumulation"])
    o.assert_identical(got, expected["accumulation"])


async def test_bf16_parameters_step_fp32_masters(expected: Results) -> None:
    got, _ = await o.offloaded(RUNS["bf16"])
    assert got[0].dtype == torch.bfloat16
    o.assert_identical(got, expected["bf16"])


def test_the_sync_form_agrees_exactly_with_the_async_form() -> None:
    run = o.Run(clip=1.0, overflow_at=5, micro=2)
    sync, sync_reports = o.offloaded_sync(run)
    async_, async_reports = aoffload.run(o.offloaded(run))
    o.assert_identical(sync, async_)
    assert [repr(r) for r in sync_reports] == [repr(r) for r in async_reports]  # nan == nan
    o.assert_identical(sync, o.reference(run))


async def test_fp32_parameters_live_in_shared_memory_and_move_their_versions_in_the_step() -> None:
    """fp32 CPU parameters are views of the worker's shared memory, their gradients too: the
    backward writes where the worker reads, the worker's step lands in them, and their version
    counters move when the step settles (what a checkpoint's fence looks at)."""
    model = o.mlp()
    run = o.Run()
    async with o.offload_adam(model, run) as opt:
        params = list(model.parameters())
        buckets = opt._off.buckets
        assert all(all(b.resident) for b in buckets)
        masters = {id(p): b.master_views[i] for b in buckets for i, p in enumerate(b.params)}
        grads = {id(p): b.grad_views[i] for b in buckets for i, p in enumerate(b.params)}
        assert all(p.data_ptr() == masters[id(p)].data_ptr() for p in params)
        before = [p.detach().clone() for p in params]
        versions = [p._version for p in params]
        o.backward(model, 0, run, opt.no_sync)  # every bucket is submitted and steps now
        assert all(p.grad.data_ptr() == grads[id(p)].data_ptr() for p in params)
        assert opt._off.in_step()
        await opt._waits.until(opt._off.core.outcomes, opt._off.core.outcomes.idle)
        assert all(not torch.equal(p, b) for p, b in zip(params, before, strict=True))
        assert [p._version for p in params] == versions  # the worker wrote them
        await opt.astep()
        assert all(p._version > v for p, v in zip(params, versions, strict=True))
        opt.zero_grad()
        assert all(p.grad is None for p in params)  # torch.optim's meaning
        o.backward(model, 1, run, opt.no_sync)  # written into shared memory again
        assert all(p.grad.data_ptr() == grads[id(p)].data_ptr() for p in params)
        await opt.astep()


async def test_a_closed_optimizer_gives_the_parameters_memory_of_their_own() -> None:
    model, twin = o.mlp(), o.mlp()
    run = o.Run()
    for step in range(4):  # a new optimizer (a fresh state) each step, on both sides
        adamw = torch.optim.AdamW(o.groups(twin), lr=o.LR, fused=True)
        async with o.offload_adam(model, run) as opt:
            shared = {b.master.untyped_storage().data_ptr() for b in opt._off.buckets}
            assert all(all(b.resident) for b in opt._off.buckets)  # taken in again
            for m in (model, twin):
                o.loss_of(m, step, 0, run).backward()
            await opt.astep()
            adamw.step()
        for p in model.parameters():
            storage = p.untyped_storage()
            assert storage.data_ptr() not in shared
            assert storage.nbytes() == 4 * p.numel()  # alone in its storage
            assert p.grad is not None
            assert p.grad.untyped_storage().nbytes() == 4 * p.numel()
        o.assert_identical([p.detach() for p in model.parameters()], list(twin.parameters()))
        o.assert_identical(
            [p.grad for p in model.parameters()], [p.grad for p in twin.parameters()]
        )
        model.zero_grad()
        twin.zero_grad()


async def test_bf16_parameters_change_only_inside_the_step() -> None:
    run = o.Run(dtype=torch.bfloat16)
    model = o.mlp(run.dtype)
    async with o.offload_adam(model, run) as opt:
        assert not any(any(b.resident) for b in opt._off.buckets)
        before = [p.detach().clone() for p in model.parameters()]
        versions = [p._version for p in model.parameters()]
        o.backward(model, 0, run, opt.no_sync)
        assert opt._off.in_step()
        await opt._waits.until(opt._off.core.outcomes, opt._off.core.outcomes.idle)
        o.assert_identical([p.detach() for p in model.parameters()], before)
        assert [p._version for p in model.parameters()] == versions
        await opt.astep()
        assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
        assert all(p._version > v for p, v in zip(model.parameters(), versions, strict=True))


@pytest.mark.parametrize(
    "how", ["opt.zero_grad()", "opt.zero_grad(False)", "a gradient set by hand", "micro-batches"]
)
async def test_every_way_of_handling_gradients_trains_as_adamw(how: str) -> None:
    """Gradients kept (zeroed in place), dropped, set by hand or accumulated: the same
    steps as torch.optim.AdamW's, and the shared gradient is .grad wherever autograd made it."""
    model, twin, run, adamw = o.twins()
    async with o.offload_adam(model, run) as opt:
        shared = {id(p): b.grad_ptrs[i] for b in opt._off.buckets for i, p in enumerate(b.params)}
        for step in range(4):
            if how == "a gradient set by hand":
                for m in (model, twin):
                    for p in list(m.parameters())[::2]:
                        p.grad = torch.full_like(p, 0.01)
            for m, optimizer in ((model, opt), (twin, adamw)):
                if how == "micro-batches":
                    with opt.no_sync() if optimizer is opt else contextlib.nullcontext():
                        o.loss_of(m, step, 1, run).backward()
                o.loss_of(m, step, 0, run).backward()
            await opt.astep()
            adamw.step()
            by_hand = how == "a gradient set by hand"
            kept = [
                p.grad.data_ptr() == shared[id(p)]
                for i, p in enumerate(model.parameters())
                if not (by_hand and i % 2 == 0)
            ]
            assert all(kept)
            for optimizer in (opt, adamw):
                optimizer.zero_grad(set_to_none=how != "opt.zero_grad(False)")
    o.assert_identical([p.detach() for p in model.parameters()], list(twin.parameters()))


async def test_a_re_pointed_parameter_is_taken_back_into_shared_memory() -> None:
    model, twin, run, adamw = o.twins()
    async with o.offload_adam(model, run) as opt:
        for step in range(4):
            if step == 2:  # a new tensor as the data of every parameter
                for p, q in zip(model.parameters(), twin.parameters(), strict=True):
                    p.data = p.detach() * 0.5
                    q.data = q.detach() * 0.5
                shared = [
                    b.master_views[i].data_ptr()
                    for b in opt._off.buckets
                    for i in range(len(b.params))
                ]
                assert not {p.data_ptr() for p in model.parameters()} & set(shared)
            for m in (model, twin):
                o.loss_of(m, step, 0, run).backward()
            await opt.astep()
            adamw.step()
            opt.zero_grad()
            adamw.zero_grad()
        for bucket in opt._off.buckets:  # back in the master, still resident
            assert all(bucket.resident)
            for param, view in zip(bucket.params, bucket.master_views, strict=True):
                assert param.data_ptr() == view.data_ptr()
    o.assert_identical([p.detach() for p in model.parameters()], list(twin.parameters()))


def _state_round_trip(sd: dict[str, object]) -> dict[str, object]:
    """What a checkpoint gives back: copies (the caller owns the state's tensors)."""
    return {
        "state": {k: {n: t.clone() for n, t in v.items()} for k, v in sd["state"].items()},  # type: ignore[attr-defined]
        "param_groups": [dict(g) for g in sd["param_groups"]],  # type: ignore[attr-defined]
        "offload": sd["offload"],
    }


@pytest.mark.parametrize("load", ["before start", "while running"])
async def test_state_dict_round_trip_resumes_bit_identically(load: str) -> None:
    run = o.Run(clip=1.0, steps=16)
    unbroken, _ = await o.offloaded(run)
    model = o.mlp()
    opt = o.offload_adam(model, run)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    async with opt:
        for step in range(8):
            o.backward(model, step, run, opt.no_sync)
            await opt.astep()
            opt.zero_grad()
            sched.step()
        saved = _state_round_trip(await opt.astate_dict())
        assert opt.state_dict()["param_groups"] == saved["param_groups"]
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        sched_state = sched.state_dict()

    resumed = o.mlp()
    resumed.load_state_dict(weights)
    opt = o.offload_adam(resumed, run)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    sched.load_state_dict(sched_state)
    if load == "before start":
        opt.load_state_dict(saved)
        assert opt.state_dict()["param_groups"][0]["lr"] == saved["param_groups"][0]["lr"]  # type: ignore[index]
    async with opt:
        if load == "while running":
            await opt.aload_state_dict(saved)
        for step in range(8, 16):
            o.backward(resumed, step, run, opt.no_sync)
            await opt.astep()
            opt.zero_grad()
            sched.step()
    o.assert_identical([p.detach() for p in resumed.parameters()], unbroken)


async def test_a_state_loads_across_offload_adam_and_adamw() -> None:
    run = o.Run(steps=6)
    model = o.mlp()
    async with o.offload_adam(model, run) as opt:
        for step in range(3):
            o.backward(model, step, run, opt.no_sync)
            await opt.astep()
            opt.zero_grad()
        ours = _state_round_trip(opt.state_dict())
        twin = o.mlp()
        twin.load_state_dict(model.state_dict())
        adamw = torch.optim.AdamW(o.groups(twin), lr=o.LR, fused=True)
        adamw.load_state_dict(ours)  # ours loads into torch's
        for group in adamw.param_groups:  # loaded groups replace torch's own: fused again
            group["fused"] = True
        for step in range(3, 6):
            for m, opt_ in ((model, opt), (twin, adamw)):
                o.loss_of(m, step, 0, run).backward()
                if opt_ is opt:
                    await opt.astep()
                else:
                    adamw.step()
                opt_.zero_grad()
        o.assert_identical([p.detach() for p in model.parameters()], list(twin.parameters()))
        await opt.aload_state_dict(adamw.state_dict())  # and torch's into ours
        assert opt.state_dict()["state"][0]["step"].item() == 6


async def test_betas_and_weight_decay_changed_mid_run_take_effect() -> None:
    model, twin, run, adamw = o.twins()
    async with o.offload_adam(model, run) as opt:
        for step in range(6):
            if step == 3:
                for optimizer in (opt, adamw):
                    optimizer.param_groups[0]["betas"] = (0.8, 0.99)
                    optimizer.param_groups[1]["weight_decay"] = 0.05
            for m in (model, twin):
                o.loss_of(m, step, 0, run).backward()
            await opt.astep()
            adamw.step()
            opt.zero_grad()
            adamw.zero_grad()
    o.assert_identical([p.detach() for p in model.parameters()], list(twin.parameters()))


async def test_add_param_group_while_running_and_an_outside_change() -> None:
    model, twin = o.mlp(), o.mlp()
    run = o.Run()
    first = [p for p in model.parameters()][:4]
    opt = OffloadAdam(first, lr=o.LR, backend="torch", bucket_mb=0.01)
    adamw = torch.optim.AdamW(list(twin.parameters())[:4], lr=o.LR, fused=True)
    async with opt:
        opt.add_param_group({"params": list(model.parameters())[4:], "weight_decay": 0.0})
        adamw.add_param_group({"params": list(twin.parameters())[4:], "weight_decay": 0.0})
        for step in range(5):
            if step == 2:  # an outside change the next step must start from
                with torch.no_grad():
                    for m in (model, twin):
                        m[0].weight.mul_(0.5)
            for m in (model, twin):
                o.loss_of(m, step, 0, run).backward()
            await opt.astep()
            adamw.step()
            opt.zero_grad()
            adamw.zero_grad()
    o.assert_identical([p.detach() for p in model.parameters()], list(twin.parameters()))


async def test_a_gradient_accumulated_after_its_bucket_was_submitted_is_an_error() -> None:
    model = o.mlp()
    run = o.Run()
    async with o.offload_adam(model, run) as opt:
        o.loss_of(model, 0, 0, run).backward()  # the last backward: every bucket submitted
        o.loss_of(model, 0, 1, run).backward()  # a second one, not under no_sync()
        with pytest.raises(aoffload.OptimizerError, match=r"parameters \[0, 1, 2, 3, 4, 5\]"):
            await opt.astep()
        opt.zero_grad()
        o.loss_of(model, 1, 0, run).backward()
        await opt.astep()  # the optimizer is usable again


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"backend": "jax"}, r"backend must be one of \('auto', 'deepspeed', 'torch'\), got 'jax'"),
        ({"bucket_mb": 0}, r"bucket_mb must be a number > 0, got 0"),
        ({"max_grad_norm": -1.0}, r"max_grad_norm must be None or a number > 0, got -1\.0"),
        ({"worker_cores": 2.0}, r"worker_cores must be in \(0, 1\], got 2\.0"),
        ({"betas": (1.5, 0.9)}, r"param group 0: betas must lie in \[0, 1\), got \(1\.5, 0\.9\)"),
    ],
)
def test_each_bad_option_is_refused_at_construction_naming_it(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(aoffload.OptimizerError, match=message):
        OffloadAdam(list(o.mlp().parameters()), **kwargs)


def test_options_are_checked_at_construction() -> None:
    params = list(o.mlp().parameters())
    with pytest.raises(aoffload.OptimizerError, match="amsgrad"):
        OffloadAdam([{"params": params, "amsgrad": True}])
    opt = OffloadAdam(params)
    with pytest.raises(aoffload.ClosedError):
        opt.step()
    with pytest.raises(TypeError, match="state_dict"):
        copy.deepcopy(opt)
