"""No silent builds of DeepSpeed's CPU Adam op: ``backend="auto"`` never builds (the torch
backend, said once), ``backend="deepspeed"`` builds and says so, a start that times out
during a build (or while waiting for one) says so, and a build lock left by a killed build is
cleared instead of waited for forever. Each test works in a TORCH_EXTENSIONS_DIR of its own;
only one starts a real build, and stops it after seconds."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import aoffload
from aoffload import CPUAdam
from aoffload.optimizer.worker._build_lock import clear_stale_lock, holders

from ._op_build import built_op, copy_of_build

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: nothing to build")
pytestmark = pytest.mark.deepspeed

_HOLD = """
import os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL)
print("held", flush=True)
time.sleep(600)
"""


@pytest.fixture(scope="module")
def built() -> str:
    """The build directory of DeepSpeed's op here, built if it was not."""
    return built_op()


@pytest.fixture
def build_copy(built: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stamp-less copy of the build, which this test's workers use."""
    return copy_of_build(built, tmp_path, monkeypatch)


@pytest.fixture
def empty_extensions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A TORCH_EXTENSIONS_DIR with no build in it; whatever still works in it at the end (a
    killed build's compilers) is killed."""
    root = tmp_path.resolve() / "extensions"
    root.mkdir()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    yield root / "cpu_adam"
    _kill_workers_in(root)


def _kill_workers_in(directory: Path) -> None:
    """SIGKILL every process working in ``directory`` (a killed build's ninja and compilers):
    stopped first, until no new one shows up (ninja would start the next compiler)."""
    stopped: set[int] = set()
    while found := holders(str(directory)).workers - stopped:
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        stopped |= found
    for pid in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _holder(lock: Path) -> subprocess.Popen[str]:
    """A process that creates ``lock`` as torch's build does, and holds it open."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(lock)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    assert process.stdout.readline() == "held\n"
    return process


def _kill(process: subprocess.Popen[str]) -> None:
    process.kill()
    process.wait()
    if process.stdout is not None:
        process.stdout.close()


def _killed_build_lock(directory: Path) -> Path:
    """The lock a build leaves when it is killed mid-way: created and held, then SIGKILLed."""
    lock = directory / "lock"
    _kill(_holder(lock))
    assert lock.exists()
    return lock


async def _start(backend: str, start_timeout: float) -> str | None:
    async with CPUAdam([{"lr": 0.1}], backend=backend, start_timeout=start_timeout) as opt:
        opt.submit(0, 0, torch.ones(8), torch.ones(8))
        await opt.drain()
        return opt.backend


def test_auto_does_not_build_a_missing_op_and_says_so_once(
    empty_extensions: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aoffload")
    for _ in range(2):
        assert aoffload.run(_start("auto", start_timeout=30)) == "torch"
        opt = aoffload.OffloadAdam([torch.nn.Parameter(torch.ones(4))])  # "auto" too
        with opt:
            assert opt.backend == "torch"
    told = [r for r in caplog.records if "backend='deepspeed' loads" in r.getMessage()]
    assert len(told) == 1, [r.getMessage() for r in told]
    assert told[0].levelno == logging.INFO
    assert "not known to be built" in told[0].getMessage()
    assert not (empty_extensions / "cpu_adam.so").exists()  # nothing was built...
    assert not holders(str(empty_extensions.parent)).workers  # ...nor is being built


def test_a_build_is_said_when_it_starts_and_a_start_timing_out_in_it_says_so(
    empty_extensions: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aoffload")
    with pytest.raises(aoffload.WorkerStartupError) as failed:
        aoffload.run(_start("deepspeed", start_timeout=8))
    message = str(failed.value)
    assert "DeepSpeed's CPU Adam op" in message, message
    assert str(empty_extensions) in message, message
    assert "building" in message or "about to build" in message, message
    assert "start_timeout" in message
    assert "backend='torch'" in message
    warned = [r for r in caplog.records if r.getMessage().find("building DeepSpeed") >= 0]
    assert warned
    assert warned[0].levelno == logging.WARNING
    assert str(empty_extensions) in warned[0].getMessage()
    assert "TORCH_EXTENSIONS_DIR" in warned[0].getMessage()
    assert "minutes" in warned[0].getMessage()


def test_a_lock_left_by_a_killed_build_is_cleared(
    build_copy: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before: every later start waited for the lock until its start_timeout."""
    caplog.set_level(logging.INFO, logger="aoffload")
    lock = _killed_build_lock(build_copy)
    assert aoffload.run(_start("deepspeed", start_timeout=60)) == "deepspeed"
    assert not lock.exists()
    removed = [r for r in caplog.records if f"removed {lock}" in r.getMessage()]
    assert removed
    assert removed[0].levelno == logging.WARNING


def test_a_live_build_is_waited_for_and_a_timeout_says_so(
    build_copy: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="aoffload")
    holder = _holder(build_copy / "lock")
    try:
        assert aoffload.run(_start("auto", start_timeout=30)) == "torch"  # "auto" never waits
        with pytest.raises(aoffload.WorkerStartupError, match="waiting for a build") as failed:
            aoffload.run(_start("deepspeed", start_timeout=5))
        assert str(build_copy) in str(failed.value)
        said = [r.getMessage() for r in caplog.records if "is under way" in r.getMessage()]
        assert said
        assert f"process {holder.pid} holds its lock" in said[0]
    finally:
        _kill(holder)
    assert aoffload.run(_start("deepspeed", start_timeout=60)) == "deepspeed"  # its lock: cleared


def test_the_compilers_a_killed_build_left_are_waited_for(tmp_path: Path) -> None:
    directory = tmp_path.resolve() / "cpu_adam"
    lock = _killed_build_lock(directory)
    compiler = subprocess.Popen(["sleep", "600"], cwd=directory)  # an orphaned compiler
    try:
        assert holders(str(directory)).workers == {compiler.pid}
        assert not clear_stale_lock(str(directory), wait=False)
        assert lock.exists()  # its build may still write there
        cleared: list[bool] = []
        waiter = threading.Thread(
            target=lambda: cleared.append(clear_stale_lock(str(directory), wait=True))
        )
        waiter.start()
        waiter.join(timeout=1.0)
        assert waiter.is_alive()
        assert lock.exists()
    finally:
        compiler.kill()
        compiler.wait()
    waiter.join(timeout=30)
    assert cleared == [True]
    assert not lock.exists()
