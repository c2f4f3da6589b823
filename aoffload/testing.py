"""pytest fixtures for suites that use aoffload (the ``pytest11`` plugin ``aoffload``).

Installing aoffload registers this plugin with pytest; with plugin autoloading disabled,
load it with ``-p aoffload``. It provides:

* ``aoffload_engine``: a started :class:`~aoffload.CheckpointEngine` writing to
  ``tmp_path / "checkpoints"``, closed after the test. The test fails (an error in
  teardown) if a child process started during the test, or a staging segment this
  process made in ``/dev/shm``, is still there once the engine is closed.
* ``aoffload_optimizer``: a started :class:`~aoffload.CPUAdam` with one default param
  group (``lr=1e-3``) on the ``torch`` backend, closed after, with the same check.
* ``aoffload_shared_engine``: one started engine for a whole module (its tests run on the
  module's event loop), closed after the module, with the same check; options in
  ``aoffload_shared_engine_options``. A start costs tens of milliseconds once the process's
  worker server runs, so the per-test fixtures are cheap too; this one is for suites that
  want no start at all per test.
* ``aoffload_kill``: ``await aoffload_kill(obj)`` is :func:`kill_worker`.
* ``aoffload_s3``: ``s3://<a fresh bucket>/run`` on a real S3 endpoint (moto's server on
  loopback, one per session: ``aoffload_s3_endpoint``, an :class:`S3Endpoint`), with
  ``AWS_ENDPOINT_URL`` and fake credentials set for the test:
  ``CheckpointEngine(tmp_path, remote=aoffload_s3)``. A test that pauses or stops its
  endpoint starts its own: ``with S3Endpoint.start() as endpoint:``.
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
import functools
import importlib.util
import os
import signal
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

from ._moto import S3Endpoint
from ._runtime.census import staging_segments, worker_pids
from ._runtime.core import WorkerCore
from .checkpoint import CheckpointEngine
from .optimizer import CPUAdam

__all__ = [
    "S3Endpoint",
    "aoffload_engine",
    "aoffload_engine_options",
    "aoffload_kill",
    "aoffload_optimizer",
    "aoffload_optimizer_options",
    "aoffload_s3",
    "aoffload_s3_endpoint",
    "aoffload_shared_engine",
    "aoffload_shared_engine_options",
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

    factories = {"asyncio": _configured("asyncio", slow_callback_duration)}
    if uvloop is False:
        return factories
    if importlib.util.find_spec("uvloop") is None:
        if uvloop:
            raise pytest.UsageError("loop_factories(uvloop=True): uvloop is not installed")
        return factories
    factories["uvloop"] = _configured("uvloop", slow_callback_duration)
    return factories


@functools.cache
def _configured(kind: str, slow_callback_duration: float | None) -> _LoopFactory:
    # One factory object per configuration, however often the hook asks: pytest-asyncio
    # parametrizes tests with them, and only equal parameters let a module- or
    # session-scoped loop (and the fixtures on it) serve more than one test.
    if kind == "uvloop":
        import uvloop as uvloop_module

        factory: _LoopFactory = uvloop_module.new_event_loop
    else:
        factory = asyncio.new_event_loop

    def new_loop() -> asyncio.AbstractEventLoop:
        loop = factory()
        if slow_callback_duration is not None:
            loop.slow_callback_duration = slow_callback_duration
        return loop

    new_loop.__name__ = new_loop.__qualname__ = f"new_{kind}_loop"
    return new_loop


# -- leaks -------------------------------------------------------------------------------


@contextlib.contextmanager
def no_leaked_workers(what: str) -> Iterator[None]:
    """Fail the test if the block leaves a worker, a child process or a staging segment behind.

    Counts the workers and child processes started inside the block that are still alive
    at its end, and the ``/dev/shm`` staging segments this process made inside it. Workers
    are children of aoffload's worker server, which (like multiprocessing's resource
    tracker) lives as long as this process by design and is not counted itself.
    """
    children, segments = worker_pids(), staging_segments()
    yield
    left = sorted(worker_pids() - children)
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


def _async_fixture(**options: Any) -> Callable[[_AsyncFixture], Any]:
    """A pytest-asyncio fixture (``options`` as pytest-asyncio's), or one that says
    pytest-asyncio is missing."""

    def make(function: _AsyncFixture) -> Any:
        if importlib.util.find_spec("pytest_asyncio") is not None:
            import pytest_asyncio

            return pytest_asyncio.fixture(function, **options)

        def missing() -> None:
            pytest.fail(
                f"the {function.__name__} fixture needs pytest-asyncio: pip install pytest-asyncio",
                pytrace=False,
            )

        missing.__name__ = missing.__qualname__ = function.__name__
        missing.__doc__ = function.__doc__
        return pytest.fixture(missing, scope=options.get("scope", "function"))

    return make


@pytest.fixture
def aoffload_engine_options() -> dict[str, Any]:
    """Keyword arguments of the ``aoffload_engine`` fixture's engine (default: none)."""
    return {}


@pytest.fixture
def aoffload_optimizer_options() -> dict[str, Any]:
    """Keyword arguments of the ``aoffload_optimizer`` fixture's CPUAdam (torch backend)."""
    return {"backend": "torch"}


@_async_fixture()
async def aoffload_engine(
    tmp_path: Path, aoffload_engine_options: dict[str, Any]
) -> AsyncIterator[CheckpointEngine]:
    """A started CheckpointEngine in ``tmp_path / "checkpoints"``, closed after the test;
    the test fails if a worker process or a staging segment outlives it."""
    with no_leaked_workers("the aoffload_engine fixture's test"):
        async with CheckpointEngine(tmp_path / "checkpoints", **aoffload_engine_options) as engine:
            yield engine


@pytest.fixture(scope="module")
def aoffload_shared_engine_options() -> dict[str, Any]:
    """Keyword arguments of the ``aoffload_shared_engine`` fixture's engine (default: none)."""
    return {}


@_async_fixture(scope="module", loop_scope="module")
async def aoffload_shared_engine(
    tmp_path_factory: pytest.TempPathFactory, aoffload_shared_engine_options: dict[str, Any]
) -> AsyncIterator[CheckpointEngine]:
    """One started CheckpointEngine for every test of a module that asks for it, writing to a
    directory of its own; closed after the module's last test, when the leak check runs.

    Its tests run on the module's event loop, the loop the engine started on: mark them
    ``@pytest.mark.asyncio(loop_scope="module")`` (a ``pytestmark`` does the whole module).
    They share the engine's directory, so each should use tags of its own.
    """
    directory = tmp_path_factory.mktemp("aoffload-shared") / "checkpoints"
    with no_leaked_workers("the aoffload_shared_engine fixture's module"):
        async with CheckpointEngine(directory, **aoffload_shared_engine_options) as engine:
            yield engine


@_async_fixture()
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
    :class:`S3Endpoint`. Needs ``moto[server]``."""
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
