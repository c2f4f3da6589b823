"""Faults around worker starts: a SIGKILLed trainer, a SIGKILLed worker server (under a running
worker, and under a start in flight), a start killed before its worker's pid was known."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import aoffload
from aoffload._runtime import census, forkserver, launcher
from aoffload._runtime.bridge import Bridge
from aoffload._runtime.core import WorkerCore

from ._leaks import child_pids
from .services.echo import TARGET, Echo, EchoConfig
from .test_worker_start import ROOT, echo, parent_of


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait until every process in ``pids`` has exited (or ``timeout``); those still running."""
    deadline = time.monotonic() + timeout
    try:
        fds = {os.pidfd_open(pid): pid for pid in pids if _running(pid)}
    except OSError:  # no pidfds here (an old kernel, a sandbox): look every 50 ms
        while (left := [pid for pid in pids if _running(pid)]) and time.monotonic() < deadline:
            time.sleep(0.05)
        return left
    try:
        waiting = dict(fds)
        while waiting and (remaining := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select(list(waiting), [], [], remaining)
            for fd in ready:
                waiting.pop(fd)
        return sorted(waiting.values())
    finally:
        for fd in fds:
            os.close(fd)


_TRAINER = """
import asyncio, os, sys
import torch
import aoffload
from aoffload._runtime.bridge import Bridge
from tests.services.echo import TARGET, Sleep

async def main():
    engine = aoffload.CheckpointEngine(sys.argv[1], durable=False)
    await engine.astart()
    await engine.save({"w": torch.ones(1 << 20)}, "m.pt", tag="t")
    await engine.commit("t")
    busy = Bridge(TARGET, name="busy")
    await busy.astart()
    busy.call(Sleep(600))
    print(engine.pid, busy.pid, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def test_a_sigkilled_trainer_leaves_no_worker_and_no_server(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with subprocess.Popen(
        [sys.executable, "-c", _TRAINER, str(tmp_path / "ckpt")],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    ) as trainer:
        try:
            assert trainer.stdout is not None
            idle, busy = map(int, trainer.stdout.readline().split())
            # the writer's server imports no torch, the echo worker's does: two servers
            servers = {parent_of(idle), parent_of(busy)}
            assert all(parent_of(server) == trainer.pid for server in servers)
            os.kill(trainer.pid, signal.SIGKILL)
            trainer.wait(30)
            # The idle worker sees EOF at once; the busy one is killed after the server's grace.
            assert _wait_gone([idle, busy, *servers], forkserver.GRACE + 30) == []
        finally:
            trainer.kill()
    left = [n for n in os.listdir(census.SHM_DIR) if f"-{trainer.pid}-" in n or f"-{busy}-" in n]
    assert left == []


async def test_a_killed_server_leaves_its_running_worker_serving_and_the_next_start_works() -> None:
    async with echo() as first:
        assert first.pid is not None
        server = parent_of(first.pid)
        os.kill(server, signal.SIGKILL)
        assert await asyncio.to_thread(_wait_gone, [server], 30) == []
        assert await first.request(Echo("orphan")) == "orphan"
        async with echo() as second:
            assert second.pid is not None
            assert parent_of(second.pid) not in (server, os.getpid())
            assert await second.request(Echo("fresh")) == "fresh"
    assert first.exitcode is None  # its parent was gone: the exit was seen, not its code
    assert first.pid not in child_pids()


def test_a_start_in_flight_when_its_server_dies_fails_clearly_and_the_next_works(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYTHON_AOFFLOAD_TEST_FRESH_SERVER", uuid.uuid4().hex)  # one booting
    core = WorkerCore(TARGET, EchoConfig(), name="echo", close_timeout=10.0)
    core.spawn()
    booting = launcher.servers()[-1]
    assert booting.pid is not None
    os.kill(booting.pid, signal.SIGKILL)
    with pytest.raises(aoffload.WorkerStartupError, match="before it was ready"):
        core.ready.result(60)
    core.stop()
    core.release()
    again = WorkerCore(TARGET, EchoConfig(), name="echo", close_timeout=10.0)
    again.start(120)
    try:
        assert again.request(Echo("works"), 60) == "works"
    finally:
        again.stop()
        again.release()


async def test_a_worker_killed_before_its_pid_is_known_still_dies() -> None:
    # A start that times out while its server still boots: the kill waits for the fork.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHON_AOFFLOAD_TEST_FRESH_SERVER", uuid.uuid4().hex)  # boots for seconds
        bridge = Bridge(TARGET, EchoConfig(), name="slow", start_timeout=0.05)
        with pytest.raises(aoffload.WorkerStartupError, match="did not become ready"):
            await bridge.astart()
    assert bridge.exitcode == -signal.SIGKILL
