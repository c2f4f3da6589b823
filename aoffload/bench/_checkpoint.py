"""Checkpoint section: aoffload against torch.save, torch DCP async_save and DeepSpeed's
decoupled engine, with the disk and memcpy rates as the limits."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import mmap
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ._common import Report, progress

SECTION = "checkpoint"
TENSOR_BYTES = 64 << 20
CHUNK = 64 << 20
GIB = float(1 << 30)


def make_state(size_gib: float, device: str = "cpu") -> dict[str, torch.Tensor]:
    """``size_gib`` of 64 MiB fp32 tensors on ``device``, with non-trivial contents."""
    count = max(1, round(size_gib * GIB / TENSOR_BYTES))
    generator = torch.Generator().manual_seed(0)
    return {
        f"layer{i}.weight": torch.rand(TENSOR_BYTES // 4, generator=generator).to(device)
        for i in range(count)
    }


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


@contextlib.contextmanager
def _scratch(root: Path, name: str) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# -- limits -----------------------------------------------------------------------------------


def memcpy_seconds(state: dict[str, torch.Tensor], threads: int | None = None) -> float:
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _memcpy_seconds(state)
    finally:
        torch.set_num_threads(previous)


def _memcpy_seconds(state: dict[str, torch.Tensor]) -> float:
    targets = [torch.empty_like(t, device="cpu", pin_memory=t.is_cuda) for t in state.values()]
    for dst, src in zip(targets, state.values(), strict=True):  # warm the targets
        dst.copy_(src)
    started = time.perf_counter()
    for dst, src in zip(targets, state.values(), strict=True):
        dst.copy_(src, non_blocking=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - started


def disk_seconds(root: Path, nbytes: int, *, direct: bool) -> float:
    buffer = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT requires
    buffer.write(os.urandom(4096) * (CHUNK // 4096))
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    path = root / f"raw-{'direct' if direct else 'buffered'}.bin"
    fd = os.open(path, flags, 0o644)
    try:
        started = time.perf_counter()
        written = 0
        while written < nbytes:
            written += os.write(fd, buffer)
        os.fsync(fd)
        return time.perf_counter() - started
    finally:
        os.close(fd)
        path.unlink()
        buffer.close()


def init_single_process_group() -> None:
    """A world of one (gloo), as DCP's process mode and DeepSpeed's engine need."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.update(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        CROSS_RANK="0",
        CROSS_SIZE="1",
        MASTER_ADDR="127.0.0.1",
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    dist.init_process_group("gloo", rank=0, world_size=1)


# -- the systems ------------------------------------------------------------------------------


def torch_save_stall(root: Path, state: dict[str, torch.Tensor], compute: float) -> float:
    with _scratch(root, "torch-save") as directory:
        path = directory / "model.pt"
        started = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        stall = time.perf_counter() - started
        time.sleep(compute)
        return stall


def dcp_stall(
    root: Path, state: dict[str, torch.Tensor], compute: float, kind: Any
) -> tuple[float, float]:
    """(blocking time of async_save, total trainer stall incl. waiting at the next checkpoint)."""
    from torch.distributed.checkpoint.state_dict_saver import async_save

    with _scratch(root, "dcp") as directory:
        started = time.perf_counter()
        future = async_save(state, checkpoint_id=str(directory), async_checkpointer_type=kind)
        blocked = time.perf_counter() - started
        time.sleep(compute)
        waited = time.perf_counter()
        response = future.result() if hasattr(future, "result") else None
        if response is None and hasattr(future, "upload_completion"):
            future.upload_completion.result()
        return blocked, blocked + time.perf_counter() - waited


