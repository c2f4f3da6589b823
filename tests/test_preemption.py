"""engine.preemption(): real signals to this process, while the loop thread is blocked in a
synchronous step; the handlers installed before are handed a second signal and restored."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest
import torch

import aoffload
from aoffload._runtime import signals

SIGNAL = signal.SIGUSR1


def _later(seconds: float, signum: int = SIGNAL) -> threading.Thread:
    """Send ``signum`` to this process from another thread after ``seconds``."""
    thread = threading.Thread(target=lambda: (time.sleep(seconds), os.kill(os.getpid(), signum)))
    thread.start()
    return thread


class Recorder:
    """A handler of the user's, installed before the engine's."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.calls.append(signum)


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    handler = Recorder()
    previous = signal.signal(SIGNAL, handler)
    try:
        yield handler
    finally:
        signal.signal(SIGNAL, previous)


def _busy(seconds: float) -> int:
    """A step that runs Python code on the loop's thread for ``seconds``."""
    end, n = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        n += 1
    return n


@pytest.mark.blocks_loop
@pytest.mark.parametrize("step_kind", ["sleep", "python", "torch"])
async def test_a_signal_during_a_blocking_step_is_noticed_before_the_step_ends(
    tmp_path: Path, recorder: Recorder, step_kind: str
) -> None:
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    async with aoffload.CheckpointEngine(tmp_path, durable=False) as engine:
        notice = engine.preemption(signals=(SIGNAL,))
        assert not notice.requested
        assert await notice.reached(0) is False
        sender = _later(0.05)
        started = time.perf_counter()
        if step_kind == "sleep":
            time.sleep(0.5)  # noqa: ASYNC251 - the synchronous step; the loop cannot turn
        elif step_kind == "python":
            _busy(0.5)
        else:
            while time.perf_counter() - started < 0.5:
                a = torch.tanh(a @ b)  # many short torch ops, back in Python between them
        sender.join()
        assert notice.requested  # before the loop turned once
        assert notice.signal == SIGNAL
        assert await notice.reached(1) is True
        assert notice.step == 1
        assert await notice.reached(2) is True
        assert recorder.calls == []  # the first signal is the notice's alone
        state = {"w": torch.ones(8)}
        await engine.save(state, "w.pt", tag="step-1")
        await engine.commit("step-1")
    assert signal.getsignal(SIGNAL) is recorder  # restored when the engine closed


async def test_without_a_signal_reached_returns_false_without_suspending(tmp_path: Path) -> None:
    async with aoffload.CheckpointEngine(tmp_path, durable=False) as engine:
        notice = engine.preemption(signals=(SIGNAL,))
        for step in range(100):
            handle = notice.reached(step)
            assert handle.done()
            with pytest.raises(StopIteration) as done:
                handle.__await__().send(None)  # it finishes in its first step: no suspension
            assert done.value.value is False
        assert notice.step is None
        assert not notice.requested


async def test_a_second_signal_goes_to_the_handler_installed_before(
    tmp_path: Path, recorder: Recorder
) -> None:
    async with aoffload.CheckpointEngine(tmp_path, durable=False) as engine:
        notice = engine.preemption(signals=(SIGNAL,))
        os.kill(os.getpid(), SIGNAL)
        assert notice.requested
        assert recorder.calls == []
        os.kill(os.getpid(), SIGNAL)  # Ctrl-C twice: the user's own handler decides
        assert recorder.calls == [SIGNAL]
        assert signal.getsignal(SIGNAL) is recorder  # and it is the handler from now on
        assert await notice.reached(5) is True
    assert signal.getsignal(SIGNAL) is recorder


async def test_two_engines_are_both_told_and_the_handler_stays_until_both_close(
    tmp_path: Path, recorder: Recorder
) -> None:
    async with aoffload.CheckpointEngine(tmp_path / "a", durable=False) as first:
        one = first.preemption(signals=(SIGNAL,))
        async with aoffload.CheckpointEngine(tmp_path / "b", durable=False) as second:
            two = second.preemption(signals=(SIGNAL,))
            assert second.preemption(signals=(SIGNAL,)) is two  # the same notice again
            with pytest.raises(aoffload.InvalidStateError, match="listens for"):
                second.preemption(signals=(signal.SIGUSR2,))
        assert signals.listeners(SIGNAL) == (one,)
        assert signal.getsignal(SIGNAL) is not recorder
        os.kill(os.getpid(), SIGNAL)
        assert one.requested
        assert not two.requested  # its engine had closed
    assert signal.getsignal(SIGNAL) is recorder
    assert recorder.calls == []


async def test_request_gives_notice_without_a_signal_and_steps_must_not_go_back(
    tmp_path: Path,
) -> None:
    async with aoffload.CheckpointEngine(tmp_path, durable=False) as engine:
        notice = engine.preemption(signals=())
        assert signals.listeners(SIGNAL) == ()
        assert await notice.reached(3) is False
        with pytest.raises(aoffload.InvalidStateError, match="must not go back"):
            await notice.reached(2)
        with pytest.raises(aoffload.InvalidStateError, match="int"):
            await notice.reached(3.5)  # type: ignore[arg-type]
        await asyncio.to_thread(notice.request)
        assert notice.signal is None
        assert await notice.reached(4) is True
    with pytest.raises(aoffload.ClosedError):
        await notice.reached(5)


async def test_preemption_off_the_main_thread_says_how_to_do_it(tmp_path: Path) -> None:
    async with aoffload.CheckpointEngine(tmp_path, durable=False) as engine:
        with pytest.raises(aoffload.InvalidStateError, match="request"):
            await asyncio.to_thread(engine.preemption, (SIGNAL,))
        with pytest.raises(aoffload.InvalidStateError, match="SIGKILL"):
            engine.preemption(signals=(signal.SIGKILL,))
        notice = await asyncio.to_thread(engine.preemption, ())
        notice.request()
        assert await notice.reached(0) is True


def test_a_forked_child_hands_the_signal_to_the_previous_disposition(tmp_path: Path) -> None:
    async def main() -> int:
        async with aoffload.CheckpointEngine(tmp_path, durable=False) as engine:
            notice = engine.preemption(signals=(SIGNAL,))
            pid = os.fork()
            if pid == 0:  # a DataLoader worker, say: the default action (terminate)
                os.kill(os.getpid(), SIGNAL)
                time.sleep(5)  # noqa: ASYNC251 - the child; never reached
                os._exit(0)
            status = await asyncio.to_thread(os.waitpid, pid, 0)
            assert not notice.requested
            return os.waitstatus_to_exitcode(status[1])

    assert signal.getsignal(SIGNAL) == signal.SIG_DFL
    assert asyncio.run(main()) == -SIGNAL
    assert signal.getsignal(SIGNAL) == signal.SIG_DFL
