"""Workers and their server ignore the job's signals (Ctrl-C, SIGTERM, SIGHUP, SIGQUIT,
SIGUSR1/2 to the process group) and serve until their trainer closes them; they leave quietly,
without a traceback, when the trainer dies instead."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from aoffload._runtime import forkserver
from aoffload._runtime.serve import JOB_SIGNALS

from .services.echo import Echo, Sleep
from .test_worker_faults import _wait_gone
from .test_worker_start import ROOT, echo, parent_of


async def test_a_worker_and_its_server_ignore_the_jobs_signals_and_keep_serving() -> None:
    async with echo() as bridge:
        assert bridge.pid is not None
        server = parent_of(bridge.pid)
        busy = bridge.call(Sleep(0.3))  # a call in flight when the signals arrive
        for signum in JOB_SIGNALS:
            os.kill(bridge.pid, signum)
            os.kill(server, signum)
        assert await busy is None
        assert await bridge.request(Echo("still here")) == "still here"
        assert parent_of(bridge.pid) == server
    assert bridge.exitcode == 0  # closed by its trainer, as always


_TRAINER = """
import asyncio
from aoffload._runtime.bridge import Bridge
from tests.services.echo import TARGET, Sleep

async def main():
    async with Bridge(TARGET, name="busy") as busy:
        busy.call(Sleep(1.5))  # its reply is on its way when the trainer is long gone
        print(busy.pid, flush=True)
        await asyncio.sleep(3600)

asyncio.run(main())
"""


def test_a_trainer_killed_by_its_groups_sigterm_leaves_no_worker_and_no_traceback(
    tmp_path: Path,
) -> None:
    """No notice installed: the trainer dies of SIGTERM. Its worker, busy in a call, and the
    server ignore the signal; the worker's reply then finds the trainer gone, and both leave
    without a word."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with subprocess.Popen(
        [sys.executable, "-c", _TRAINER],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as trainer:
        try:
            assert trainer.stdout is not None
            worker = int(trainer.stdout.readline())
            server = parent_of(worker)
            os.killpg(trainer.pid, signal.SIGTERM)
            _, err = trainer.communicate(timeout=60)  # stderr ends when the worker's does
            assert trainer.returncode == -signal.SIGTERM
            assert _wait_gone([worker, server], forkserver.GRACE + 30) == []
        finally:
            if trainer.poll() is None:
                os.killpg(trainer.pid, signal.SIGKILL)
    assert err == ""
