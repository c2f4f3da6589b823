"""OffloadAdam's worker lives, and the state it keeps between them.

An OffloadAdam outlives its worker: the worker runs from ``start()`` to ``close()`` (a
``with`` block), and the optimizer may be started again (train and eval blocks that
alternate). :class:`Life` holds the lifecycle (the same states as every worker-backed
object, :class:`~aoffload._runtime.resource.State`, but CLOSED may start again) and the
state while no worker runs:

* before the first start, the state loaded (or none);
* after a close, the state the worker had (taken as it closes; a step a backward began
  and nobody finished is undone first), so :meth:`OffloadAdam.state_dict` works and the
  next start continues exactly where the last one stopped;
* a state that could not be taken (the worker died) is *lost*: said at WARNING when it
  happens, and raised by the next start and ``state_dict()`` until a state is loaded.

Both faces: ``start()`` / ``close()`` block the caller; ``astart()`` / ``aclose()`` run the
same on a thread, and the trainer's CPU pinning is done and undone on the caller's thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from ..._errors import ClosedError
from ..._runtime.handle import Handle, in_thread
from ..._runtime.resource import State
from ..._runtime.threads import run_in_thread, running_future
from .._core import OptimizerCore
from .._waits import LoopWaits
from ._drive import drive
from ._offloader import Offloader
from ._state import FORMAT, Loaded, from_torch, packed_groups, to_torch
from ._step import abandon_flow

__all__ = ["Life"]

logger = logging.getLogger(__name__)


class Life:
    """The lifecycle of one OffloadAdam's worker, and the state kept while none runs."""

    def __init__(
        self, offloader: Offloader, param_groups: Sequence[Mapping[str, Any]], waits: LoopWaits
    ) -> None:
        self._off = offloader
        self._groups = param_groups  # the optimizer's own list
        self._waits = waits
        self.state = State.NEW
        self._lock = threading.Lock()
        self._closing: concurrent.futures.Future[None] | None = None
        self._pending: Loaded | None = None  # a state loaded while not running, validated
        self._pending_state: Mapping[str, Any] | None = None  # ...and as given (or kept)
        self._lost: BaseException | None = None  # why the state could not be kept at close

    def _set(self, state: State) -> None:
        with self._lock:
            self.state = state

    # -- starting ------------------------------------------------------------------------

    def _begin_start(self) -> None:
        with self._lock:
            if self.state not in (State.NEW, State.CLOSED):
                raise ClosedError(
                    f"this OffloadAdam is {self.state.value}: close it before starting it "
                    "again (`with opt:` blocks may follow one another, not nest)"
                )
            if self._lost is not None:
                raise ClosedError(
                    "this OffloadAdam lost its state when it closed (see the cause): load a "
                    "saved one with load_state_dict() before starting it again, or create "
                    "a new OffloadAdam"
                ) from self._lost
            self.state = State.STARTING
            self._closing = None

    def _open(self) -> None:
        """Start the worker with the state kept or loaded; blocking, on any thread. A failed
        start leaves nothing running and the state as it was."""
        off = self._off
        pending = self._pending
        if pending is None and self._pending_state is not None:
            pending = from_torch(self._pending_state, off.buckets, self._groups)
        try:
            off.start(pending)
        except BaseException:
            try:
                off.close()
            finally:
                self._set(State.CLOSED)
            raise
        self._pending = self._pending_state = None  # the worker holds it now

    def start(self) -> None:
        """Start the worker, on this thread (see :meth:`OffloadAdam.start`)."""
        self._begin_start()
        self._open()
        self._off.pin()
        self._set(State.RUNNING)

    async def astart(self) -> None:
        """:meth:`start` on a thread; a cancelled wait closes it once it has started."""
        self._begin_start()
        self._waits.bind(asyncio.get_running_loop())
        opening = in_thread(self._open, name="aoffload-offload-adam-start")
        try:
            await opening
        except asyncio.CancelledError:
            closing = run_in_thread(self._close_after, opening, name="aoffload-offload-adam-close")
            await asyncio.shield(closing)
            raise
        self._off.pin()
        self._set(State.RUNNING)

    def _close_after(self, opening: Handle[None]) -> None:
        try:
            opening.result()
        except BaseException:  # noqa: BLE001 - the start failed: nothing to close
            return
        self._set(State.RUNNING)
        self.close()

    # -- closing -------------------------------------------------------------------------

    def _begin_close(self) -> tuple[concurrent.futures.Future[None] | None, bool]:
        """(the close's future, whether this call runs it); ``None``: nothing to close."""
        with self._lock:
            if self.state in (State.NEW, State.CLOSED):
                return None, False
            if self.state is State.STARTING:
                raise ClosedError("this OffloadAdam is still starting; wait for its start first")
            if self._closing is not None:
                return self._closing, False
            self._closing = running_future()
            self.state = State.CLOSING
            return self._closing, True

    def _shut(self, closing: concurrent.futures.Future[None]) -> None:
        """Keep the state, stop the worker, free the buckets; blocking, on any thread."""
        try:
            self._keep_state()
        finally:
            try:
                self._off.close()
            finally:
                self._set(State.CLOSED)
                closing.set_result(None)

    def _keep_state(self) -> None:
        off = self._off
        core = off.core
        try:
            if core is None:
                raise ClosedError("the worker never started")
            unfinished = off.unfinished
            if unfinished is not None:  # a cancelled astep() finishing on a thread
                concurrent.futures.wait([unfinished])
                off.unfinished = None
                unfinished.result()
            if off.in_step():
                drive(core.outcomes, abandon_flow(off))
            state = to_torch(core.state_dict().result(), off.buckets, self._groups)
        except Exception as exc:  # noqa: BLE001 - kept, raised by the next start
            logger.warning(
                "OffloadAdam closed without its optimizer state (%s): load a saved "
                "state_dict() before starting it again",
                exc,
            )
            self._lost, self._pending, self._pending_state = exc, None, None
            return
        self._lost, self._pending, self._pending_state = None, None, state

    def close(self) -> None:
        """Keep the state, stop the worker; blocking, idempotent."""
        closing, mine = self._begin_close()
        if closing is None:
            return
        if not mine:
            closing.result()
            return
        try:
            self._shut(closing)
        finally:
            self._off.unpin()

    async def aclose(self) -> None:
        """:meth:`close` on a thread; a cancelled wait leaves the close running to its end."""
        closing, mine = self._begin_close()
        if closing is None:
            return
        try:
            if mine:
                await run_in_thread(self._shut, closing, name="aoffload-offload-adam-close")
            else:
                await self._waits.done(closing)
        finally:
            if mine:
                self._off.unpin()

    # -- running -------------------------------------------------------------------------

    def running_core(self) -> OptimizerCore:
        """The worker's core, if it runs; else :class:`~aoffload.ClosedError`."""
        core = self._off.core
        if self.state is not State.RUNNING or core is None:
            raise ClosedError(
                f"this OffloadAdam is {self.state.value}; step it inside `with opt:` or "
                "`async with opt:` (or between start() and close())"
            )
        return core

    # -- the state while no worker runs ----------------------------------------------------

    def kept_state(self) -> dict[str, Any] | None:
        """The state while no worker runs (``None``: one runs); raises if it was lost."""
        with self._lock:
            state = self.state
        if state is State.RUNNING:
            return None
        if state not in (State.NEW, State.CLOSED):
            raise ClosedError(f"this OffloadAdam is {state.value}; call it between steps")
        if self._lost is not None:
            raise ClosedError(
                "this OffloadAdam lost its state when it closed (see the cause)"
            ) from self._lost
        saved = self._pending_state
        return {
            "state": dict(saved["state"]) if saved is not None else {},
            "param_groups": packed_groups(self._groups),
            "offload": (
                saved.get("offload")
                if saved is not None and saved.get("offload") is not None
                else {"format": FORMAT, "backend": None, "kernel": None}
            ),
        }

    def keep(self, loaded: Loaded, state_dict: Mapping[str, Any]) -> None:
        """Keep a validated state for the next start (it replaces a lost one)."""
        self._pending, self._pending_state, self._lost = loaded, state_dict, None

    def added_group(self, group: Mapping[str, Any]) -> None:
        """A param group was appended while no worker runs: its parameters have no state in
        the kept one, and start afresh."""
        saved = self._pending_state
        if saved is None:
            return
        groups = list(saved["param_groups"])
        taken = {key for entry in groups for key in entry["params"]}
        fresh = (key for key in range(len(taken) + len(group["params"]) + 1) if key not in taken)
        entry = {key: value for key, value in group.items() if key != "params"}
        entry["params"] = [next(fresh) for _ in group["params"]]
        self._pending_state = {**saved, "param_groups": [*groups, entry]}
        self._pending = None  # validated again at the start
