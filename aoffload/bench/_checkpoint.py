"""Checkpoint section: aoffload's stage() + fence against torch.save, DCP (async staging) and
DeepSpeed's decoupled engine, with memcpy and raw O_DIRECT disk rates as the limits.

Every system is measured at the same step lengths in one run (:mod:`._checkpoint_stall`,
:mod:`._checkpoint_systems`); a system that fails is reported as skipped with its error,
except aoffload, whose failure fails the run.
"""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ._checkpoint_stall import DURABLE, aoffload_runs
from ._checkpoint_systems import (
    DeepSpeedDecoupled,
    Timing,
    dcp_stall,
    init_single_process_group,
    torch_save_stall,
)
from ._common import Figure, Report, progress

SECTION = "checkpoint"
TENSOR_BYTES = 64 << 20
CHUNK = 64 << 20
GIB = float(1 << 30)
STAGE = "aoffload"
DCP_THREAD = "dcp.async_save + DefaultStager (thread)"
DCP_PROCESS = "dcp.async_save + DefaultStager (process, shared memory)"
DCP_PLAIN = "dcp.async_save, no stager (thread; DCP's default, its weaker mode)"


def make_state(size_gib: float, device: str = "cpu") -> dict[str, torch.Tensor]:
    """``size_gib`` of 64 MiB fp32 tensors on ``device``, with non-trivial contents (one
    smaller tensor for a state under 64 MiB, as --smoke's)."""
    nbytes = max(4096, round(size_gib * GIB))
    count = max(1, round(nbytes / TENSOR_BYTES))
    numel = min(TENSOR_BYTES, nbytes) // 4
    generator = torch.Generator().manual_seed(0)
    return {
        f"layer{i}.weight": torch.rand(numel, generator=generator).to(device) for i in range(count)
    }


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def memcpy_seconds(state: dict[str, torch.Tensor], threads: int) -> float:
    """A warm ``memmove`` of every tensor, split among ``threads`` plain threads (GIL-free)."""
    sources = [t.contiguous() for t in state.values() if not t.is_cuda]
    targets = [torch.empty_like(t) for t in sources]
    pieces = []
    for dst, src in zip(targets, sources, strict=True):
        dst.copy_(src)  # warm the targets
        nbytes = src.numel() * src.element_size()
        share = -(-nbytes // threads)
        for at in range(0, nbytes, share):
            pieces.append((dst.data_ptr() + at, src.data_ptr() + at, min(share, nbytes - at)))

    def run(mine: list[tuple[int, int, int]]) -> None:
        for dst_ptr, src_ptr, n in mine:
            ctypes.memmove(dst_ptr, src_ptr, n)

    workers = [threading.Thread(target=run, args=(pieces[i::threads],)) for i in range(threads)]
    started = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return time.perf_counter() - started


def disk_seconds(root: Path, nbytes: int) -> float:
    """Write ``nbytes`` (rounded up to 4 KiB) with O_DIRECT, then fsync: the writer's span."""
    buffer = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT requires
    buffer.write(os.urandom(4096) * (CHUNK // 4096))
    path = root / "raw-direct.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    view = memoryview(buffer)
    try:
        total = -(-nbytes // 4096) * 4096
        started = time.perf_counter()
        written = 0
        while written < total:
            written += os.write(fd, view[: min(CHUNK, total - written)])
        os.fsync(fd)
        return time.perf_counter() - started
    finally:
        view.release()
        os.close(fd)
        path.unlink()
        buffer.close()


def run(
    report: Report,
    *,
    quick: bool,
    size_gib: float,
    directory: Path | None,
    device: str = "cpu",
    smoke: bool = False,
) -> None:
    """Measure every checkpointing system on a ``size_gib`` state dict."""
    root = Path(tempfile.mkdtemp(prefix="aoffload-bench-", dir=directory))
    try:
        _run(report, quick=quick, smoke=smoke, size_gib=size_gib, root=root, device=device)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run(
    report: Report, *, quick: bool, smoke: bool, size_gib: float, root: Path, device: str
) -> None:
    reps = 1 if smoke else 3  # --smoke: every system runs once; it measures nothing
    step = 0.05 if smoke else 0.5
    computes = (0.0, step) if quick else (0.0, step, 2.0)
    state = make_state(size_gib, device)
    nbytes = state_bytes(state)
    tensor_mib = next(iter(state.values())).numel() * 4 / 2**20
    report.notes.append(
        f"checkpoint state: {len(state)} x {tensor_mib:g} MiB fp32 = {nbytes / GIB:.3g} GiB on "
        f"{device}; the 'step' is a sleep (the trainer waiting for its accelerator) except in "
        "the 'real CPU step' rows; the stall is every wait the trainer has for one checkpoint "
        "(aoffload: the stage() call plus the fence, `await staged`, after the step; DCP with "
        "DefaultStager: async_save plus its staging future; DCP without a stager: its whole "
        "save; DeepSpeed: save() plus commit()). The time to durable runs from the save call "
        "with a 0 s step until the checkpoint is durable: aoffload's commit() returned "
        "(fsynced), torch.save+fsync returned, DCP's upload future resolved (FileSystemWriter "
        "fsyncs), DeepSpeed's commit() returned (its python writer does not fsync)"
    )
    cores = len(os.sched_getaffinity(0))
    progress("checkpoint: memcpy limits")
    memcpy = {
        k: report.add(
            SECTION,
            f"limit: memcpy ({k} thread{'s' if k > 1 else ''})",
            "copy time",
            "s",
            [memcpy_seconds(state, k) for _ in range(reps)],
        )
        for k in sorted({1, 2, cores})
    }

    progress("checkpoint: aoffload stage() + fence, each commit followed by a raw write")
    raw: list[float] = []
    nfile = asyncio.run(
        aoffload_runs(
            root,
            state,
            computes,
            reps,
            report,
            cpu_step_seconds=step,
            after_commit=lambda nbytes: raw.append(disk_seconds(root, nbytes)),
        )
    )  # an aoffload failure fails the benchmark: never a skip
    disk = report.add(
        SECTION,
        "limit: disk O_DIRECT",
        f"write+fsync time of {nfile / GIB:.3f} GiB (the file aoffload wrote), after each commit",
        "s",
        raw,
    )
    direct_rate = report.add(
        SECTION, "limit: disk O_DIRECT", "write+fsync rate (GiB/s)", "GiB/s",
        [nfile / GIB / s for s in disk.samples],
    )  # fmt: skip

    progress("checkpoint: torch.save + fsync")
    torch_save_stall(root, state, 0.0)  # warm-up
    _systems_runs(
        report, "torch.save+fsync", computes, reps, lambda c: torch_save_stall(root, state, c)
    )
    _dcp(report, root, state, computes, reps, device)
    if device == "cpu":
        _deepspeed(report, root, state, computes, reps)
    else:
        report.skip(SECTION, "DeepSpeed decoupled", "measured with CPU state only")
    _ratios(report, computes, memcpy, direct_rate)


def _ratios(
    report: Report, computes: tuple[float, ...], memcpy: dict[int, Figure], direct: Figure
) -> None:
    copy = report.find(SECTION, STAGE, "copy time (0 s step: the fence waits for all of it)")
    stall0 = report.find(SECTION, STAGE, "trainer stall, 0 s step")
    for figure in memcpy.values():
        report.ratio(SECTION, f"aoffload copy time / {figure.system}", copy, figure)
        report.ratio(SECTION, f"aoffload stall at a 0 s step / {figure.system}", stall0, figure)
    write = report.find(SECTION, STAGE, "write+fsync rate (GiB/s)")
    report.ratio(
        SECTION, "aoffload write+fsync rate / raw O_DIRECT write+fsync rate", write, direct
    )
    for system in (
        "torch.save+fsync",
        DCP_THREAD,
        DCP_PROCESS,
        "DeepSpeed decoupled (cold)",
        "DeepSpeed decoupled (warm)",
    ):
        for compute in computes:
            metric = f"trainer stall, {compute:g} s step"
            report.ratio(
                SECTION,
                f"stall at a {compute:g} s step: aoffload / {system}",
                report.find(SECTION, STAGE, metric),
                report.find(SECTION, system, metric),
            )
        report.ratio(
            SECTION,
            f"time to durable: aoffload / {system}",
            report.find(SECTION, STAGE, DURABLE),
            report.find(SECTION, system, DURABLE),
        )


def _systems_runs(
    report: Report,
    system: str,
    computes: tuple[float, ...],
    reps: int,
    call: Callable[[float], Timing],
) -> None:
    blocking: list[float] = []
    for compute in computes:
        runs = [call(compute) for _ in range(reps)]
        blocking += [r.blocking for r in runs]
        report.add(
            SECTION, system, f"trainer stall, {compute:g} s step", "s", [r.stall for r in runs]
        )
        if compute == 0.0:
            report.add(SECTION, system, DURABLE, "s", [r.durable for r in runs])
    report.add(SECTION, system, "blocking time", "s", blocking)


def _dcp(
    report: Report,
    root: Path,
    state: dict[str, torch.Tensor],
    computes: tuple[float, ...],
    reps: int,
    device: str,
) -> None:
    """DCP with DefaultStager, its strongest documented mode, in THREAD and PROCESS modes
    (every staging option the device allows); then without a stager (its default)."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    except ImportError as exc:
        report.skip(SECTION, "dcp.async_save", f"torch.distributed.checkpoint unavailable: {exc}")
        return
    cuda = device == "cuda"

    def stager(shared: bool) -> Any:
        return DefaultStager(
            StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=shared,
                use_async_staging=True,
                use_non_blocking_copy=cuda,
            )
        )

    variants: list[tuple[str, Any, Callable[[], Any]]] = [
        (DCP_THREAD, AsyncCheckpointerType.THREAD, lambda: stager(False)),
        (DCP_PROCESS, AsyncCheckpointerType.PROCESS, lambda: stager(True)),
        (DCP_PLAIN, AsyncCheckpointerType.THREAD, lambda: None),
    ]
    for system, kind, make_stager in variants:
        progress(f"checkpoint: {system}")
        try:
            init_single_process_group()
            made = make_stager()
            dcp_stall(root, state, 0.0, kind, made)  # warm-up (PROCESS: starts its process)
        except Exception as exc:  # noqa: BLE001 - an anchor that cannot run is reported
            report.skip(SECTION, system, f"{type(exc).__name__}: {exc}"[:300])
            continue

        def call(compute: float, kind: Any = kind, made: Any = made) -> Timing:
            return dcp_stall(root, state, compute, kind, made)

        try:
            _systems_runs(report, system, computes, reps, call)
        finally:
            if made is not None:
                made.close()


def _deepspeed(
    report: Report,
    root: Path,
    state: dict[str, torch.Tensor],
    computes: tuple[float, ...],
    reps: int,
) -> None:
    progress("checkpoint: DeepSpeed decoupled engine")
    try:
        ds = DeepSpeedDecoupled()
    except Exception as exc:  # noqa: BLE001 - an anchor that cannot run is reported
        report.skip(SECTION, "DeepSpeed decoupled", f"{type(exc).__name__}: {exc}"[:300])
        return
    try:
        # Cold: fresh tensors each time; DeepSpeed moves their storage into shared memory.
        def fresh() -> dict[str, torch.Tensor]:
            return {k: v.clone() for k, v in state.items()}

        ds.stall(root, fresh(), 0.0)  # warm-up
        _systems_runs(
            report,
            "DeepSpeed decoupled (cold)",
            computes,
            reps,
            lambda c: ds.stall(root, fresh(), c),
        )
        # Warm: the same tensors again; their storage is shared already, so save() copies
        # nothing, and the writer reads the live tensors (a torn checkpoint if they change).
        warm = fresh()
        ds.stall(root, warm, 0.0)
        _systems_runs(
            report, "DeepSpeed decoupled (warm)", computes, reps, lambda c: ds.stall(root, warm, c)
        )
    finally:
        ds.close()
