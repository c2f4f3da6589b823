"""How workers start: forked by the trainer's worker server, never running the trainer's script.

Real processes throughout: scripts without a main guard, fed on stdin, run by ``-c`` or
``exec``'d as a notebook cell; later starts forked by the same server; the environment,
working directory, umask, CPU affinity, nice value and policy of the starting thread, as of
each start; a worker using CUDA. The faults are in ``test_worker_faults.py``.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from aoffload._runtime import census, launcher
from aoffload._runtime.bridge import Bridge
from aoffload._runtime.core import WorkerCore
from aoffload.testing import no_leaked_workers

from ._leaks import child_pids
from .services.echo import TARGET, CudaProbe, Describe, Echo, EchoConfig

ROOT = Path(__file__).resolve().parent.parent


def echo() -> Bridge:
    return Bridge(TARGET, EchoConfig(), name="echo", close_timeout=10.0)


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def run_python(*args: str, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, *args],
        input=stdin,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


# -- scripts that never guard their main ------------------------------------------------------

_SCRIPT = """
import asyncio, multiprocessing, os, sys
import torch
import aoffload
from aoffload._runtime import census

print("top-level code ran in", os.getpid(), flush=True)

async def main(directory):
    async with aoffload.CheckpointEngine(directory, durable=False) as engine:
        await engine.save({"w": torch.arange(3.0)}, "m.pt", tag="t")
        await engine.commit("t")
        assert engine.pid in census.worker_pids()
    async with aoffload.CPUAdam([{"lr": 0.1}], backend="torch") as opt:
        param, grad = torch.zeros(4), torch.ones(4)
        opt.submit(0, 0, param, grad)
        assert [r.step for r in await opt.drain()] == [1]
    loaded = await aoffload.load_checkpoint(directory, "m.pt")
    assert torch.equal(loaded["w"], torch.arange(3.0))

asyncio.run(main(sys.argv[1]))
tracker = multiprocessing.resource_tracker._resource_tracker
print("start method", multiprocessing.get_start_method(allow_none=True))
print("resource tracker started", tracker._fd is not None)
print("OK")
"""

_NOTEBOOK = """
import sys, types
cell = types.ModuleType("__main__")  # as IPython does: a __main__ with no file behind it
sys.modules["__main__"] = cell
exec(compile(open(sys.argv[1]).read(), "<ipython-input-1>", "exec"), cell.__dict__)
"""


@pytest.mark.parametrize("how", ["script", "stdin", "-c", "notebook"])
def test_an_unguarded_trainer_starts_workers_that_never_run_its_code(
    tmp_path: Path, how: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    directory = str(tmp_path / "ckpt")
    if how == "script":
        run = run_python(str(script), directory, cwd=tmp_path)
    elif how == "stdin":
        run = run_python("-", directory, cwd=tmp_path, stdin=_SCRIPT)
    elif how == "-c":
        run = run_python("-c", _SCRIPT, directory, cwd=tmp_path)
    else:
        (tmp_path / "cell.py").write_text(_SCRIPT.replace("sys.argv[1]", repr(directory)))
        run = run_python("-c", _NOTEBOOK, str(tmp_path / "cell.py"), cwd=tmp_path)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert run.stdout.count("top-level code ran") == 1, output  # never again, in a worker
    assert "start method None" in run.stdout, output
    assert "resource tracker started False" in run.stdout, output
    assert run.stdout.rstrip().endswith("OK"), output


def test_a_service_in_main_is_refused_clearly(tmp_path: Path) -> None:
    code = textwrap.dedent("""
        import aoffload
        from aoffload._runtime.core import WorkerCore
        from aoffload._runtime.serve import Service
        class Mine(Service):
            pass
        core = WorkerCore("__main__:Mine", None, name="mine", close_timeout=5)
        try:
            core.start(30)
        except aoffload.WorkerStartupError as exc:
            print("refused:", exc)
        """)
    run = run_python("-c", code, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert (
        "refused: the mine worker cannot start: its service __main__:Mine is defined in __main__"
        in run.stdout
    )


# -- first and later starts -------------------------------------------------------------------


async def test_later_starts_are_forked_by_the_same_server() -> None:
    pids, parents = [], []
    for i in range(3):
        async with echo() as bridge:
            assert await bridge.request(Echo(i)) == i
            described = await bridge.request(Describe())
            assert described["pid"] == bridge.pid
            pids.append(bridge.pid)
            parents.append(described["ppid"])
    server = parents[0]
    assert parents == [server] * 3
    assert len(set(pids)) == 3
    assert server != os.getpid()
    assert parent_of(server) == os.getpid()
    assert census.is_worker_server(server)
    assert server in {s.pid for s in launcher.servers()}
    assert server not in child_pids()  # the census counts workers, never the server


async def _start_inside_a_census(bridge: Bridge) -> None:
    with no_leaked_workers("this block"):
        await bridge.astart()


def _segment_inside_a_census(segment: Path) -> None:
    with no_leaked_workers("this block"):
        segment.write_bytes(b"x")


async def test_the_census_counts_a_leaked_worker_and_segment_though_not_children() -> None:
    bridge = echo()
    with pytest.raises(pytest.fail.Exception, match=r"left behind child processes \[\d+\]"):
        await _start_inside_a_census(bridge)
    assert bridge.pid is not None
    assert parent_of(bridge.pid) != os.getpid()
    await bridge.aclose()
    segment = Path(census.SHM_DIR) / f"aoffload-{os.getpid()}-census-test"
    try:
        with pytest.raises(pytest.fail.Exception, match="left behind /dev/shm segments"):
            await asyncio.to_thread(_segment_inside_a_census, segment)
    finally:
        segment.unlink()
    with no_leaked_workers("a clean block"):
        async with echo():
            pass


# -- the environment of each start --------------------------------------------------------------


async def test_a_worker_gets_the_environment_cwd_and_umask_of_its_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with echo() as bridge:
        before = await bridge.request(Describe("AOFFLOAD_TEST_VARIABLE"))
    assert before["variable"] is None
    monkeypatch.setenv("AOFFLOAD_TEST_VARIABLE", "as of the start")
    monkeypatch.chdir(tmp_path)
    old_umask = os.umask(0o027)
    try:
        async with echo() as bridge:
            after = await bridge.request(Describe("AOFFLOAD_TEST_VARIABLE"))
    finally:
        os.umask(old_umask)
    assert after["variable"] == "as of the start"
    assert after["cwd"] == str(tmp_path)
    assert after["umask"] == 0o027
    assert after["ppid"] == before["ppid"]  # a plain variable: the same server


def _fresh_interpreter_threads(env: dict[str, str] | None = None) -> int:
    """torch's thread count in a fresh interpreter started from the calling thread."""
    run = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return int(run.stdout)


