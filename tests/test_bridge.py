"""The process bridge with a real spawned worker (the echo service)."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import os
import pickle
import signal
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch

import aoffload
from aoffload._runtime.bridge import Bridge
from aoffload._runtime.protocol import Call
from aoffload._runtime.resource import State
from aoffload._runtime.threads import DaemonThreadExecutor, run_in_thread

from ._leaks import Snapshot, child_pids
from ._loop_ticker import PERIOD
from .conftest import LoopBlockGuard
from .services.echo import (
    TARGET,
    Alloc,
    Echo,
    EchoConfig,
    EchoLarge,
    Exit,
    Log,
    Pid,
    Print,
    Raise,
    Sleep,
)


def echo(**kwargs: object) -> Bridge:
    return Bridge(TARGET, EchoConfig(**kwargs), name="echo", close_timeout=10.0)  # type: ignore[arg-type]


async def test_round_trips_typed_values() -> None:
    async with echo() as bridge:
        assert bridge.pid is not None
        assert await bridge.request(Pid()) == bridge.pid
        for value in (None, 1, "text", [1, 2.5, ("a", b"b")], {"k": {"nested": True}}):
            assert await bridge.request(Echo(value)) == value
        futures = [bridge.call(Echo(i)) for i in range(50)]
        assert await asyncio.gather(*futures) == list(range(50))
    assert bridge.pid is None
    assert bridge.state is State.CLOSED


async def test_replies_larger_than_the_pipe_arrive_whole() -> None:
    sizes = (0, 1, 4096, 70_000, 3 << 20, 17)
    payloads = await asyncio.to_thread(lambda: [os.urandom(size) for size in sizes])
    async with echo() as bridge:
        futures = [bridge.call(Echo(payload)) for payload in payloads]
        assert await asyncio.gather(*futures) == payloads


async def test_send_callback_gets_the_value_the_remote_error_and_the_death() -> None:
    outcomes: list[tuple[object, BaseException | None]] = []

    def record(value: object, error: BaseException | None) -> None:
        outcomes.append((value, error))

    async with echo() as bridge:
        bridge.call_with_callback(Echo("value"), record)
        bridge.call_with_callback(Raise("boom"), record)
        assert await bridge.request(Echo(None)) is None  # replies arrive in order
        assert outcomes[0] == ("value", None)
        assert isinstance(outcomes[1][1], aoffload.RemoteError)
        pid = bridge.pid
        assert pid is not None
        bridge.call_with_callback(Sleep(30), record)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(aoffload.WorkerDiedError):
            await bridge.request(Echo(None))
        assert isinstance(outcomes[2][1], aoffload.WorkerDiedError)
        assert bridge.outstanding == 0


async def test_large_requests_are_written_off_the_loop_and_keep_their_place() -> None:
    order: list[object] = []

    def record(value: object, error: BaseException | None) -> None:
        order.append(error or value)

    big = await run_in_thread(os.urandom, 8 << 20, name="test-urandom")  # off the loop
    async with echo() as bridge:
        bridge.call_with_callback(Echo(1), record)
        assert not [t for t in threading.enumerate() if t.name.endswith("-sender")]
        # Pickled by the calling thread (here not the loop's), written by the sender thread.
        await run_in_thread(bridge.call_with_callback, EchoLarge(big), record, name="test-call")
        assert [t for t in threading.enumerate() if t.name == "aoffload-echo-sender"]
        bridge.call_with_callback(Echo(2), record)  # queued behind the large one
        assert await bridge.request(Echo(3)) == 3
    assert order == [1, big, 2]


@dataclasses.dataclass(frozen=True)
class _Plain(Call[int]):
    a: int
    b: str = "b"


@dataclasses.dataclass(frozen=True)
class _Derived(_Plain):
    c: float = 1.5


def test_a_call_subclass_without_slots_keeps_every_field() -> None:
    message = _Derived(1, "x", 2.5)
    assert pickle.loads(pickle.dumps(message)) == message


class _NoFdWatchingLoop(asyncio.SelectorEventLoop):
    """A loop that cannot watch file descriptors, as the proactor loop cannot."""

    def add_reader(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError("this loop cannot watch file descriptors")

    def add_writer(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError("this loop cannot watch file descriptors")


def test_works_on_a_loop_without_add_reader(tmp_path: Path) -> None:
    async def main() -> None:
        async with echo() as bridge:
            assert await asyncio.gather(*(bridge.call(Echo(i)) for i in range(20))) == list(
                range(20)
            )
        async with aoffload.CheckpointEngine(tmp_path, durable=False) as engine:
            await engine.save({"w": torch.arange(4.0)}, "m.pt", tag="t")
            await engine.commit("t")
            assert torch.equal((await engine.load("m.pt"))["w"], torch.arange(4.0))
        param, grad = torch.zeros(8), torch.ones(8)
        async with aoffload.CPUAdam([{"lr": 0.1}], backend="torch", worker_cores=None) as opt:
            opt.submit(0, 0, param, grad)
            assert [r.step for r in await opt.drain()] == [1]
        assert param.lt(0).all()

    with asyncio.Runner(loop_factory=_NoFdWatchingLoop) as runner:
        runner.run(main())


async def test_remote_error_keeps_the_worker_serving() -> None:
    async with echo() as bridge:
        with pytest.raises(aoffload.RemoteError) as info:
            await bridge.request(Raise("boom"))
        assert info.value.remote_type == "builtins.ValueError"
        assert "boom" in str(info.value)
        assert "ValueError: boom" in info.value.remote_traceback
        assert isinstance(info.value, aoffload.WorkerError)
        assert await bridge.request(Echo("still here")) == "still here"


async def test_sigkill_mid_request_fails_pending_and_later_requests() -> None:
    async with echo() as bridge:
        pid = bridge.pid
        assert pid is not None
        pending = [bridge.call(Sleep(30)) for _ in range(3)]
        os.kill(pid, signal.SIGKILL)
        for future in pending:
            with pytest.raises(aoffload.WorkerDiedError) as info:
                await future
            assert info.value.exitcode == -signal.SIGKILL
            assert info.value.pid == pid
        with pytest.raises(aoffload.WorkerDiedError):
            await bridge.request(Echo(1))
        with pytest.raises(aoffload.WorkerDiedError):
            bridge.call(Echo(1))
        assert bridge.pid is None
    assert pid not in child_pids()


async def test_death_of_a_worker_holding_memory_is_seen_promptly() -> None:
    async with echo() as bridge:
        assert await bridge.request(Alloc(256 << 20)) == 256 << 20
        pid = bridge.pid
        assert pid is not None
        pending = bridge.call(Sleep(60))
        started = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(aoffload.WorkerDiedError):
            await pending
        # Not a speed assertion (the benchmark measures it): DeepSpeed needs ~10 s, a poll 1 s.
        assert time.perf_counter() - started < 2.0


async def test_worker_exiting_on_its_own_reports_its_exit_code() -> None:
    async with echo() as bridge:
        with pytest.raises(aoffload.WorkerDiedError) as info:
            await bridge.request(Exit(3))
        assert info.value.exitcode == 3
        assert "exited with code 3" in str(info.value)


async def test_startup_import_error_carries_the_worker_traceback() -> None:
    before = child_pids()
    with pytest.raises(aoffload.WorkerStartupError, match=r"No module named 'aoffload\._nope'"):
        async with Bridge("aoffload._nope:create", name="broken"):
            pass
    assert child_pids() == before


async def test_startup_constructor_error_carries_the_worker_traceback() -> None:
    with pytest.raises(aoffload.WorkerStartupError) as info:
        async with echo(fail_on_start=True):
            pass
    assert "configured to fail on start" in str(info.value)
    assert "Worker traceback" in str(info.value)


async def test_startup_timeout_kills_the_worker() -> None:
    before = child_pids()
    bridge = Bridge(TARGET, EchoConfig(start_delay=30), name="slow", start_timeout=0.5)
    with pytest.raises(aoffload.WorkerStartupError, match=r"did not become ready within 0\.5 s"):
        await bridge.astart()
    assert child_pids() == before
    assert bridge.state is State.CLOSED


async def test_cancelling_a_wait_abandons_only_that_wait() -> None:
    async with echo() as bridge:
        task = asyncio.create_task(bridge.request(Sleep(0.3)))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The late reply of the sleep must not be routed to the next request.
        assert await bridge.request(Echo("next")) == "next"
        assert await bridge.request(Echo("again")) == "again"
        assert bridge.outstanding == 0


async def test_asyncio_timeout_around_a_request() -> None:
    async with echo() as bridge:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.1):
                await bridge.request(Sleep(0.5))
        assert await bridge.request(Echo(42)) == 42


async def test_use_before_start_and_after_close_is_a_closed_error() -> None:
    bridge = echo()
    with pytest.raises(aoffload.ClosedError):
        bridge.call(Echo(1))
    async with bridge:
        pass
    with pytest.raises(aoffload.ClosedError):
        await bridge.request(Echo(1))
    await bridge.aclose()  # idempotent
    with pytest.raises(aoffload.ClosedError):
        await bridge.astart()


async def test_close_drains_requests_already_sent() -> None:
    bridge = echo()
    await bridge.astart()
    futures = [bridge.call(Sleep(0.02)) for _ in range(5)]
    last = bridge.call(Echo("last"))
    await bridge.aclose()
    assert [f.result() for f in futures] == [None] * 5
    assert last.result() == "last"
    assert bridge.exitcode == 0


async def test_shutdown_ladder_kills_a_stuck_worker_after_close_timeout() -> None:
    bridge = Bridge(TARGET, name="stuck", close_timeout=0.3)
    await bridge.astart()
    pid = bridge.pid
    stuck = bridge.call(Sleep(60))
    started = time.perf_counter()
    await bridge.aclose()
    assert time.perf_counter() - started < 15
    assert bridge.exitcode == -signal.SIGKILL
    assert pid not in child_pids()
    with pytest.raises(aoffload.ClosedError):
        stuck.result()


async def test_cancelled_close_still_leaves_nothing_behind() -> None:
    bridge = Bridge(TARGET, name="cancelled-close", close_timeout=5.0)
    await bridge.astart()
    pid = bridge.pid
    bridge.call(Sleep(60))
    closing = asyncio.create_task(bridge.aclose())
    await asyncio.sleep(0.05)
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert bridge.state is State.CLOSED
    for _ in range(50):  # SIGKILL was sent; the reader thread reaps the worker shortly
        if pid not in child_pids():
            break
        await asyncio.sleep(0.01)
    assert pid not in child_pids()


async def test_stray_print_in_worker_goes_to_stderr_not_the_protocol(
    capfd: pytest.CaptureFixture[str],
) -> None:
    async with echo() as bridge:
        await bridge.request(Print("stray-worker-print"))
        assert await bridge.request(Echo("intact")) == "intact"
    captured = capfd.readouterr()
    assert "stray-worker-print" not in captured.out
    assert "stray-worker-print" in captured.err


async def test_worker_log_records_reach_the_trainer_logger(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with echo() as bridge:
        await bridge.request(Log("from the worker"))
        await bridge.request(Echo(None))  # the log record was sent before this reply
    records = [r for r in caplog.records if r.name == "tests.services.echo"]
    assert records
    assert "from the worker" in records[0].getMessage()


async def test_repeated_open_close_leaks_nothing() -> None:
    async with echo() as bridge:  # warm-up: first-use imports and caches
        await bridge.request(Echo(0))
    before = Snapshot.take()
    for i in range(5):
        async with echo() as bridge:
            assert await bridge.request(Echo(i)) == i
    async with echo() as bridge:
        pid = bridge.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(aoffload.WorkerDiedError):
            await bridge.request(Sleep(10))
    leaks = Snapshot.take().leaked_since(before)
    assert not leaks, leaks


async def test_the_loop_guard_catches_a_blocked_loop(loop_block_guard: LoopBlockGuard) -> None:
    time.sleep(0.12)  # noqa: ASYNC251 - deliberately block this test step
    await asyncio.sleep(0)
    assert loop_block_guard.slow, "asyncio debug mode did not report a 120 ms blocking step"
    await asyncio.sleep(2 * PERIOD)  # the ticker's overdue tick runs, and reports it too
    assert any("woke" in message for message in loop_block_guard.slow), loop_block_guard.slow
    loop_block_guard.slow.clear()


def test_run_uses_uvloop_when_installed() -> None:
    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__

    pytest.importorskip("uvloop")
    assert aoffload.run(loop_module()).startswith("uvloop")


def test_an_idle_daemon_executor_thread_holds_nothing_of_its_last_call() -> None:
    """Its last result must not die on it later: a tensor with a hook freed by a daemon thread
    during interpreter exit aborts the process (seen at the end of a two-rank run)."""

    class Payload:
        pass

    executor = DaemonThreadExecutor("aoffload-test-idle")
    try:
        done = executor.submit(Payload)
        alive = weakref.ref(done.result(timeout=10))
        del done
        idle = inspect.getsourcelines(DaemonThreadExecutor._run)
        waiting_at = idle[1] + next(
            i for i, line in enumerate(idle[0]) if "self._work.get()" in line
        )
        deadline = time.monotonic() + 10
        while sys._current_frames()[executor.thread.ident].f_lineno != waiting_at:
            assert time.monotonic() < deadline, "the executor thread never went idle"
            time.sleep(0.001)
        assert alive() is None, "the idle thread keeps its last call's result alive"
    finally:
        executor.shutdown()
