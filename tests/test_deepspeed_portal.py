"""The loop-in-thread portal behind aoffload.deepspeed, and the on-demand import of DeepSpeed."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

import pytest

from aoffload import ClosedError, WorkerDiedError
from aoffload._runtime.threads import Portal
from tests._leaks import Snapshot


def test_import_aoffload_does_not_import_deepspeed() -> None:
    code = (
        "import sys, aoffload\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] == 'deepspeed']\n"
        "assert not loaded, loaded\n"
        "assert 'aoffload.deepspeed' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_call_returns_the_value_computed_on_the_portal_thread() -> None:
    portal = Portal("test")
    try:

        async def where() -> tuple[str, bool]:
            await asyncio.sleep(0)
            return threading.current_thread().name, asyncio.get_running_loop() is portal.loop

        name, same_loop = portal.call(where())
        assert name == "aoffload-portal-test"
        assert same_loop
    finally:
        portal.close()


def test_portal_runs_uvloop_when_installed() -> None:
    uvloop = pytest.importorskip("uvloop")
    portal = Portal("test")
    try:
        assert isinstance(portal.loop, uvloop.Loop)
    finally:
        portal.close()


def test_an_error_comes_back_unwrapped_and_the_portal_stays_usable() -> None:
    portal = Portal("test")
    error = WorkerDiedError("writer", 123, -9)
    try:

        async def fail() -> None:
            raise error

        with pytest.raises(WorkerDiedError) as caught:
            portal.call(fail())
        assert caught.value is error
        assert portal.call(asyncio.sleep(0, result=7)) == 7
    finally:
        portal.close()


def test_close_cancels_pending_work_joins_the_thread_and_is_idempotent() -> None:
    before = Snapshot.take()
    portal = Portal("test")
    cancelled = threading.Event()

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    future = portal.submit(forever())
    assert portal.call(asyncio.sleep(0, result=1)) == 1
    portal.close()
    portal.close()
    assert cancelled.is_set()
    assert future.cancelled()
    assert portal.loop.is_closed()
    assert Snapshot.take().leaked_since(before) == []
    with pytest.raises(ClosedError):
        portal.call(asyncio.sleep(0))


def test_blocking_call_from_the_portal_loop_is_refused() -> None:
    portal = Portal("test")
    try:

        async def reenter() -> None:
            portal.call(asyncio.sleep(0))

        with pytest.raises(RuntimeError, match="own loop"):
            portal.call(reenter())
    finally:
        portal.close()