async def test_an_import_time_variable_gets_a_fresh_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with echo() as bridge:
        before = await bridge.request(Describe())
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    expected = await asyncio.to_thread(_fresh_interpreter_threads, dict(os.environ))
    async with echo() as bridge:
        after = await bridge.request(Describe("OMP_NUM_THREADS"))
    assert after["variable"] == "1"
    assert after["threads"] == expected == 1
    assert after["ppid"] != before["ppid"]


def _start_from_a_thread(setup: Callable[[], None]) -> tuple[dict[str, Any], int]:
    """Start a worker through the thread-safe core from a fresh thread that ran ``setup``:
    what the worker describes, and a fresh interpreter's torch thread count from there."""
    seen: dict[str, Any] = {}

    def run() -> None:
        setup()
        seen["oracle"] = _fresh_interpreter_threads()
        core = WorkerCore(TARGET, EchoConfig(), name="echo", close_timeout=10.0)
        core.start(120)
        try:
            seen.update(core.request(Describe(), 60))
        finally:
            core.stop()
            core.release()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return seen, seen.pop("oracle")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin to one")
def test_a_worker_gets_the_cpu_affinity_of_the_thread_that_starts_it() -> None:
    cpu = min(os.sched_getaffinity(0))
    described, oracle = _start_from_a_thread(lambda: os.sched_setaffinity(0, {cpu}))
    assert described["affinity"] == {cpu}
    assert described["threads"] == oracle == 1  # OpenMP sized its pool for one CPU, too
    unpinned, _ = _start_from_a_thread(lambda: None)
    assert unpinned["affinity"] == os.sched_getaffinity(0)
    assert unpinned["ppid"] != described["ppid"]


@pytest.mark.skipif(os.getpriority(os.PRIO_PROCESS, 0) > 16, reason="no room to raise nice")
def test_a_worker_gets_the_nice_value_and_policy_of_the_thread_that_starts_it() -> None:
    mine = os.getpriority(os.PRIO_PROCESS, 0)

    def lower() -> None:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, 0, mine + 3)

    described, _ = _start_from_a_thread(lower)
    assert described["nice"] == mine + 3
    assert described["policy"] == os.SCHED_BATCH != os.sched_getscheduler(0)


@pytest.fixture
def cuda() -> None:
    """A CUDA device, its context made before the test's loop runs (it takes seconds)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.ones(1, device="cuda").sum().item()


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.cuda
async def test_a_worker_can_use_cuda_and_its_server_never_initialises_the_driver(
    cuda: None,
) -> None:
    """A process that initialised CUDA maps the driver's device files (``/dev/nvidia*``);
    one that only imported torch does not, though a CUDA build of torch may map
    ``libcuda`` at import (torch 2.11+cu130 does). A server that initialised CUDA would
    fork workers that cannot use it."""
    torch.ones(1, device="cuda").sum().item()  # the trainer uses CUDA first: no matter
    async with echo() as bridge:
        assert await bridge.request(CudaProbe()) == torch.cuda.get_device_name()
        assert bridge.pid is not None
        server = parent_of(bridge.pid)
        assert "/dev/nvidia" not in _maps(server)
        assert "/dev/nvidia" in _maps(bridge.pid)
    async with echo() as second:  # the server is as it was: the next worker uses CUDA too
        assert await second.request(CudaProbe()) == torch.cuda.get_device_name()


def test_the_global_start_method_is_untouched() -> None:
    before = multiprocessing.get_start_method(allow_none=True)
    core = WorkerCore(TARGET, EchoConfig(), name="echo", close_timeout=10.0)
    core.start(120)
    core.stop()
    core.release()
    assert multiprocessing.get_start_method(allow_none=True) == before
