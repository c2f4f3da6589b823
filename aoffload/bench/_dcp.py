"""``dcp`` section: checkpointing a sharded state on 2 gloo ranks, DCP and its peers.

Each of the 2 ranks holds ``size_gib / 2`` of CPU state (its shard, in 64 MiB tensors
or smaller), and every system saves it, in turn, a block of saves each (a warm-up save,
excluded, then the measured ones):

* DCP's plain ``dcp.save`` with its ``FileSystemWriter`` (blocking);
* ``dcp.async_save`` in THREAD and in PROCESS mode, with no stager (DCP's default: the copy
  runs in the call) and with a ``DefaultStager`` in every mode the CPU allows (async
  staging, with and without shared memory; pinned memory and non-blocking copies need
  CUDA), always with ``FileSystemWriter``;
* ``torch_checkpointing``'s ``CheckpointManager`` (its async saver; O_DIRECT first, and
  buffered writes where its O_DIRECT fails, as the label then says);
* aoffload's DCP route: ``dcp.async_save`` with ``aoffload.dcp``'s ``Stager`` and
  ``StorageWriter`` (through a distributed ``CheckpointEngine``), in THREAD and PROCESS
  modes, and the engine's face for it, ``engine.dcp.async_save``, also through an engine
  whose staging cap is a quarter of the state (it streams through the cap in waves);
* aoffload's ``CheckpointEngine`` on its own format, as a reference;
* the disk's floor: each rank's bytes written raw with ``O_DIRECT`` and fsynced, every rank
  at once (no system is durable sooner), with each system's time to durable over it.

Per save, on every rank: the **call**; the **stall after a blocking step** of 0, 0.5 and
2 s (the call plus the wait at the system's fence after the step; the step is
``time.sleep`` on the trainer's thread, which blocks the caller as waiting for an
accelerator does); the **time to durable** from the call (every file and the directory
entries that publish it fsynced: where a system does not fsync, the bench does, inside the
timed span, and the figure's note says so); the **peak host memory** while the save runs:
the PSS of the rank and every process it started (``/proc/PID/smaps_rollup``, sampled by
the bench's own process, :mod:`._pss`), absolute and over the rank alone before any
system ran. A PSS sample of a process with GiBs resident costs it most of a core, so the
times come from saves made while the sampling is paused, and the memory from 3 more
saves per system (after a 0 s step) made while it runs. The PROCESS-mode blocks run
last: DCP's checkpoint process, once started, lives as long as the rank and would count in
every later block's memory.
"""

from __future__ import annotations

import multiprocessing
import shutil
import socket
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from ._common import Report, Table, format_value, kill_ranks, progress, rank_records
from ._pss import PssSampler

__all__ = ["SECTION", "run"]

