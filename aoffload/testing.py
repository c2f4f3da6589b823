"""pytest fixtures for suites that use aoffload (the ``pytest11`` plugin ``aoffload``).

Installing aoffload registers this plugin with pytest; with plugin autoloading disabled,
load it with ``-p aoffload``. It provides:

* ``aoffload_engine``: a started :class:`~aoffload.CheckpointEngine` writing to
  ``tmp_path / "checkpoints"``, closed after the test. The test fails (an error in
  teardown) if a child process started during the test, or a staging segment this
  process made in ``/dev/shm``, is still there once the engine is closed.
* ``aoffload_optimizer``: a started :class:`~aoffload.CPUAdam` with one default param
  group (``lr=1e-3``) on the ``torch`` backend, closed after, with the same check.
* ``aoffload_kill``: ``await aoffload_kill(obj)`` is :func:`kill_worker`.
* ``aoffload_s3``: ``s3://<a fresh bucket>/run`` on a real S3 endpoint (moto's server on
  loopback, one per session: ``aoffload_s3_endpoint``), with ``AWS_ENDPOINT_URL`` and fake
  credentials set for the test: ``CheckpointEngine(tmp_path, remote=aoffload_s3)``.
* ``aoffload_engine_options`` / ``aoffload_optimizer_options``: the keyword arguments of
  the two constructors (``{}`` and ``{"backend": "torch"}``); override them in a
  ``conftest.py`` to change them for a directory of tests.

The async fixtures are ``pytest_asyncio`` fixtures: they work in its ``auto`` and
``strict`` modes and run on the test's event loop (keep ``asyncio_default_fixture_loop_scope``
and ``asyncio_default_test_loop_scope`` equal). :func:`loop_factories` is what a
``conftest.py`` returns from pytest-asyncio's ``pytest_asyncio_loop_factories`` hook to
run every async test on asyncio's loop and on uvloop. See ``docs/testing.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import signal
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

from ._moto import S3Endpoint
from ._runtime.census import child_pids, is_resource_tracker, staging_segments
from ._runtime.core import WorkerCore
from .checkpoint import CheckpointEngine
from .optimizer import CPUAdam

__all__ = [
    "aoffload_engine",
    "aoffload_engine_options",
    "aoffload_kill",
    "aoffload_optimizer",
    "aoffload_optimizer_options",
    "aoffload_s3",
    "aoffload_s3_endpoint",
    "kill_worker",
    "loop_factories",
    "no_leaked_workers",
]

_LoopFactory = Callable[[], asyncio.AbstractEventLoop]
_DEFAULT_PARAM_GROUP: dict[str, object] = {"lr": 1e-3}  # DeepSpeed's defaults for the rest


# -- loops ---------------------------------------------------------------------------------


def loop_factories(
    *, uvloop: bool | None = None, slow_callback_duration: float | None = None
) -> dict[str, _LoopFactory]:
    """Loop factories for pytest-asyncio's ``pytest_asyncio_loop_factories`` hook.

    Returned from that hook in a ``conftest.py``, every async test (and the async
    fixtures it uses) runs twice, as ``[asyncio]`` and ``[uvloop]``. ``uvloop=None``
    includes uvloop when it is installed, ``True`` requires it, ``False`` leaves it out.
    ``slow_callback_duration`` sets the loops' threshold (seconds) for asyncio's debug-mode
    "Executing ... took N seconds" warning; debug mode itself follows pytest-asyncio's
    ``asyncio_debug`` setting.
    """

    def configured(factory: _LoopFactory) -> _LoopFactory:
        def new_loop() -> asyncio.AbstractEventLoop:
            loop = factory()
            if slow_callback_duration is not None:
                loop.slow_callback_duration = slow_callback_duration
            return loop

        return new_loop

    factories = {"asyncio": configured(asyncio.new_event_loop)}
    if uvloop is False:
        return factories
    if importlib.util.find_spec("uvloop") is None:
        if uvloop:
            raise pytest.UsageError("loop_factories(uvloop=True): uvloop is not installed")
        return factories
    import uvloop as uvloop_module

    factories["uvloop"] = configured(uvloop_module.new_event_loop)
    return factories


# -- leaks -------------------------------------------------------------------------------


@contextlib.contextmanager
def no_leaked_workers(what: str) -> Iterator[None]:
    """Fail the test if the block leaves a child process or a staging segment behind.

    Counts the child processes started inside the block that are still alive at its end
    (multiprocessing's resource tracker excepted: it lives as long as this process) and
    the ``/dev/shm`` staging segments this process made inside it.
    """
    children, segments = child_pids(), staging_segments()
    yield
    left = sorted(pid for pid in child_pids() - children if not is_resource_tracker(pid))
    shm = sorted(staging_segments() - segments)
    problems = []
    if left:
        problems.append(f"child processes {left}")
    if shm:
        problems.append(f"/dev/shm segments {shm}")
    if problems:
        pytest.fail(f"{what} left behind {' and '.join(problems)}", pytrace=False)


# -- killing a worker ----------------------------------------------------------------------


def _core_of(obj: object, pid: int, depth: int = 4) -> WorkerCore | None:
    """The core running worker ``pid`` among ``obj`` and what it holds (a few levels down)."""
    if isinstance(obj, WorkerCore):
        return obj if obj.pid == pid else None
    if depth == 0 or isinstance(obj, (str, bytes, int, float)) or obj is None:
        return None
    values: list[object] = list(getattr(obj, "__dict__", {}).values())
    values += [getattr(obj, slot, None) for slot in getattr(type(obj), "__slots__", ())]
    if isinstance(obj, dict):
        values += list(obj.values())
    for value in values:
        found = _core_of(value, pid, depth - 1)
        if found is not None:
            return found
    return None


async def kill_worker(obj: object) -> None:
    """SIGKILL the worker process of ``obj`` and return once ``obj`` has seen it die.

    ``obj`` is any aoffload object with a ``pid`` (:class:`~aoffload.CheckpointEngine`,
    :class:`~aoffload.CPUAdam`, the :mod:`aoffload.deepspeed` adapters). When this returns,
    the next use of ``obj`` raises :class:`~aoffload.WorkerDiedError`. Nothing is polled:
    it awaits the object's own report of the worker's exit. Raises :class:`ValueError`
    if ``obj`` has no running worker.
    """
    pid = getattr(obj, "pid", None)
    if not isinstance(pid, int):
        raise ValueError(f"{type(obj).__name__} has no running worker to kill (pid {pid!r})")
    core = _core_of(obj, pid)
    if core is None:
        raise TypeError(
            f"kill_worker() does not know how {type(obj).__name__} talks to its worker; "
            "pass a CheckpointEngine, a CPUAdam or an aoffload.deepspeed adapter"
        )
    os.kill(pid, signal.SIGKILL)
    await asyncio.wrap_future(core.exited)


# -- fixtures ------------------------------------------------------------------------------


_AsyncFixture = Callable[..., AsyncIterator[Any]]


def _async_fixture(function: _AsyncFixture) -> Any:
    """A pytest-asyncio fixture, or one that says pytest-asyncio is missing."""
    if importlib.util.find_spec("pytest_asyncio") is not None:
        import pytest_asyncio

        return pytest_asyncio.fixture(function)

    def missing() -> None:
        pytest.fail(
            f"the {function.__name__} fixture needs pytest-asyncio: pip install pytest-asyncio",
            pytrace=False,
        )

    missing.__name__ = missing.__qualname__ = function.__name__
    missing.__doc__ = function.__doc__
    return pytest.fixture(missing)


@pytest.fixture
def aoffload_engine_options() -> dict[str, Any]:
    """Keyword arguments of the ``aoffload_engine`` fixture's engine (default: none)."""
    return {}


@pytest.fixture
def aoffload_optimizer_options() -> dict[str, Any]:
    """Keyword arguments of the ``aoffload_optimizer`` fixture's CPUAdam (torch backend)."""
    return {"backend": "torch"}


@_async_fixture
async def aoffload_engine(
    tmp_path: Path, aoffload_engine_options: dict[str, Any]
) -> AsyncIterator[CheckpointEngine]:
    """A started CheckpointEngine in ``tmp_path / "checkpoints"``, closed after the test;
    the test fails if a worker process or a staging segment outlives it."""
    with no_leaked_workers("the aoffload_engine fixture's test"):
        async with CheckpointEngine(tmp_path / "checkpoints", **aoffload_engine_options) as engine:
            yield engine


@_async_fixture
async def aoffload_optimizer(
    aoffload_optimizer_options: dict[str, Any],
) -> AsyncIterator[CPUAdam]:
    """A started CPUAdam with one default param group (torch backend), closed after the
    test; the test fails if a worker process outlives it."""
    options = {"param_groups": [dict(_DEFAULT_PARAM_GROUP)], **aoffload_optimizer_options}
    with no_leaked_workers("the aoffload_optimizer fixture's test"):
        async with CPUAdam(**options) as optimizer:
            yield optimizer


@pytest.fixture
def aoffload_kill() -> Callable[[object], Coroutine[Any, Any, None]]:
    """``await aoffload_kill(obj)``: SIGKILL ``obj``'s worker; see :func:`kill_worker`."""
    return kill_worker


# -- a real S3 endpoint ------------------------------------------------------------------


@pytest.fixture(scope="session")
def aoffload_s3_endpoint() -> Iterator[S3Endpoint]:
    """moto's S3 server on loopback (a free port), started once per session; see
    :class:`~aoffload._moto.S3Endpoint`. Needs ``moto[server]``."""
    if importlib.util.find_spec("moto") is None or importlib.util.find_spec("s3fs") is None:
        pytest.skip("the aoffload_s3 fixtures need moto[server] and s3fs")
    with S3Endpoint.start() as endpoint:
        yield endpoint


@pytest.fixture
def aoffload_s3(aoffload_s3_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch) -> str:
    """``s3://<a fresh bucket>/run`` on the session's moto server, with the environment
    (``AWS_ENDPOINT_URL``, fake credentials) pointing s3fs and aoffload's workers at it:
    ``CheckpointEngine(tmp_path, remote=aoffload_s3)``."""
    for name, value in aoffload_s3_endpoint.environ.items():
        monkeypatch.setenv(name, value)
    return f"s3://{aoffload_s3_endpoint.bucket()}/run"