class _DeepSpeed:
    """DeepSpeed's DecoupledCheckpointEngine (python writer), built outside a training engine."""

    def __init__(self) -> None:
        init_single_process_group()
        import deepspeed
        from deepspeed.runtime.checkpoint_engine.utils import create_checkpoint_engine
        from deepspeed.runtime.config import DeepSpeedConfig

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        if not deepspeed.comm.is_initialized():
            deepspeed.init_distributed("gloo")
        config = DeepSpeedConfig(
            {
                "train_batch_size": 1,
                "checkpoint": {
                    "writer": {"type": "python", "decoupled": True, "data_parallel": "replica"}
                },
            }
        )
        self.engine: Any = create_checkpoint_engine(
            config,
            deepspeed.utils.groups,
            zero_stage=0,
            has_moe_layers=False,
            optimize_dp_state=True,
        )

    def stall(
        self, root: Path, state: dict[str, torch.Tensor], compute: float
    ) -> tuple[float, float]:
        """(time in save(), total stall = save + commit wait after ``compute``)."""
        from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

        with _scratch(root, "deepspeed") as directory:
            info = CheckpointCommitInfo(tag="step", save_dir=str(directory), save_latest=True)
            (directory / "step").mkdir()
            started = time.perf_counter()
            self.engine.create(info)
            self.engine.save(state, str(directory / "step" / "model.pt"))
            saved = time.perf_counter() - started
            time.sleep(compute)
            waited = time.perf_counter()
            self.engine.commit(info)
            return saved, saved + time.perf_counter() - waited

    def death_detection(self, root: Path, state: dict[str, torch.Tensor]) -> float:
        from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

        with _scratch(root, "deepspeed-death") as directory:
            info = CheckpointCommitInfo(tag="step", save_dir=str(directory), save_latest=True)
            (directory / "step").mkdir()
            self.engine.create(info)
            self.engine.save(state, str(directory / "step" / "model.pt"))
            os.kill(self.engine.ckpt_process.pid, signal.SIGKILL)
            started = time.perf_counter()
            try:
                self.engine.commit(info)
            except RuntimeError:
                return time.perf_counter() - started
            raise RuntimeError("DeepSpeed's commit succeeded after its writer was killed")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.engine.cleanup()


async def _loop_lag(stop: asyncio.Event, lags: list[float]) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        started = loop.time()
        await asyncio.sleep(0.001)
        lags.append(max(0.0, loop.time() - started - 0.001))


async def _aoffload_runs(
    root: Path,
    state: dict[str, torch.Tensor],
    computes: tuple[float, ...],
    reps: int,
    report: Report,
    durable_reps: int,
) -> None:
    import aoffload

    with _scratch(root, "aoffload") as directory:
        async with aoffload.CheckpointEngine(directory, keep_last=1) as engine:
            step = 0

            async def one(compute: float) -> tuple[float, float, Any]:
                nonlocal step
                step += 1
                tag = f"step-{step}"
                started = time.perf_counter()
                await engine.save(state, "model.pt", tag=tag)
                saved = time.perf_counter() - started
                await asyncio.sleep(compute)
                waited = time.perf_counter()
                result = await engine.commit(tag)
                return saved, saved + time.perf_counter() - waited, result

            await one(0.0)  # warm-up: spawns nothing new, but fills the staging buffers
            stop, lags = asyncio.Event(), list[float]()
            ticker = asyncio.create_task(_loop_lag(stop, lags))
            runs = [await one(0.0) for _ in range(durable_reps)]
            stop.set()
            await ticker
            report.add(SECTION, "aoffload", "save() stall", "s", [r[0] for r in runs])
            report.add(SECTION, "aoffload", "time to durable", "s", [r[1] for r in runs])
            report.add(
                SECTION,
                "aoffload",
                "write rate (GiB/s)",
                "GiB/s",
                [r[2].bytes / GIB / r[2].write_seconds for r in runs if r[2].write_seconds],
            )
            lag_ms = sorted(x * 1e3 for x in lags)
            if lag_ms:

                def pct(q: float) -> float:
                    return lag_ms[min(len(lag_ms) - 1, int(q * len(lag_ms)))]

                report.add(
                    SECTION,
                    "aoffload",
                    "event-loop lag p50 while saving+committing",
                    "ms",
                    [pct(0.5)],
                )
                report.add(
                    SECTION,
                    "aoffload",
                    "event-loop lag p99 while saving+committing",
                    "ms",
                    [pct(0.99)],
                )
                report.add(
                    SECTION,
                    "aoffload",
                    "event-loop lag max while saving+committing",
                    "ms",
                    [lag_ms[-1]],
                )
            for compute in computes:
                runs = [await one(compute) for _ in range(reps)]
                report.add(
                    SECTION,
                    "aoffload",
                    f"trainer stall, {compute:g} s step",
                    "s",
                    [r[1] for r in runs],
                )
            pid = engine.pid
            if pid is not None:
                await engine.save(state, "model.pt", tag="doomed")
                commit = asyncio.ensure_future(engine.commit("doomed"))
                await asyncio.sleep(0.01)
                logging.getLogger("aoffload").setLevel(logging.CRITICAL)
                started = time.perf_counter()
                os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(aoffload.WorkerDiedError):
                    await commit
                report.add(
                    SECTION,
                    "aoffload",
                    "dead writer noticed by commit()",
                    "s",
                    [time.perf_counter() - started],
                )