SECTION = "dcp"
WORLD = 2
STEPS = (0.0, 0.5, 2.0)
SMOKE_STEPS = (0.0, 0.05, 0.2)
"""--smoke's steps: the same three cases (none, longer than the copy, much longer)."""
SAMPLE_SECONDS = 0.01
DISK = "the disk: each rank's bytes written raw (O_DIRECT, fsync), every rank at once"
DISK_NOTE = "the floor of any system's time to durable on this disk; one file per rank"
MIB = float(1 << 20)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run(
    report: Report, *, quick: bool, smoke: bool, size_gib: float, directory: Path | None
) -> None:
    """Measure every system on 2 spawned gloo ranks and add the figures to ``report``."""
    per_rank = max(1 << 20, int(size_gib * (1 << 30)) // WORLD)
    steps = SMOKE_STEPS if smoke else STEPS
    reps = 1 if smoke else 3 if quick else 5
    progress(
        f"dcp: {WORLD} gloo ranks, {per_rank / MIB:.0f} MiB of state each, steps {steps} s, "
        f"{reps} repetition(s)"
    )
    root = Path(tempfile.mkdtemp(prefix="aoffload-bench-dcp-", dir=directory))
    from . import _dcp_rank

    context = multiprocessing.get_context("spawn")
    port = _free_port()
    # --smoke measures nothing: its saves are sampled and timed at once, to keep it short
    events = (None, None) if smoke else (context.Event(), context.Event())
    sampler = PssSampler(interval=SAMPLE_SECONDS, quiet=events[0], resting=events[1])
    processes = [
        context.Process(
            target=_dcp_rank.main,
            args=(
                rank,
                WORLD,
                port,
                str(root),
                per_rank,
                steps,
                reps,
                sampler.quiet,
                sampler.resting,
            ),
        )
        for rank in range(WORLD)
    ]
    try:
        with sampler:
            for process in processes:
                process.start()
            sampler.watch(p.pid for p in processes if p.pid is not None)
            deadline = time.monotonic() + (600 if quick else 3600)
            for process in processes:
                process.join(max(1.0, deadline - time.monotonic()))
        records = rank_records(processes, root, "dcp")
    finally:
        kill_ranks(processes)
        shutil.rmtree(root, ignore_errors=True)
    _report(report, records, sampler, steps, per_rank)


def _report(
    report: Report,
    records: list[dict[str, Any]],
    sampler: PssSampler,
    steps: tuple[float, ...],
    per_rank: int,
) -> None:
    first = records[0]
    for name, reason in first["skipped"].items():
        report.skip(SECTION, name, reason)
    for name, reason in first["failed"].items():
        report.fail(SECTION, name, reason)
    samples: dict[tuple[str, str], list[float]] = defaultdict(list)
    for record in records:
        pid = record["pid"]
        alone = sampler.peak(pid, *record["idle"])
        for run_ in record["runs"]:
            name, step = run_["system"], run_["step"]
            samples[name, "call"].append(run_["call"])
            samples[name, f"stall after a {step:g} s step"].append(run_["stall"])
            samples[name, f"time to durable, {step:g} s step"].append(run_["durable"])
        for run_ in record["sampled"]:
            name = run_["system"]
            end = run_["end"] + 2 * SAMPLE_SECONDS
            peak = sampler.peak(pid, run_["start"], end)
            if peak is not None:
                samples[name, "peak PSS, rank + its processes"].append(peak / MIB)
                if alone is not None:
                    samples[name, "peak PSS over the rank alone"].append((peak - alone) / MIB)
        samples[DISK, f"time to durable, {steps[0]:g} s step"] += record.get("raw", [])
    share = f"{WORLD} ranks x {per_rank / MIB:.0f} MiB; samples of every rank"
    metrics = [
        "call",
        *(f"stall after a {t:g} s step" for t in steps),
        *(f"time to durable, {t:g} s step" for t in steps),
        "peak PSS, rank + its processes",
        "peak PSS over the rank alone",
    ]
    systems = list(dict.fromkeys(name for name, _ in samples))
    for name in systems:
        for metric in metrics:
            if values := samples.get((name, metric)):
                unit = "MiB" if "PSS" in metric else "s"
                note = share if unit == "MiB" else f"{share}; {first['notes'].get(name, DISK_NOTE)}"
                report.add(SECTION, name, metric, unit, values, note)
    _summary(report, systems, steps)


def _summary(report: Report, systems: list[str], steps: tuple[float, ...]) -> None:
    def cell(system: str, metric: str, unit: str) -> str:
        figure = report.find(SECTION, system, metric)
        return "—" if figure is None else format_value(figure.value, unit)

    columns = [
        "system",
        "call",
        *(f"stall, {t:g} s step" for t in steps),
        f"durable, {steps[0]:g} s step",
        "peak PSS",
        "over the rank alone",
    ]
    rows = [
        [
            system,
            cell(system, "call", "s"),
            *(cell(system, f"stall after a {t:g} s step", "s") for t in steps),
            cell(system, f"time to durable, {steps[0]:g} s step", "s"),
            cell(system, "peak PSS, rank + its processes", "MiB"),
            cell(system, "peak PSS over the rank alone", "MiB"),
        ]
        for system in systems
    ]
    report.tables.append(Table(SECTION, "DCP and its peers, per rank (medians)", columns, rows))
    stagers = [s for s in systems if "DefaultStager" in s]
    ours = [s for s in systems if s.startswith("aoffload")]
    durable = f"time to durable, {steps[0]:g} s step"
    disk = report.find(SECTION, DISK, durable)
    for system in [*stagers, *ours] if disk is not None else ():
        report.ratio(
            SECTION, f"{durable}: {system} / {DISK}", report.find(SECTION, system, durable), disk
        )
    for metric in (
        f"stall after a {steps[-1]:g} s step",
        f"time to durable, {steps[0]:g} s step",
        "peak PSS, rank + its processes",
    ):
        candidates = [report.find(SECTION, s, metric) for s in stagers]
        found = [f for f in candidates if f is not None]
        if not found:
            continue
        best = min(found, key=lambda f: f.value)
        for system in ours:
            report.ratio(
                SECTION,
                f"{metric}: {system} / best DefaultStager ({best.system})",
                report.find(SECTION, system, metric),
                best,
            )
