"""Background section: the work of a checkpoint progresses while the event loop is blocked.

Every step here blocks the loop's thread, as a real training step does (``time.sleep``: the
trainer waiting for its accelerator; or matrix products on the loop thread):

* the fence (``await staged``) after a step longer than the copy, at the state size;
* a real CPU step on one core, which leaves the other cores free: the stall against the
  copy time of the same run;
* ``commit_soon()`` then a blocked loop: when ``latest`` names the tag on disk (a thread of
  this benchmark watches the file), against the copy + write time of that commit;
* ``save()`` + ``commit()`` of 4 MiB on a quiet host and with three CPU-bound processes
  (a data loader's workers), against the same with ``torch.save`` + fsync.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ._checkpoint import make_state
from ._checkpoint_systems import torch_save_stall
from ._common import Report, progress

__all__ = ["run"]

SECTION = "background"
SYSTEM = "aoffload"
SMALL = {f"w{i}": torch.full((256, 1024), float(i)) for i in range(4)}  # 4 MiB


def _block(seconds: float) -> None:
    """A synchronous step: the loop's thread is busy, the loop never turns."""
    time.sleep(seconds)


def _matmul_step(seconds: float, threads: int) -> Any:
    """Matrix products on the calling thread with ``threads`` torch threads, ~``seconds``."""
    a, b = torch.rand(1024, 1024), torch.rand(1024, 1024)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        started = time.perf_counter()
        torch.mm(a, b)
        iters = max(1, round(seconds / max(time.perf_counter() - started, 1e-4)))
    finally:
        torch.set_num_threads(previous)

    def step() -> None:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            for _ in range(iters):
                torch.mm(a, b)
        finally:
            torch.set_num_threads(before)

    return step


class _Watch:
    """A thread that notes when ``directory/latest`` first names ``tag``."""

    def __init__(self, directory: Path, tag: str) -> None:
        self.seen: float | None = None
        self._path, self._tag = directory / "latest", f"{tag}\n"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError):
                if self._path.read_text() == self._tag:
                    self.seen = time.perf_counter()
                    return
            self._stop.wait(0.0005)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@contextlib.contextmanager
def _hogs(count: int, settle: float) -> Iterator[None]:
    """``count`` CPU-bound processes (a data loader's workers) for the duration."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(settle if count else 0.0)  # let them take the cores
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


async def _measure(
    report: Report, root: Path, size_gib: float, reps: int, margin: float, smoke: bool
) -> None:
    import aoffload

    state = make_state(size_gib)
    async with aoffload.CheckpointEngine(root / "big", keep_last=1) as engine:
        step = 0

        def tag() -> str:
            nonlocal step
            step += 1
            return f"step-{step}"

        warm = tag()
        await engine.save(state, "model.pt", tag=warm)  # fills the staging slot once
        first = await engine.commit(warm)
        copy = max(first.stage_seconds, 0.05)

        progress("background: the fence after a step that blocks the loop longer than the copy")
        fences: list[float] = []
        for _ in range(reps):
            name = tag()
            staged = engine.stage(state, "model.pt", tag=name)
            _block(2 * copy + 0.2)
            started = time.perf_counter()
            await staged
            fences.append(time.perf_counter() - started)
            await engine.commit(name)
        report.add(
            SECTION, SYSTEM, f"fence after a blocked step longer than the copy ({size_gib:g} GiB)",
            "s", fences,
        )  # fmt: skip

        progress("background: a real CPU step on one core (one core left free)")
        work = _matmul_step(0.05 if smoke else max(0.5, 3 * copy), threads=1)
        stalls, copies = [], []
        for _ in range(reps):
            name = tag()
            started = time.perf_counter()
            staged = engine.stage(state, "model.pt", tag=name)
            call = time.perf_counter() - started
            work()
            started = time.perf_counter()
            await staged
            stalls.append(call + time.perf_counter() - started)
            copies.append((await engine.commit(name)).stage_seconds)
        stall = report.add(
            SECTION, SYSTEM, "stall (stage() + fence) after a 1-thread CPU step", "s", stalls
        )
        copied = report.add(
            SECTION, SYSTEM, "copy time during that step (on aoffload's threads)", "s", copies
        )
        report.ratio(SECTION, "1-thread CPU step: stall / copy time", stall, copied)

        progress("background: commit_soon() then a blocked loop; when `latest` is on disk")
        until_latest, copy_write = [], []
        for _ in range(reps):
            name = tag()
            watch = _Watch(engine.directory, name)
            started = time.perf_counter()
            staged = engine.stage(state, "model.pt", tag=name)
            engine.commit_soon(name)  # no fence awaited: the commit waits for the copy itself
            _block(10 * copy + margin)
            watch.stop()
            result = await engine.commit(name)
            if watch.seen is None:
                raise RuntimeError(f"`latest` did not name {name} while the loop was blocked")
            await staged
            until_latest.append(watch.seen - started)
            copy_write.append(result.stage_seconds + result.write_seconds)
        latest = report.add(
            SECTION, SYSTEM, "stage() + commit_soon() to `latest` on disk, loop blocked", "s",
            until_latest,
        )  # fmt: skip
        spent = report.add(
            SECTION, SYSTEM, "copy + write+fsync time of those commits", "s", copy_write
        )
        report.ratio(SECTION, "time to `latest` (loop blocked) / (copy + write)", latest, spent)


async def _small(engine: Any, tag: str) -> float:
    started = time.perf_counter()
    await engine.save(SMALL, "model.pt", tag=tag)
    await engine.commit(tag)
    return time.perf_counter() - started


async def _loaded(report: Report, root: Path, reps: int, settle: float) -> None:
    import aoffload

    async with aoffload.CheckpointEngine(root / "small", keep_last=1) as engine:
        await _small(engine, "warm")
        for label, hogs in (("quiet host", 0), ("3 CPU-bound processes", 3)):
            progress(f"background: save() + commit() of 4 MiB, {label}")
            with _hogs(hogs, settle):
                ours = [await _small(engine, f"{hogs}-{i}") for i in range(reps)]
                plain = [torch_save_stall(root, SMALL, 0.0)[0] for _ in range(reps)]
            report.add(SECTION, SYSTEM, f"save() + commit() of 4 MiB, {label}", "s", ours)
            report.add(SECTION, "torch.save+fsync", f"4 MiB, {label}", "s", plain)
    for system, metric in ((SYSTEM, "save() + commit() of 4 MiB"), ("torch.save+fsync", "4 MiB")):
        report.ratio(
            SECTION,
            f"{system}: 3 CPU hogs / quiet",
            report.find(SECTION, system, f"{metric}, 3 CPU-bound processes"),
            report.find(SECTION, system, f"{metric}, quiet host"),
        )


def run(
    report: Report, *, quick: bool, smoke: bool = False, size_gib: float, directory: Path | None
) -> None:
    """Measure what progresses while the loop is blocked, and under a loaded host."""
    root = Path(tempfile.mkdtemp(prefix="aoffload-bench-", dir=directory))
    reps = 1 if smoke else 3 if quick else 5  # --smoke: every measurement runs once
    report.notes.append(
        f"background: {size_gib:g} GiB of fp32 tensors (64 MiB each, or one smaller); every "
        "step blocks the loop's "
        f"thread (time.sleep or matrix products on it); {os.cpu_count()} CPUs"
    )
    try:
        asyncio.run(_measure(report, root, size_gib, reps, 1.0 if smoke else 2.0, smoke))
        asyncio.run(
            _loaded(report, root, 1 if smoke else 5 if quick else 10, 0.1 if smoke else 0.5)
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