def run(
    report: Report, *, quick: bool, size_gib: float, directory: Path | None, device: str = "cpu"
) -> None:
    """Measure every checkpointing system on a ``size_gib`` state dict."""
    root = Path(tempfile.mkdtemp(prefix="aoffload-bench-", dir=directory))
    try:
        _run(report, quick=quick, size_gib=size_gib, root=root, device=device)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run(report: Report, *, quick: bool, size_gib: float, root: Path, device: str) -> None:
    reps = 2 if quick else 3
    computes = (0.0, 0.5) if quick else (0.0, 0.5, 2.0)
    state = make_state(size_gib, device)
    nbytes = state_bytes(state)
    report.notes.append(
        f"checkpoint state: {len(state)} x 64 MiB fp32 = {nbytes / GIB:.2f} GiB on {device}; "
        "the 'step' between save and commit is a sleep (the trainer waiting for "
        "its accelerator), so the writer competes for no CPU"
    )

    progress("checkpoint: memcpy and raw disk rates")
    memcpy = report.add(
        SECTION,
        f"limit: memcpy (warm, {torch.get_num_threads()} threads)",
        "copy time",
        "s",
        [memcpy_seconds(state) for _ in range(reps)],
    )
    memcpy1 = report.add(
        SECTION,
        "limit: memcpy (warm, 1 thread)",
        "copy time",
        "s",
        [memcpy_seconds(state, threads=1) for _ in range(reps)],
    )
    disk_direct = report.add(
        SECTION,
        "limit: disk O_DIRECT",
        "write+fsync time",
        "s",
        [disk_seconds(root, nbytes, direct=True) for _ in range(reps)],
    )
    disk_buffered = report.add(
        SECTION,
        "limit: disk buffered",
        "write+fsync time",
        "s",
        [disk_seconds(root, nbytes, direct=False) for _ in range(reps)],
    )
    for figure, name in ((disk_direct, "O_DIRECT"), (disk_buffered, "buffered+fsync")):
        report.add(
            SECTION,
            f"limit: disk {name}",
            "rate (GiB/s)",
            "GiB/s",
            [nbytes / GIB / s for s in figure.samples],
        )

    progress("checkpoint: torch.save + fsync")
    torch_save_stall(root, state, 0.0)  # warm-up
    tsave = report.add(
        SECTION,
        "torch.save+fsync",
        "time to durable (= stall)",
        "s",
        [torch_save_stall(root, state, 0.0) for _ in range(reps)],
    )
    for compute in computes:
        report.add(
            SECTION,
            "torch.save+fsync",
            f"trainer stall, {compute:g} s step",
            "s",
            list(tsave.samples),
        )

    progress("checkpoint: aoffload")
    asyncio.run(_aoffload_runs(root, state, computes, reps, report, durable_reps=reps))

    _dcp(report, root, state, computes, reps)
    if device == "cpu":
        _deepspeed(report, root, state, computes, reps, quick=quick)
    else:
        report.skip(SECTION, "DeepSpeed decoupled", "measured with CPU state only")

    stall = report.find(SECTION, "aoffload", "save() stall")
    durable = report.find(SECTION, "aoffload", "time to durable")
    report.ratio(SECTION, f"aoffload save() stall / {memcpy.system}", stall, memcpy)
    report.ratio(SECTION, f"aoffload save() stall / {memcpy1.system}", stall, memcpy1)
    write_rate = report.find(SECTION, "aoffload", "write rate (GiB/s)")
    direct_rate = report.find(SECTION, "limit: disk O_DIRECT", "rate (GiB/s)")
    buffered_rate = report.find(SECTION, "limit: disk buffered+fsync", "rate (GiB/s)")
    report.ratio(SECTION, "aoffload write rate / disk O_DIRECT rate", write_rate, direct_rate)
    report.ratio(
        SECTION, "aoffload write rate / disk buffered+fsync rate", write_rate, buffered_rate
    )
    report.ratio(SECTION, "aoffload save() stall / torch.save+fsync", stall, tsave)
    report.ratio(SECTION, "aoffload time to durable / torch.save+fsync", durable, tsave)
    report.ratio(SECTION, "aoffload time to durable / disk O_DIRECT write", durable, disk_direct)
    report.ratio(SECTION, "aoffload time to durable / disk buffered+fsync", durable, disk_buffered)
    for system in (
        "dcp.async_save (thread)",
        "dcp.async_save (process)",
        "DeepSpeed decoupled (warm)",
        "DeepSpeed decoupled (cold)",
    ):
        report.ratio(
            SECTION,
            f"aoffload save() stall / {system} blocking",
            stall,
            report.find(SECTION, system, "blocking time"),
        )
        report.ratio(
            SECTION,
            f"aoffload time to durable / {system}",
            durable,
            report.find(SECTION, system, "trainer stall, 0 s step"),
        )
        for compute in computes:
            report.ratio(
                SECTION,
                f"trainer stall at {compute:g} s step: aoffload / {system}",
                report.find(SECTION, "aoffload", f"trainer stall, {compute:g} s step"),
                report.find(SECTION, system, f"trainer stall, {compute:g} s step"),
            )


