"""``memory`` section: host memory of checkpointing, with and without a staging cap (#35).

Each system runs in a process of its own, the trainer (:mod:`._memory_run`), one after
the other; this process samples the PSS of the trainer and every process it started
(``/proc/PID/smaps_rollup``, :mod:`._pss`: a staging page both trainer and writer map
counts once) and finds each save's peak. The state is 4 GiB of 64 MiB fp32 tensors
(``--quick``: 1 GiB; ``--smoke``: 64 MiB, which checks that every system runs and
reports, not what it measures).

* aoffload with ``staging_bytes`` = the state / 8 (512 MiB of 4 GiB) and with the default
  cap (the whole state fits: it stages whole): per save the peak staging memory the
  engine reports, the peak PSS (absolute, and over the trainer before its state existed:
  goal, state + 640 MiB), the time from ``stage()`` to durable after no step (goal,
  capped <= 1.15x uncapped; each <= 1.1x a raw ``O_DIRECT`` write+fsync of the same bytes,
  made right after each commit, paired), and the stall after a blocking step 1.5x longer
  than the streaming (goal <= 1 ms); the last checkpoint is loaded back and compared.
  Memory comes from saves made while this process samples PSS, time from saves made
  while it pauses (a sample of a process with GiBs resident costs it most of a core);
* the same two engines in one process, one save each in turn, 10 rounds (``--smoke``: 1):
  their ratio, capped / uncapped, round by round, where the disk's drift over the minutes
  between the two runs above cannot enter it;
* 200 saves of a 256 MiB state (``--quick``: 60; ``--smoke``: 6 of 16 MiB): the PSS of the
  trainer and of its writer after save 20 and after the last (goal: growth <= 1%);
* DCP's ``async_save`` with a ``DefaultStager`` and ``torch_checkpointing``, the same
  state: their peak PSS beside aoffload's (their time to durable likewise unsampled).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from ._common import Report, Table, format_value, progress
from ._pss import PssSampler, descendants

__all__ = ["SECTION", "run"]

SECTION = "memory"
SAMPLE_SECONDS = 0.01
MIB = float(1 << 20)
GIB = 1 << 30
DCP = "DCP async_save THREAD, DefaultStager (async staging, shared memory)"
TORCH_CHECKPOINTING = "torch_checkpointing CheckpointManager"


class RanPast(RuntimeError):
    """A system's run went on past its limit: it was killed (its stacks are on stderr)."""


def _spawn(
    kind: str, root: Path, nbytes: int, options: dict[str, Any], sampler: PssSampler, limit: float
) -> dict[str, Any]:
    from . import _memory_run

    out = root / f"{kind}-{len(list(root.glob('*.json')))}.json"
    process = multiprocessing.get_context("spawn").Process(
        target=_memory_run.main,
        args=(kind, str(root / "files"), nbytes, options, str(out), sampler.quiet, sampler.resting),
    )
    process.start()
    if process.pid is not None:
        sampler.watch([process.pid])
    process.join(limit)
    if process.is_alive() and process.pid is not None:
        below = descendants(process.pid)[1:]
        os.kill(process.pid, signal.SIGUSR1)  # its stacks, to stderr (faulthandler)
        process.join(5)
        process.kill()
        process.join()
        for pid in below:  # its own workers (a peer's checkpoint process) go with it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        raise RanPast(f"{kind} ran past {limit:.0f} s (the stacks it was in are on stderr)")
    shutil.rmtree(root / "files", ignore_errors=True)
    if process.exitcode != 0:
        raise RuntimeError(f"{kind} exited with {process.exitcode}; see its stderr")
    record: dict[str, Any] = json.loads(out.read_text())
    return record


def _peaks(sampler: PssSampler, record: dict[str, Any]) -> tuple[list[float], list[float]]:
    """Each save's peak tree PSS (MiB), and the same over the trainer before its state."""
    pid = record["pid"]
    before = sampler.peak(pid, *record["idle"])
    peaks, over = [], []
    for run_ in record["runs"]:
        peak = sampler.peak(pid, run_["start"], run_["end"] + 2 * SAMPLE_SECONDS)
        if peak is not None:
            peaks.append(peak / MIB)
            if before is not None:
                over.append((peak - before) / MIB)
    return peaks, over


