"""Distributed section: ``CheckpointEngine(distributed=True)`` against DCP ``async_save`` on gloo.

Spawns 2 ranks (4 when the machine has 8 CPUs or more) joined by torch.distributed on gloo,
each holding the same amount of state (its own tensors). Per repetition, on every rank and
alternating the two systems: the trainer's stall in ``save()`` / ``async_save()`` and the
time until the checkpoint is durable on every rank (aoffload: ``commit()`` returned, the
tag published; DCP: the future resolved, files fsynced by its ``FileSystemWriter``). Then
a rank's writer is SIGKILLed right after a ``save()``, and every other rank's time from
the kill until its ``commit()`` raised is the "failure seen" figure. Finally every tag in
the directory is checked against its manifest: partial tags are counted.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path

from .._errors import CorruptCheckpointError
from ._common import Report, progress

SECTION = "distributed"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _partial_tags(directory: Path) -> int:
    from ..checkpoint.format import layout, read

    partial = 0
    for entry in os.listdir(directory):
        path = directory / entry
        if entry.startswith(".") or not path.is_dir():
            continue
        try:
            manifest = json.loads((path / layout.MANIFEST).read_text())
            for name, file_entry in manifest["files"].items():
                read.verify_file(path / name, file_entry)
        except (OSError, ValueError, KeyError, CorruptCheckpointError):
            partial += 1
    return partial


def _rank(rank: int, world: int, port: int, root: str, mib: int, reps: int, kills: int) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import async_save

    import aoffload
    from aoffload._runtime.loops import new_event_loop

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    generator = torch.Generator().manual_seed(rank)
    count = max(1, mib // 64)
    state = {
        f"rank{rank}.layer{i}": torch.rand(16 << 20, generator=generator) for i in range(count)
    }
    ours, theirs = Path(root) / "aoffload", Path(root) / "dcp"
    samples: dict[str, list[float]] = {
        "aoffload stall": [],
        "aoffload durable": [],
        "dcp stall": [],
        "dcp durable": [],
        "failure seen": [],
    }
    loop = new_event_loop()
    engine = aoffload.CheckpointEngine(ours, distributed=True, keep_last=2)
    loop.run_until_complete(engine.astart())
    try:
        for rep in range(-1, reps):  # rep -1: a warm-up run of each, excluded
            dist.barrier()
            started = time.perf_counter()
            loop.run_until_complete(engine.save(state, f"shard-{rank}.pt", tag=f"t{rep + 1}"))
            stalled = time.perf_counter() - started
            loop.run_until_complete(engine.commit(f"t{rep + 1}"))
            durable = time.perf_counter() - started
            dist.barrier()
            writer = FileSystemWriter(str(theirs / f"t{rep + 1}"), sync_files=True)
            started = time.perf_counter()
            future = async_save(state, storage_writer=writer)
            blocked = time.perf_counter() - started
            future.result()  # type: ignore[union-attr]  # a Future without a stager
            done = time.perf_counter() - started
            if rep >= 0:
                samples["aoffload stall"].append(stalled)
                samples["aoffload durable"].append(durable)
                samples["dcp stall"].append(blocked)
                samples["dcp durable"].append(done)
    finally:
        loop.run_until_complete(engine.aclose())
    victim = world - 1
    for kill in range(kills):
        dist.barrier()
        engine = aoffload.CheckpointEngine(ours, distributed=True, keep_last=2)
        loop.run_until_complete(engine.astart())
        try:
            tag = f"kill{kill}"
            loop.run_until_complete(engine.save(state, f"shard-{rank}.pt", tag=tag))
            stamp = [0.0]
            if rank == victim:
                stamp[0] = time.time()
                os.kill(engine.pid or 0, signal.SIGKILL)
            dist.broadcast_object_list(stamp, src=victim)
            try:
                loop.run_until_complete(engine.commit(tag))
            except aoffload.AoffloadError:
                if rank != victim:
                    samples["failure seen"].append(time.time() - stamp[0])
        finally:
            loop.run_until_complete(engine.aclose())
    dist.barrier()
    if rank == 0:
        samples["partial tags"] = [float(_partial_tags(ours))]
    (Path(root) / f"rank{rank}.json").write_text(json.dumps(samples))
    loop.close()
    dist.destroy_process_group()


def run(report: Report, *, quick: bool, smoke: bool = False) -> None:
    """Measure on 2 (or 4) spawned gloo ranks and add the figures to ``report``."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    world = 4 if (cpus or 1) >= 8 else 2
    mib = 64 if quick else 256
    reps = 2 if smoke else 3 if quick else 5  # --smoke: still 4 samples (2 per rank)
    kills = 3
    progress(f"distributed: {world} gloo ranks, {mib} MiB of state each, {reps} repetitions")
    root = Path(tempfile.mkdtemp(prefix="aoffload-bench-distributed-"))
    context = multiprocessing.get_context("spawn")
    port = _free_port()
    processes = [
        context.Process(target=_rank, args=(rank, world, port, str(root), mib, reps, kills))
        for rank in range(world)
    ]
    try:
        for process in processes:
            process.start()
        for process in processes:
            process.join(600)
        failed = [p.exitcode for p in processes if p.exitcode != 0]
        if failed:
            raise RuntimeError(f"a benchmark rank failed (exit codes {failed}); see its stderr")
        per_rank = [json.loads((root / f"rank{r}.json").read_text()) for r in range(world)]
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
        shutil.rmtree(root, ignore_errors=True)
    note = f"{world} ranks x {mib} MiB; samples of every rank"
    figures = {}
    for key, system, metric in (
        ("aoffload stall", "aoffload distributed", "save() stall per rank"),
        ("dcp stall", "dcp.async_save (gloo)", "async_save() blocking per rank"),
        ("aoffload durable", "aoffload distributed", "time to durable on every rank"),
        ("dcp durable", "dcp.async_save (gloo)", "time to durable on every rank"),
        ("failure seen", "aoffload distributed", "writer killed -> others raise"),
    ):
        samples = [s for rank in per_rank for s in rank[key]]
        figures[key] = report.add(SECTION, system, metric, "s", samples, note)
    partial = per_rank[0]["partial tags"]
    report.add(
        SECTION, "aoffload distributed", "partial tags published", "count", partial, "single sample"
    )
    report.ratio(SECTION, "stall: aoffload / DCP", figures["aoffload stall"], figures["dcp stall"])
    report.ratio(
        SECTION, "durable: aoffload / DCP", figures["aoffload durable"], figures["dcp durable"]
    )