def _dcp(
    report: Report,
    root: Path,
    state: dict[str, torch.Tensor],
    computes: tuple[float, ...],
    reps: int,
) -> None:
    try:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    except ImportError as exc:
        report.skip(SECTION, "dcp.async_save", f"torch.distributed.checkpoint unavailable: {exc}")
        return
    for kind in (AsyncCheckpointerType.THREAD, AsyncCheckpointerType.PROCESS):
        system = f"dcp.async_save ({kind.value})"
        progress(f"checkpoint: {system}")
        try:
            if kind is AsyncCheckpointerType.PROCESS:
                init_single_process_group()
            dcp_stall(root, state, 0.0, kind)  # warm-up
        except Exception as exc:  # noqa: BLE001 - an anchor that cannot run is reported
            report.skip(SECTION, system, f"{type(exc).__name__}: {exc}"[:300])
            continue
        _systems_runs(
            report, system, computes, reps, functools.partial(_dcp_call, root, state, kind)
        )


def _dcp_call(
    root: Path, state: dict[str, torch.Tensor], kind: Any, compute: float
) -> tuple[float, float]:
    return dcp_stall(root, state, compute, kind)


def _systems_runs(
    report: Report,
    system: str,
    computes: tuple[float, ...],
    reps: int,
    call: Callable[[float], tuple[float, float]],
) -> None:
    blocking: list[float] = []
    for compute in computes:
        runs = [call(compute) for _ in range(reps)]
        blocking += [r[0] for r in runs]
        report.add(SECTION, system, f"trainer stall, {compute:g} s step", "s", [r[1] for r in runs])
    report.add(SECTION, system, "blocking time", "s", blocking)


def _deepspeed(
    report: Report,
    root: Path,
    state: dict[str, torch.Tensor],
    computes: tuple[float, ...],
    reps: int,
    *,
    quick: bool,
) -> None:
    progress("checkpoint: DeepSpeed decoupled engine")
    try:
        ds = _DeepSpeed()
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
        if quick:
            report.skip(
                SECTION,
                "DeepSpeed decoupled death detection",
                "takes ~10 s (its health-check interval); run without --quick",
            )
        else:
            progress("checkpoint: DeepSpeed's dead-writer detection (~10 s)")
            seconds = ds.death_detection(root, warm)
            report.add(
                SECTION, "DeepSpeed decoupled", "dead writer noticed by commit()", "s", [seconds]
            )
    finally:
        ds.close()