def run(report: Report, *, quick: bool, smoke: bool, directory: Path | None) -> None:
    """Measure every system and add the figures to ``report``."""
    nbytes = 64 << 20 if smoke else GIB if quick else 4 * GIB
    cap = nbytes // 8
    reps = 1 if smoke else 5  # aoffload's saves, each paired with a raw write
    peer_reps = 1 if smoke else 3
    saves, early, long_bytes = (6, 2, 16 << 20) if smoke else (60, 10, 256 << 20) if quick else (
        200, 20, 256 << 20
    )  # fmt: skip
    limit = 240.0 if smoke else 600.0 if quick else 3600.0
    capped = f"aoffload, staging_bytes={cap / MIB:.0f} MiB"
    uncapped = "aoffload, default staging cap"
    progress(f"memory: {nbytes / MIB:.0f} MiB state, cap {cap / MIB:.0f} MiB, {saves} saves")
    root = Path(tempfile.mkdtemp(prefix="aoffload-bench-memory-", dir=directory))
    spawn = multiprocessing.get_context("spawn")
    # --smoke measures nothing: its saves are sampled and timed at once, to keep it short
    events = (None, None) if smoke else (spawn.Event(), spawn.Event())
    sampler = PssSampler(interval=SAMPLE_SECONDS, quiet=events[0], resting=events[1])
    state = f"{nbytes / MIB:.0f} MiB state"
    try:
        with sampler:
            for system, system_cap in ((uncapped, None), (capped, cap)):
                options = {
                    "cap": system_cap,
                    "steps": [0.0, -1.0],
                    "reps": reps,
                    "sampled": 0 if smoke else peer_reps,
                }
                try:
                    record = _spawn("aoffload", root, nbytes, options, sampler, limit)
                except Exception as exc:  # noqa: BLE001 - an aoffload failure fails the run
                    report.fail(SECTION, system, exc)
                    continue
                _aoffload(report, system, record, sampler, state)
            try:
                options = {"cap": cap, "rounds": 1 if smoke else 10}
                record = _spawn("alternated", root, nbytes, options, sampler, limit)
                _alternated(report, record, uncapped, capped)
            except Exception as exc:  # noqa: BLE001 - an aoffload failure fails the run
                report.fail(SECTION, "aoffload, alternated saves", exc)
            try:
                options = {"saves": saves, "early": early}
                record = _spawn("long", root, long_bytes, options, sampler, limit * 2)
                _long(report, record, long_bytes)
            except Exception as exc:  # noqa: BLE001 - an aoffload failure fails the run
                report.fail(SECTION, "aoffload, many saves", exc)
            for kind, system in (("dcp", DCP), ("torch_checkpointing", TORCH_CHECKPOINTING)):
                options = {"reps": peer_reps, "timed": not smoke}
                hung = ""
                try:
                    try:
                        record = _spawn(kind, root, nbytes, options, sampler, limit)
                    except RanPast as exc:  # a peer's own hang, seen in torch_checkpointing
                        progress(f"memory: {system}: {exc}; running it once more")
                        hung = f"; its first run was killed: {exc}"
                        record = _spawn(kind, root, nbytes, options, sampler, limit)
                except Exception as exc:  # noqa: BLE001 - a peer that cannot run is skipped
                    report.skip(SECTION, system, f"{type(exc).__name__}: {exc}{hung}")
                    continue
                peaks, over = _peaks(sampler, record)
                note = f"{state}; {record['name']}; {record['note']}{hung}"
                report.add(SECTION, system, "peak PSS, trainer + its processes", "MiB", peaks, note)
                report.add(
                    SECTION, system, "peak PSS over the trainer before its state", "MiB", over
                )
                durable = [r["durable"] for r in record["timed"]]
                report.add(SECTION, system, "time to durable, 0 s step", "s", durable,
                           f"{note}; timed with the PSS sampling paused")  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)
    _summary(report, [uncapped, capped, DCP, TORCH_CHECKPOINTING], nbytes)
    if (c := report.find(SECTION, capped, "time to durable, 0 s step")) is not None:
        report.ratio(
            SECTION,
            "time to durable: capped / uncapped (goal <= 1.15)",
            c,
            report.find(SECTION, uncapped, "time to durable, 0 s step"),
        )


