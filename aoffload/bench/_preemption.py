"""Preemption section: from a SIGTERM to a durable checkpoint on every rank, and what the notice
costs a step without one.

Two gloo ranks, each in a process group of its own (as torchrun starts them), each holding
``size_gib`` of state, train with steps that block the event loop (``time.sleep``: a trainer
waiting for its accelerator) and a one-number ``all_reduce`` per step, as data-parallel ranks
do. Per repetition, each rank first saves and commits the state twice (the first allocates
the engine's staging memory; the second is the reference, one warm ``stage()`` and commit),
then the benchmark sends SIGTERM to one rank's whole process group
(its writer and worker server included) at a random moment of a step. Every rank stamps, on
the machine's monotonic clock, when ``reached()`` said True, when its state was staged and
when ``commit()`` returned (durable on every rank). Then, in the same processes and without
a notice, the cost of one ``reached()`` call, beside what a per-step agreement would cost
instead: a store round trip and a one-number gloo ``all_reduce``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._common import Report, progress

SECTION = "preemption"
_CALLS = 20_000  # reached() calls per timing batch
_BATCHES = 7


def _rank_main() -> None:  # the rank process: python -c "...; _rank_main()" ARGS_JSON
    import datetime

    import torch
    import torch.distributed as dist

    import aoffload
    from aoffload._runtime.loops import new_event_loop

    args = json.loads(sys.argv[1])
    rank, step_seconds = int(os.environ["RANK"]), float(args["step_seconds"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    mib = int(args["mib"])
    count, numel = max(1, mib // 64), min(mib, 64) << 18  # 64 MiB tensors, or one smaller
    state = {f"r{rank}.{i}": torch.empty(numel).fill_(rank + i) for i in range(count)}
    one = torch.zeros(1)
    loop = new_event_loop()

    async def rep(n: int) -> dict[str, Any]:
        directory = Path(args["root"]) / f"rep{n}"
        async with aoffload.CheckpointEngine(directory, distributed=True, keep_last=1) as engine:
            notice = engine.preemption()
            calls, batches = int(args["calls"]), int(args["batches"])
            costs = (
                {"reached (2 ranks)": await _reached_cost(notice, calls, batches)} if n == 0 else {}
            )
            reference = []
            for tag in ("first", "periodic"):  # the first allocates the staging memory
                dist.barrier()
                started = time.monotonic()
                await engine.save(state, f"rank-{rank}.pt", tag=tag)
                await engine.commit(tag)
                reference.append(time.monotonic() - started)
            dist.barrier()
            print(f"ready {n}", flush=True)
            step = batches * calls if n == 0 else 0  # past the steps the costs asked about
            while True:
                time.sleep(step_seconds)  # noqa: ASYNC251 - the step: the loop is blocked
                dist.all_reduce(one)
                step += 1
                if await notice.reached(step):
                    break
            reached = time.monotonic()
            await engine.save(state, f"rank-{rank}.pt", tag=f"step-{step}")
            staged = time.monotonic()
            await engine.commit(f"step-{step}")
            durable = time.monotonic()
            if n == 0:
                costs.update(await _costs(engine, calls, batches))
        result = {"rep": n, "step": step, "reference": reference, "reached": reached}
        result.update(staged=staged, durable=durable)
        return {**result, "costs": costs} if costs else result

    try:
        for n in range(int(args["reps"])):
            print(json.dumps(loop.run_until_complete(rep(n))), flush=True)
            dist.barrier()
    finally:
        loop.close()
        dist.destroy_process_group()


async def _reached_cost(notice: Any, calls: int, batches: int) -> list[float]:
    """Seconds per ``reached()`` call without a notice, one sample per batch of calls."""
    samples = []
    for batch in range(batches):
        started = time.perf_counter()
        for step in range(batch * calls, (batch + 1) * calls):
            await notice.reached(step)
        samples.append((time.perf_counter() - started) / calls)
    return samples


async def _costs(engine: Any, calls: int, batches: int) -> dict[str, list[float]]:
    """Per-call seconds: reached() of a single-process notice; what a per-step agreement
    would cost instead (a store round trip, a one-number all_reduce)."""
    import torch
    import torch.distributed as dist

    import aoffload

    costs: dict[str, list[float]] = {}
    directory = engine.directory.parent / f"alone-{dist.get_rank()}"
    async with aoffload.CheckpointEngine(directory) as alone:
        costs["reached (one process)"] = await _reached_cost(alone.preemption(), calls, batches)
    # The engine's own store, on a connection of this benchmark's.
    store = engine._core.coordinator.rendezvous.connect()
    one = torch.zeros(1)
    others: list[tuple[str, Callable[[], object]]] = [
        ("store round trip", lambda: store.check(["aoffload/bench/none"])),
        ("gloo all_reduce of one number", lambda: dist.all_reduce(one)),
    ]
    for name, call in others:
        costs[name] = []
        for _ in range(batches):
            dist.barrier()
            started = time.perf_counter()
            for _ in range(100):
                call()
            costs[name].append((time.perf_counter() - started) / 100)
    return costs


def _start_ranks(world: int, args: dict[str, Any]) -> list[subprocess.Popen[str]]:
    import socket

    import aoffload

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    package_root = str(Path(aoffload.__file__).resolve().parents[1])
    code = "from aoffload.bench._preemption import _rank_main; _rank_main()"
    ranks = []
    for rank in range(world):
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")]),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        ranks.append(
            subprocess.Popen(
                [sys.executable, "-c", code, json.dumps(args)],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,  # a process group per rank, as torchrun does
            )
        )
    return ranks


def _line(process: subprocess.Popen[str]) -> str:
    line = process.stdout.readline() if process.stdout is not None else ""
    if not line:
        raise RuntimeError(f"a benchmark rank exited ({process.wait()}); see its stderr")
    return line


def run(
    report: Report, *, quick: bool, smoke: bool = False, size_gib: float, directory: Path | None
) -> None:
    """Measure on 2 gloo ranks of ``size_gib`` each and add the figures to ``report``."""
    world, reps, step_seconds = 2, (1 if smoke else 2 if quick else 4), (0.05 if smoke else 0.25)
    mib = max(1 if smoke else 64, int(size_gib * 1024))
    progress(f"preemption: {world} gloo ranks, {mib} MiB each, {reps} signals")
    root = Path(tempfile.mkdtemp(prefix="aoffload-bench-preemption-", dir=directory))
    rng = random.Random(0)
    args = {
        "root": str(root),
        "mib": mib,
        "reps": reps,
        "step_seconds": step_seconds,
        "calls": 1000 if smoke else _CALLS,
        "batches": 1 if smoke else _BATCHES,
    }
    ranks = _start_ranks(world, args)
    signalled: list[float] = []
    results: list[list[dict[str, Any]]] = []
    try:
        for n in range(reps):
            for process in ranks:
                if _line(process).strip() != f"ready {n}":
                    raise RuntimeError("a benchmark rank said something unexpected")
            time.sleep(rng.uniform(0.0, 2 * step_seconds))  # any moment of a step
            victim = ranks[rng.randrange(world)]
            signalled.append(time.monotonic())
            os.killpg(victim.pid, signal.SIGTERM)
            results.append([json.loads(_line(process)) for process in ranks])
        failed = [code for code in (p.wait(300) for p in ranks) if code != 0]
        if failed:
            raise RuntimeError(f"a benchmark rank failed (exit codes {failed}); see its stderr")
    finally:
        for process in ranks:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        shutil.rmtree(root, ignore_errors=True)
    _report(report, signalled, results, mib, world, step_seconds)


def _report(
    report: Report,
    signalled: list[float],
    results: list[list[dict[str, Any]]],
    mib: int,
    world: int,
    step_seconds: float,
) -> None:
    note = f"{world} ranks x {mib} MiB, steps of {step_seconds} s; SIGTERM to one rank's group"
    system = "aoffload preemption"
    steps = [len({r["step"] for r in rep}) for rep in results]
    if steps != [1] * len(results):
        raise RuntimeError(f"the ranks saved different steps: {results}")
    durable = [
        max(r["durable"] for r in rep) - t for rep, t in zip(results, signalled, strict=True)
    ]
    reached = [
        max(r["reached"] for r in rep) - t for rep, t in zip(results, signalled, strict=True)
    ]
    final = [max(r["durable"] - r["reached"] for r in rep) for rep in results]
    staged = [max(r["staged"] - r["reached"] for r in rep) for rep in results]
    first = [r["reference"][0] for rep in results for r in rep]
    reference = [r["reference"][1] for rep in results for r in rep]
    report.add(SECTION, system, "signal -> durable on every rank", "s", durable, note)
    report.add(SECTION, system, "signal -> reached() True on every rank", "s", reached, note)
    report.add(SECTION, system, "reached() -> staged (the fence)", "s", staged, note)
    report.add(SECTION, system, "reached() -> durable (stage + commit)", "s", final, note)
    report.add(SECTION, system, "one stage() + commit, no signal", "s", reference, "every rank's")
    report.add(
        SECTION,
        system,
        "an engine's first stage() + commit",
        "s",
        first,
        "staging memory allocated",
    )
    costs = [r["costs"] for rep in results for r in rep if "costs" in r]
    for name in costs[0] if costs else ():
        samples = [s * 1e6 for cost in costs for s in cost[name]]
        what = "per call, no notice" if name.startswith("reached") else "per call (instead)"
        report.add(SECTION, name, what, "us", samples, f"{len(samples)} batch means, every rank")
    if costs:
        cheap = statistics.median(s for c in costs for s in c["reached (2 ranks)"])
        progress(f"preemption: reached() without a notice, 2 ranks: {cheap * 1e6:.2f} us/call")
