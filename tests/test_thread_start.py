"""#33.8: the library never makes an event loop's thread wait for a new thread to run.

``threading.Thread.start()`` returns once the new thread runs; on a busy host (every core
taken by another process) that took 57-68 ms of an engine start's or close's event loop.
The library's per-call threads (a start, a close, a load, OffloadAdam's step) are started
by :func:`start_thread` instead, which hands the start to a thread of its own.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

import aoffload
from aoffload._runtime.threads import start_thread


def test_the_caller_does_not_wait_for_the_thread_to_run(monkeypatch: pytest.MonkeyPatch) -> None:
    ran = threading.Event()
    names: list[str] = []
    start = threading.Thread.start

    def slow_start(thread: threading.Thread) -> None:  # a scheduler that makes it wait
        time.sleep(0.5)
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", slow_start)

    def target(value: int) -> None:
        names.append(f"{threading.current_thread().name} {value}")
        ran.set()

    started = time.monotonic()
    start_thread(target, 7, name="aoffload-test", failed=pytest.fail)
    assert time.monotonic() - started < 0.1  # not the 0.5 s the start takes
    assert ran.wait(30)
    assert names == ["aoffload-test 7"]


def test_a_thread_that_cannot_start_is_reported_to_the_caller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(thread: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    failures: list[BaseException] = []
    reported = threading.Event()

    def failed(exc: BaseException) -> None:
        failures.append(exc)
        reported.set()

    start_thread(pytest.fail, name="never", failed=failed)
    assert reported.wait(30)
    assert [str(f) for f in failures] == ["can't start new thread"]
    monkeypatch.undo()  # the starter itself goes on
    ran = threading.Event()
    start_thread(ran.set, name="after", failed=pytest.fail)
    assert ran.wait(30)


def test_a_forked_child_starts_threads_too() -> None:
    start_thread(lambda: None, name="parent", failed=pytest.fail)  # the parent's starter exists
    pid = os.fork()
    if pid == 0:  # the child: its own starter, made on first use
        ran = threading.Event()
        start_thread(ran.set, name="child", failed=lambda exc: None)
        os._exit(0 if ran.wait(30) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


async def test_an_engine_never_makes_the_loop_wait_for_a_thread_to_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every thread start takes 0.2 s here (a busy host's worst): the start, save, commit,
    load and close of an engine still never block the loop (the guard would fail it)."""
    start = threading.Thread.start

    def slow_start(thread: threading.Thread) -> None:
        time.sleep(0.2)
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", slow_start)
    async with aoffload.CheckpointEngine(tmp_path) as engine:
        await engine.save({"w": torch.ones(16)}, "m.pt", tag="t1")
        await engine.commit("t1")
        assert torch.equal((await engine.load("m.pt"))["w"], torch.ones(16))