def _aoffload(
    report: Report, system: str, record: dict[str, Any], sampler: PssSampler, state: str
) -> None:
    timed = record["timed"]
    if not record["equal"]:
        report.fail(SECTION, system, "the committed checkpoint did not load equal")
    quick = [r for r in timed if r["step"] == 0.0]
    slow = [r for r in timed if r["step"] != 0.0]
    peaks, over = _peaks(sampler, record)
    note = f"{state}; the PSS of the trainer, its worker server and its writer"
    report.add(SECTION, system, "peak staging memory (CommitResult)", "MiB",
               [r["staging_peak"] / MIB for r in timed], state)  # fmt: skip
    report.add(SECTION, system, "peak PSS, trainer + its processes", "MiB", peaks, note)
    report.add(SECTION, system, "peak PSS over the trainer before its state", "MiB", over,
               f"{note}; goal: the state + 640 MiB")  # fmt: skip
    report.add(SECTION, system, "time to durable, 0 s step", "s", [r["durable"] for r in quick],
               "timed with the PSS sampling paused")  # fmt: skip
    report.add(SECTION, system, "raw O_DIRECT write+fsync, same bytes", "s",
               [r["raw"] for r in quick], "made right after each commit")  # fmt: skip
    report.add(SECTION, system, "time to durable / raw O_DIRECT (paired)", "x",
               [r["durable"] / r["raw"] for r in quick], "goal <= 1.1")  # fmt: skip
    step = record["long_step"]
    report.add(SECTION, system, "stall after a step longer than the streaming", "ms",
               [1e3 * r["stall"] for r in slow],
               f"a {step:.2f} s step, 1.5x the streaming; goal <= 1 ms")  # fmt: skip
    report.add(SECTION, system, "of which the stage() call", "ms",
               [1e3 * r["call"] for r in slow], "the rest is the fence")  # fmt: skip


def _alternated(report: Report, record: dict[str, Any], uncapped: str, capped: str) -> None:
    rounds = record["rounds"]
    system = "aoffload, alternated saves"
    note = "one process, both engines, one save each per round in turn (order alternating)"
    u = report.add(SECTION, system, f"time to durable, {uncapped}", "s",
                   [r["uncapped"] for r in rounds], note)  # fmt: skip
    c = report.add(SECTION, system, f"time to durable, {capped}", "s",
                   [r["capped"] for r in rounds], note)  # fmt: skip
    report.add(SECTION, system, "time to durable: capped / uncapped (paired)", "x",
               [r["capped"] / r["uncapped"] for r in rounds], f"{note}; goal <= 1.15")  # fmt: skip
    report.ratio(SECTION, "time to durable: capped / uncapped, alternated saves", c, u)


def _long(report: Report, record: dict[str, Any], nbytes: int) -> None:
    system = "aoffload, many saves"
    early, last = str(record["early"]), str(record["saves"])
    readings = record["readings"]
    for process in ("trainer", "writer"):
        before, after = readings[early][process], readings[last][process]
        note = f"{record['saves']} saves of {nbytes / MIB:.0f} MiB; goal: growth <= 1%"
        report.add(SECTION, system, f"{process} PSS after save {early}", "MiB", [before / MIB])
        report.add(SECTION, system, f"{process} PSS after save {last}", "MiB", [after / MIB])
        growth = 100.0 * (after - before) / before if before else 0.0
        report.add(SECTION, system, f"{process} PSS growth, save {early} to {last}", "%",
                   [growth], note)  # fmt: skip


def _summary(report: Report, systems: list[str], nbytes: int) -> None:
    def cell(system: str, metric: str, unit: str) -> str:
        figure = report.find(SECTION, system, metric)
        return "—" if figure is None else format_value(figure.value, unit)

    columns = ["system", "peak staging", "peak PSS", "over the trainer", "durable, 0 s step",
               "/ raw O_DIRECT", "stall, longer step"]  # fmt: skip
    rows = [
        [
            system,
            cell(system, "peak staging memory (CommitResult)", "MiB"),
            cell(system, "peak PSS, trainer + its processes", "MiB"),
            cell(system, "peak PSS over the trainer before its state", "MiB"),
            cell(system, "time to durable, 0 s step", "s"),
            cell(system, "time to durable / raw O_DIRECT (paired)", "x"),
            cell(system, "stall after a step longer than the streaming", "ms"),
        ]
        for system in systems
    ]
    title = f"Host memory of a {nbytes / MIB:.0f} MiB checkpoint (medians)"
    report.tables.append(Table(SECTION, title, columns, rows))
    report.notes.append(
        f"{SECTION}: the state lives in the trainer ({nbytes / MIB:.0f} MiB of the PSS); "
        f"'over the trainer' subtracts the trainer's PSS before it made its state; measured "
        f"{time.strftime('%Y-%m-%d')} on this machine"
    )
