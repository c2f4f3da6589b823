"""Bridge section: tiny-request round trips, worker-death detection and worker starts."""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from .._errors import WorkerDiedError
from .._runtime.bridge import Bridge
from . import _starts
from ._common import Report, progress
from ._echo import TARGET, Alloc, Echo, Sleep

SECTION = "bridge"


def _plain_echo(conn: Connection) -> None:
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if isinstance(message, float):
            time.sleep(message)  # a request that takes this long in the worker
        conn.send(message)


def _blocking_pipe_round_trip(requests: int, reps: int) -> list[float]:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_plain_echo, args=(child,), daemon=True)
    process.start()
    child.close()
    try:
        parent.send(0)
        parent.recv()
        samples = []
        for _ in range(reps):
            started = time.perf_counter()
            for i in range(requests):
                parent.send(i)
                parent.recv()
            samples.append((time.perf_counter() - started) / requests * 1e3)
        return samples
    finally:
        parent.close()
        process.join(10)


async def _thread_bridged_pipe_round_trip(requests: int, reps: int) -> list[float]:
    """A pipe whose every recv() goes through run_in_executor: the floor for thread bridging."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_plain_echo, args=(child,), daemon=True)
    loop = asyncio.get_running_loop()
    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        await loop.run_in_executor(executor, process.start)
        child.close()
        try:
            parent.send(0)
            await loop.run_in_executor(executor, parent.recv)
            samples = []
            for _ in range(reps):
                started = time.perf_counter()
                for i in range(requests):
                    parent.send(i)
                    await loop.run_in_executor(executor, parent.recv)
                samples.append((time.perf_counter() - started) / requests * 1e3)
            return samples
        finally:
            parent.close()
            await loop.run_in_executor(executor, process.join, 10)


_BURST, _WORK = 16, 0.0007  # 16 pipelined requests of 0.7 ms each: an optimizer pipeline


async def _thread_reader_burst(reps: int) -> list[float]:
    """The design the bridge replaced: a reader thread blocked in recv() hands each reply
    to the loop with call_soon_threadsafe. Returns trainer CPU per reply (ms)."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_plain_echo, args=(child,), daemon=True)
    loop = asyncio.get_running_loop()
    waiting: list[asyncio.Future[object]] = []

    def deliver(message: object) -> None:
        waiting.pop(0).set_result(message)

    def read() -> None:
        while True:
            try:
                message = parent.recv()
            except (EOFError, OSError):
                return
            loop.call_soon_threadsafe(deliver, message)

    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        await loop.run_in_executor(executor, process.start)
        child.close()
        reader = loop.run_in_executor(executor, read)
        try:
            samples = []
            for rep in range(reps + 1):
                started = time.process_time()
                futures = [loop.create_future() for _ in range(_BURST)]
                waiting.extend(futures)
                for _ in range(_BURST):
                    parent.send(_WORK)
                await asyncio.gather(*futures)
                if rep:
                    samples.append((time.process_time() - started) / _BURST * 1e3)
            return samples
        finally:
            # The reader is blocked in recv(): end the worker so that recv() sees EOF.
            process.terminate()
            await loop.run_in_executor(None, process.join, 10)
            await reader
            parent.close()


async def _bridge_burst(reps: int) -> list[float]:
    """Trainer CPU per reply (ms) for the same burst through the bridge."""
    async with Bridge(TARGET, name="bench-echo") as bridge:
        samples = []
        for rep in range(reps + 1):
            started = time.process_time()
            await asyncio.gather(*(bridge.call(Sleep(_WORK)) for _ in range(_BURST)))
            if rep:
                samples.append((time.process_time() - started) / _BURST * 1e3)
        return samples


async def _bridge_round_trip(requests: int, reps: int) -> list[float]:
    async with Bridge(TARGET, name="bench-echo") as bridge:
        await bridge.request(Echo(0))
        samples = []
        for _ in range(reps):
            started = time.perf_counter()
            for i in range(requests):
                await bridge.request(Echo(i))
            samples.append((time.perf_counter() - started) / requests * 1e3)
        return samples


async def _death_detection(hold_bytes: int, reps: int) -> list[float]:
    samples = []
    for _ in range(reps):
        async with Bridge(TARGET, name="bench-victim") as bridge:
            await bridge.request(Alloc(hold_bytes))
            pending = bridge.call(Sleep(60))
            pid = bridge.pid
            if pid is None:
                raise RuntimeError("the benchmark worker is not running")
            started = time.perf_counter()
            os.kill(pid, signal.SIGKILL)
            try:
                await pending
            except WorkerDiedError:
                samples.append((time.perf_counter() - started) * 1e3)
            else:
                raise RuntimeError("a request to a SIGKILLed worker returned instead of failing")
    return samples


def _loops() -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    loops: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {"asyncio": asyncio.new_event_loop}
    try:
        import uvloop

        loops["uvloop"] = uvloop.new_event_loop
    except ImportError:
        pass
    return loops


def run(report: Report, *, quick: bool, smoke: bool = False) -> None:
    """Measure the bridge's round trip against plain pipes, death detection and starts."""
    requests, reps = (20, 1) if smoke else (500, 3) if quick else (2000, 7)
    progress(f"bridge: blocking pipe round trip ({reps} x {requests})")
    baseline = report.add(
        SECTION,
        "plain blocking pipe",
        "round trip",
        "ms",
        _blocking_pipe_round_trip(requests, reps),
    )
    loops = _loops()
    if "uvloop" not in loops:
        report.skip(SECTION, "aoffload bridge on uvloop", "uvloop is not installed")
    for name, factory in loops.items():
        progress(f"bridge: round trips on {name}")
        with asyncio.Runner(loop_factory=factory) as runner:
            pipe = runner.run(_thread_bridged_pipe_round_trip(requests, reps))
            floor = report.add(SECTION, f"run_in_executor pipe ({name})", "round trip", "ms", pipe)
            bridged = runner.run(_bridge_round_trip(requests, reps))
            ours = report.add(SECTION, f"aoffload bridge ({name})", "round trip", "ms", bridged)
        report.ratio(SECTION, f"aoffload bridge ({name}) / plain blocking pipe", ours, baseline)
        report.ratio(SECTION, f"aoffload bridge ({name}) / run_in_executor pipe", ours, floor)
        progress(f"bridge: trainer CPU per reply on {name}")
        burst = f"trainer CPU per reply ({_BURST} pipelined {_WORK * 1e3:.1f} ms requests)"
        bursts = 1 if smoke else 10 if quick else 50
        with asyncio.Runner(loop_factory=factory) as runner:
            thread = report.add(
                SECTION,
                f"reader thread + call_soon_threadsafe ({name})",
                burst,
                "ms",
                runner.run(_thread_reader_burst(bursts)),
            )
            ours = report.add(
                SECTION, f"aoffload bridge ({name})", burst, "ms", runner.run(_bridge_burst(bursts))
            )
        report.ratio(
            SECTION, f"CPU per reply: aoffload bridge / reader thread ({name})", ours, thread
        )
    hold, kills = (1 << 20, 1) if smoke else (256 << 20, 3) if quick else (2 << 30, 10)
    progress(f"bridge: death detection, worker holding {hold >> 20} MiB, {kills} kills")
    report.add(
        SECTION,
        "aoffload bridge",
        f"death detected after SIGKILL ({hold >> 20} MiB held)",
        "ms",
        asyncio.run(_death_detection(hold, kills)),
    )
    _starts.run(report, quick=quick, smoke=smoke)
