"""The pytest plugin ``aoffload.testing``: its fixtures, its leak check, the docs' example."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import aoffload
from aoffload.testing import kill_worker, loop_factories

from ._leaks import child_pids

ROOT = Path(__file__).resolve().parent.parent


async def test_engine_fixture_commits_and_kill_makes_its_next_use_raise(
    aoffload_engine: aoffload.CheckpointEngine, aoffload_kill: object, tmp_path: Path
) -> None:
    assert aoffload_kill is kill_worker
    pid = aoffload_engine.pid
    assert pid in child_pids()
    assert aoffload_engine.directory == tmp_path / "checkpoints"
    await aoffload_engine.save({"w": torch.arange(4.0)}, "model.pt", tag="t")
    result = await aoffload_engine.commit("t")
    assert result.files == ("model.pt",)
    assert torch.equal((await aoffload_engine.load("model.pt"))["w"], torch.arange(4.0))
    await kill_worker(aoffload_engine)
    assert aoffload_engine.pid is None
    assert pid not in child_pids()
    with pytest.raises(aoffload.WorkerDiedError) as info:  # no wait, no retry: already seen
        await aoffload_engine.save({"w": torch.ones(2)}, "m.pt", tag="t2")
    assert info.value.exitcode == -9


async def test_optimizer_fixture_steps_and_kill_makes_its_next_use_raise(
    aoffload_optimizer: aoffload.CPUAdam,
) -> None:
    assert aoffload_optimizer.backend == "torch"
    param, grad = torch.ones(8), torch.ones(8)
    aoffload_optimizer.submit(0, 0, param, grad)
    [result] = await aoffload_optimizer.drain()
    assert result.step == 1
    assert torch.all(param < 1)
    await kill_worker(aoffload_optimizer)
    with pytest.raises(aoffload.WorkerDiedError):
        aoffload_optimizer.submit(0, 0, param, grad)
    with pytest.raises(ValueError, match="no running worker"):
        await kill_worker(aoffload_optimizer)


@pytest.mark.deepspeed
def test_kill_reaches_the_core_of_a_superoffload_optimizer() -> None:
    pytest.importorskip("deepspeed")
    from aoffload.deepspeed import SuperOffloadCPUOptimizer

    opt = SuperOffloadCPUOptimizer(
        [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False}],
        backend="torch",
    )
    try:
        pid = opt.pid
        assert pid is not None
        asyncio.run(kill_worker(opt))  # found by walking the adapter's attributes to its core
        assert pid not in child_pids()
        assert opt.pid is None
        with pytest.raises(aoffload.WorkerDiedError) as info:  # seen already: no wait
            opt.get_result()
        assert info.value.exitcode == -signal.SIGKILL
        with pytest.raises(aoffload.WorkerDiedError):
            opt.async_step(0, 0, torch.ones(8), torch.ones(8))
    finally:
        opt.close()


def test_loop_factories_name_asyncio_and_uvloop() -> None:
    factories = loop_factories(slow_callback_duration=0.25)
    assert set(factories) == {"asyncio", "uvloop"}
    loop = factories["uvloop"]()
    try:
        assert type(loop).__module__.startswith("uvloop")
        assert loop.slow_callback_duration == 0.25
    finally:
        loop.close()
    assert set(loop_factories(uvloop=False)) == {"asyncio"}


def _docs_files(markdown: str) -> dict[str, str]:
    """The files docs/testing.md spells out: a ``<!-- file: NAME -->`` line, then a block."""
    pattern = re.compile(r"<!-- file: (\S+) -->\n```\w*\n(.*?)```", re.S)
    return {name: body for name, body in pattern.findall(markdown)}


_LEAKY_TEST = """
import aoffload
import pytest

@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_leaves_its_worker_running(aoffload_engine):
    await aoffload.CPUAdam([{}], backend="torch", worker_cores=None).astart()
"""


def test_the_docs_example_suite_passes_under_both_loops_and_the_leak_check_bites(
    tmp_path: Path,
) -> None:
    files = _docs_files((ROOT / "docs" / "testing.md").read_text())
    assert {"conftest.py", "pytest.ini", "test_training.py"} <= set(files)
    for name, body in files.items():
        (tmp_path / name).write_text(body)
    (tmp_path / "test_leaky.py").write_text(_LEAKY_TEST)
    # Autoloading off and the plugin named explicitly: the same run whether or not aoffload's
    # entry point is installed (loading it twice under two names is an error in pytest).
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONPATH": str(ROOT)}
    plugins = ["-p", "asyncio", "-p", "aoffload.testing", "-p", "no:cacheprovider"]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", *plugins, str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    output = run.stdout + run.stderr
    tests = re.findall(r"test_training\.py::(\w+\[\w+\]) PASSED", output)
    assert run.returncode == 1, output  # the leaky test's teardown, and nothing else
    assert len(tests) == 6, output
    assert {name.rsplit("[", 1)[1] for name in tests} == {"asyncio]", "uvloop]"}, output
    assert re.search(r"\d+ passed.*, 1 error", output), output
    assert "the aoffload_engine fixture's test left behind child processes" in output, output
