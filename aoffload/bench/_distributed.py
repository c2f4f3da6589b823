"""Distributed section: ``CheckpointEngine(distributed=True)`` against DCP ``async_save`` on gloo.

Spawns 2 ranks (4 when the machine has 8 CPUs or more) joined by torch.distributed on gloo,
each holding the same amount of state (its own tensors). Per repetition, on every rank and
the systems in turn: the trainer's stall (the save call and its fence) and the time until
the checkpoint is durable on every rank (aoffload: ``commit()`` returned, the tag
published; DCP: its upload future resolved, files fsynced by its ``FileSystemWriter``).
DCP runs at its best, ``async_save`` with a ``DefaultStager`` (THREAD, and PROCESS with
shared memory), and, as a labelled extra, without a stager (its default). Then a rank's
writer is SIGKILLed right after a ``save()``, and every other rank's time from the kill
until its ``commit()`` raised is the "failure seen" figure. Finally every tag in the
directory is checked against its manifest with xxhash directly: partial tags are counted.
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
from typing import Any

from ._common import Figure, Report, kill_ranks, progress, rank_records

SECTION = "distributed"
MANIFEST = ".aoffload-manifest.json"
SYSTEM = "aoffload distributed"
DCP = {
    "thread": "dcp.async_save + DefaultStager (thread, gloo)",
    "process": "dcp.async_save + DefaultStager (process, shared memory, gloo)",
    "plain": "dcp.async_save, no stager (thread, gloo; DCP's default, its weaker mode)",
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _partial_tags(directory: Path) -> int:
    """Tags whose files do not match their manifest, read without aoffload's code: the
    manifest's JSON, each file's size and its xxh3-64 computed here with xxhash."""
    import xxhash

    partial = 0
    for entry in os.listdir(directory):
        path = directory / entry
        if entry.startswith(".") or not path.is_dir():
            continue
        try:
            manifest = json.loads((path / MANIFEST).read_text())
            for name, file_entry in manifest["files"].items():
                data = (path / name).read_bytes()
                if len(data) != file_entry["bytes"]:
                    raise ValueError(f"{name}: {len(data)} bytes, not {file_entry['bytes']}")
                if xxhash.xxh3_64(data).hexdigest() != file_entry["xxh3_64"]:
                    raise ValueError(f"{name}: its xxh3-64 is not the manifest's")
        except (OSError, ValueError, KeyError):
            partial += 1
    return partial


def _stager(kind: str) -> tuple[Any, Any]:
    """DCP's checkpointer type and a DefaultStager with every option the CPU allows (its
    shared memory where the save runs in another process); no stager for "plain"."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    if kind == "plain":
        return AsyncCheckpointerType.THREAD, None
    process = kind == "process"
    options = StagingOptions(
        use_pinned_memory=False,
        use_shared_memory=process,
        use_async_staging=True,
        use_non_blocking_copy=False,
    )
    checkpointer = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
    return checkpointer, DefaultStager(options)


def _dcp_save(state: Any, directory: Path, kind: Any, stager: Any) -> tuple[float, float]:
    """(the trainer's stall: async_save and its staging future; time to durable)."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import async_save

    writer = FileSystemWriter(str(directory), sync_files=True)
    started = time.perf_counter()
    future: Any = async_save(
        state, storage_writer=writer, async_checkpointer_type=kind, async_stager=stager
    )
    if hasattr(future, "staging_completion"):  # with a stager: the fence, then the upload
        future.staging_completion.result()
        stalled = time.perf_counter() - started
        future.upload_completion.result()
    else:  # without one, async_save staged synchronously: its return is the stall
        stalled = time.perf_counter() - started
        future.result()
    return stalled, time.perf_counter() - started


def _rank(rank: int, world: int, port: int, root: str, mib: int, reps: int, kills: int) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import torch
    import torch.distributed as dist

    import aoffload
    from aoffload._runtime.loops import new_event_loop

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    generator = torch.Generator().manual_seed(rank)
    numel = min(mib, 64) << 18  # tensors of 64 MiB (one smaller one for a smaller state)
    count = max(1, mib // 64)
    state = {f"rank{rank}.layer{i}": torch.rand(numel, generator=generator) for i in range(count)}
    ours = Path(root) / "aoffload"
    samples: dict[str, list[float]] = {"failure seen": []}
    stagers = {kind: _stager(kind) for kind in DCP}
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
            measured = {"aoffload": (stalled, durable)}
            for kind, (checkpointer, stager) in stagers.items():
                dist.barrier()
                directory = Path(root) / f"dcp-{kind}" / f"t{rep + 1}"
                measured[kind] = _dcp_save(state, directory, checkpointer, stager)
            if rep >= 0:
                for name, (stall, done) in measured.items():
                    samples.setdefault(f"{name} stall", []).append(stall)
                    samples.setdefault(f"{name} durable", []).append(done)
    finally:
        loop.run_until_complete(engine.aclose())
        for _, stager in stagers.values():
            if stager is not None:
                stager.close()
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
    mib = 4 if smoke else 64 if quick else 256
    reps = 1 if smoke else 3 if quick else 5  # --smoke: every system saves once per rank
    kills = 1 if smoke else 3
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
        per_rank = rank_records(processes, root, "benchmark")
    finally:
        kill_ranks(processes)
        shutil.rmtree(root, ignore_errors=True)
    note = f"{world} ranks x {mib} MiB; samples of every rank"

    def add(key: str, system: str, metric: str) -> Figure:
        samples = [s for rank in per_rank for s in rank[key]]
        return report.add(SECTION, system, metric, "s", samples, note)

    stall = "trainer stall per rank (the save call and its fence after a 0 s step)"
    durable = "time to durable on every rank"
    ours = (add("aoffload stall", SYSTEM, stall), add("aoffload durable", SYSTEM, durable))
    for kind, system in DCP.items():
        theirs = (add(f"{kind} stall", system, stall), add(f"{kind} durable", system, durable))
        if kind != "plain":  # the ratios are against DCP at its best, never its weaker mode
            report.ratio(SECTION, f"stall: aoffload / {system}", ours[0], theirs[0])
            report.ratio(SECTION, f"durable: aoffload / {system}", ours[1], theirs[1])
    add("failure seen", SYSTEM, "writer killed -> others raise")
    partial = per_rank[0]["partial tags"]
    report.add(
        SECTION,
        SYSTEM,
        "partial tags published (checked with xxhash, not aoffload's verifier)",
        "count",
        partial,
        "single sample",
    )
    report.notes.append(
        "distributed: the stall is the save call plus its fence after a 0 s step (aoffload: "
        "save(), which returns once staged; DCP with DefaultStager: async_save and its staging "
        "future; DCP without a stager: async_save, which stages synchronously); durable: "
        "aoffload's commit() returned on every rank, DCP's upload future resolved "
        "(FileSystemWriter with sync_files=True); the systems save in turn each repetition"
    )
