"""The CPU optimizer's trainer side without an event loop: :class:`OptimizerCore`.

The core owns the worker (a :class:`~aoffload._runtime.core.WorkerCore`), the registry
of sub-groups, the record of every step's outcome and the state buffers. Every method
may be called from any thread: the event loop's, a backward hook's on autograd's thread,
a DeepSpeed adapter's. A step's reply is recorded by the worker core's reader thread the
moment it arrives; no loop turns for it. Two faces sit on this core:

* :class:`~aoffload.CPUAdam`, the asyncio face: its waits are watchers on the outcomes,
  and a burst of results wakes the loop at most once (through a ``LoopInbox``);
* :class:`~aoffload.deepspeed.SuperOffloadCPUOptimizer`, a synchronous face: it blocks on
  the core's conditions and futures, with no loop at all.

Blocking methods (:meth:`OptimizerCore.start`, :meth:`OptimizerCore.close`,
:meth:`OptimizerCore.drain`, the waits) are for threads that may block; the others never
wait for the worker. Pinning the trainer's CPUs (:meth:`OptimizerCore.pin`) must run on
the trainer's own thread: torch's thread count is kept per thread.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .._errors import ClosedError, OptimizerError
from .._runtime.core import WorkerCore
from .._runtime.threads import DaemonThreadExecutor, running_future
from ._affinity import Affinity, Split, plan_split
from ._builds import startup_timeout, tell_fallback
from ._results import Outcomes, Pending, StepKind, StepResult
from ._state import StateTransfer, parse
from ._subgroups import (
    Registry,
    SubGroup,
    check_options,
    check_registered,
    share,
    valid_lr,
    validate,
)
from .worker import TARGET
from .worker._calls import AdamConfig, GetInfo, GroupConfig, Hurry, Info, SetGroups, Settle, Step

__all__ = ["OptimizerCore"]

logger = logging.getLogger(__name__)


def _chain(source: concurrent.futures.Future[Any], target: concurrent.futures.Future[Any]) -> None:
    def copy(done: concurrent.futures.Future[Any]) -> None:
        error = done.exception()
        if error is None:
            target.set_result(done.result())
        else:
            target.set_exception(error)

    source.add_done_callback(copy)


class OptimizerCore:
    """Adam(W) in a worker process, driven from any thread; the faces' common core.

    ``groups`` are validated param groups; the other arguments are :class:`~aoffload.CPUAdam`'s,
    but ``side_by_side`` (OffloadAdam's: see :class:`~._calls.AdamConfig`)."""

    def __init__(
        self,
        groups: tuple[GroupConfig, ...],
        *,
        backend: str,
        worker_cores: float | None,
        exact_rollback: bool,
        close_timeout: float,
        side_by_side: bool = False,
    ) -> None:
        self.groups = groups
        self._side_by_side = side_by_side
        self._requested_backend = backend
        self._worker_cores = worker_cores
        self._exact = exact_rollback
        self._close_timeout = close_timeout
        self.worker: WorkerCore | None = None
        self.backend: str | None = None
        self.info: Info | None = None
        """What the worker said it runs, once started."""
        self.outcomes = Outcomes()
        self.registry = Registry()
        self._transfer = StateTransfer()
        self._affinity = Affinity()
        self._split: Split | None = None
        self._helper: DaemonThreadExecutor | None = None
        self._life = threading.Lock()  # start against close
        self._closed = False

    @classmethod
    def checked(cls, param_groups: Sequence[Mapping[str, object]], **options: Any) -> OptimizerCore:
        """A core for ``param_groups`` once they and ``options`` (``__init__``'s) are valid."""
        groups = check_options(param_groups, options["backend"], options["worker_cores"])
        return cls(groups, **options)

    # -- introspection -------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The worker's process id while it runs (not dead), else ``None``."""
        worker = self.worker
        return None if worker is None or worker.death is not None else worker.pid

    def check_running(self) -> WorkerCore:
        """The worker, if it can take calls; else its death, or :class:`ClosedError`."""
        worker = self.worker
        if worker is None:
            raise ClosedError("CPUAdam was never started")
        worker.check_running()
        return worker

    # -- lifecycle -----------------------------------------------------------------------

    def start(self, timeout: float) -> None:
        """Spawn the worker, wait until its backend is built (``timeout`` s); blocking.
        Raises :class:`~aoffload.WorkerStartupError`; the caller then runs :meth:`close`."""
        with self._life:
            if self._closed:
                raise ClosedError("CPUAdam was closed while it started")
            self._split = split = plan_split(self._worker_cores)
            config = AdamConfig(
                groups=self.groups,
                backend=self._requested_backend,
                exact_rollback=self._exact,
                cores=split.worker,
                threads=split.threads,
                side_by_side=self._side_by_side,
            )
            worker = WorkerCore(TARGET, config, name="cpu-adam", close_timeout=self._close_timeout)
            self.worker = worker
            worker.spawn()
            # Started here, off the loop: a thread's start waits until the OS runs it.
            self._helper = DaemonThreadExecutor("aoffload-cpu-adam-helper")
        try:
            worker.ready.result(timeout)
        except concurrent.futures.TimeoutError:
            building = startup_timeout(timeout, self._requested_backend, worker.pid)
            raise (building or worker.startup_timeout(timeout)) from None
        info = worker.request(GetInfo())
        self.info = info
        self.backend = info.backend
        if info.fallback is not None:
            tell_fallback(info.fallback)
        trainer = split.trainer if split.worker is not None else "unpinned"
        logger.info("CPUAdam worker (pid %s): %s, trainer cores %s", worker.pid, info, trainer)

    def pin(self) -> None:
        """Pin the trainer to its side of the CPU split (none unless asked); on its thread."""
        if self._split is not None:
            self._affinity.apply(self._split)

    def unpin(self) -> None:
        """Put the trainer's CPU affinity and torch thread count back; on its thread."""
        self._affinity.restore()

    def close(self) -> None:
        """Stop the worker after the steps already sent, then free everything; blocking.
        Results not consumed are dropped, steps never answered fail with :class:`ClosedError`;
        no process, thread or state buffer outlives it (the params are the caller's)."""
        with self._life:
            self._closed = True
            worker = self.worker
        self.outcomes.close(None if worker is None else worker.death)
        try:
            if worker is not None:
                worker.stop()
        finally:
            if worker is not None:
                worker.release()  # fails what is left, so a helper waiting on a reply ends
            if self._helper is not None:
                self._helper.shutdown(wait=True)
            self.registry.clear()
            self._transfer.clear()

    def kill(self) -> None:
        """SIGKILL the worker unless it has exited (a cancelled close must not leave it)."""
        worker = self.worker
        if worker is not None and not worker.exited.done():
            worker.kill()

    def _helper_thread(self) -> DaemonThreadExecutor:
        with self._life:
            if self._closed:
                raise ClosedError("CPUAdam is closed")
            if self._helper is None:
                self._helper = DaemonThreadExecutor("aoffload-cpu-adam-helper")
            return self._helper

    # -- steps ---------------------------------------------------------------------------

    def submit(
        self,
        key: tuple[int, int],
        param: torch.Tensor,
        grad: torch.Tensor,
        lr: float | None = None,
        rollback: bool = False,
    ) -> None:
        """Queue one step of sub-group ``key`` (``(group_id, subgroup_id)``; see
        :meth:`CPUAdam.submit`); from any thread, never blocks."""
        worker = self.check_running()
        registry = self.registry
        registry.check_not_loading()
        group_id, subgroup_id = key
        sub = registry.subgroups.get(key)
        register: concurrent.futures.Future[None] | None = None
        copy: torch.Tensor | None = None
        if sub is not None and sub.same(param, grad) and (lr is None or valid_lr(lr)):
            param_t = sub.param  # the steady state: nothing to check, nothing to copy
        else:
            param_t, grad_t = validate(
                len(self.groups), registry.subgroups, group_id, subgroup_id, param, grad, lr
            )
            if sub is None:
                registry.check_loaded(group_id, subgroup_id, param_t)
                share(param_t, grad_t)
                sub, register = registry.register(worker, key, param_t, grad_t)
                if register is None:  # another thread registered it meanwhile
                    check_registered(sub, group_id, subgroup_id, param_t)
            if register is None and not sub.is_grad(grad_t):
                copy = grad_t
        step = Step(group_id, subgroup_id, None if lr is None else float(lr), bool(rollback))
        kind = StepKind.ROLLBACK if rollback else StepKind.STEP
        self._send(worker, sub, step, Pending(group_id, subgroup_id, kind, param_t, register), copy)

    def _send(
        self,
        worker: WorkerCore,
        sub: SubGroup,
        step: Step,
        pending: Pending,
        copy: torch.Tensor | None,
    ) -> None:
        outcomes = self.outcomes

        def on_done(done: object, error: BaseException | None) -> None:  # the reader thread
            with outcomes.lock:
                sub.in_flight -= 1
                outcomes.finish_locked(pending, done, error)
                fired = outcomes.ready_locked()
            if fired:
                outcomes.fire(fired)

        with outcomes.lock:
            if copy is not None and sub.in_flight:
                raise OptimizerError(
                    f"sub-group {step.subgroup_id} of group {step.group_id} has a step in "
                    "flight; pass its registered grad tensor, or wait for the result before "
                    "passing another"
                )
            sub.in_flight += 1  # reserved: no other grad is copied in until it is answered
            outcomes.in_flight += 1
        try:
            if copy is not None:
                sub.grad_buffer.copy_(copy)
            # Not under the lock: a write to a full pipe waits for the worker, whose
            # replies wait for the reader thread, which takes the lock.
            worker.submit_callback(step, on_done)
        except BaseException:
            with outcomes.lock:
                sub.in_flight -= 1
                outcomes.in_flight -= 1
                fired = outcomes.ready_locked()
            outcomes.fire(fired)
            raise

    def hurry(self) -> None:
        """Tell the worker that the trainer now waits for the steps it sent (OffloadAdam's
        worker then steps them on every core); from any thread, never blocks."""
        self._tell(Hurry())

    def settle(self) -> None:
        """Tell the worker that every step sent is final (OffloadAdam's worker then copies
        the moments for the next step's backup in the background); never blocks."""
        self._tell(Settle())

    def _tell(self, call: Hurry | Settle) -> None:
        worker = self.check_running()

        def answered(_: object, error: BaseException | None) -> None:  # the reader thread
            if error is not None:
                logger.warning("the CPU Adam worker could not take a %s: %s", call, error)

        worker.submit_callback(call, answered)

    def set_groups(self, groups: tuple[GroupConfig, ...]) -> concurrent.futures.Future[None]:
        """Replace the groups' hyper-parameters (or add groups) for the steps sent after this;
        from any thread, never blocks. Fewer groups than now is an error. The future is
        answered before any step sent after it."""
        worker = self.check_running()
        if len(groups) < len(self.groups):
            raise OptimizerError(f"cannot drop param groups ({len(self.groups)} -> {len(groups)})")
        done = worker.submit(SetGroups(groups))
        self.groups = groups
        return done

    def wait_subgroup(self, key: tuple[int, int], timeout: float | None = None) -> bool:
        """Block until sub-group ``key`` has no step in flight; whether it has none."""
        sub = self.registry.subgroups.get(key)
        if sub is None:
            return True
        return self.outcomes.wait(lambda: not sub.in_flight, timeout)

    def drain(self, timeout: float | None = None) -> list[StepResult]:
        """Block until no step is in flight, then :meth:`~._results.Outcomes.collect`."""
        if not self.outcomes.wait(self.outcomes.idle, timeout):
            raise TimeoutError(f"CPUAdam steps still in flight after {timeout} s")
        return self.outcomes.collect()

    # -- registration and state ----------------------------------------------------------

    def register(
        self,
        group_id: int,
        subgroup_id: int,
        param: torch.Tensor,
        grad: torch.Tensor,
        pieces: tuple[tuple[int, int], ...] = (),
    ) -> concurrent.futures.Future[None]:
        """Move ``param`` and ``grad`` to shared memory on the helper thread and register
        them; the future resolves once the worker holds them. Checks run here, first.
        ``pieces``: see :class:`~._calls.Register`."""
        self.check_running()
        registry = self.registry
        param_t, grad_t = validate(
            len(self.groups), registry.subgroups, group_id, subgroup_id, param, grad, None
        )
        done: concurrent.futures.Future[None] = running_future()
        if (group_id, subgroup_id) in registry.subgroups:
            done.set_result(None)
            return done
        registry.check_loaded(group_id, subgroup_id, param_t)
        registry.check_not_loading()

        def job() -> None:
            try:
                share(param_t, grad_t)
                worker = self.check_running()
                _, call = registry.register(
                    worker, (group_id, subgroup_id), param_t, grad_t, pieces
                )
            except BaseException as exc:  # noqa: BLE001 - handed to whoever awaits the future
                done.set_exception(exc)
                return
            if call is None:
                done.set_result(None)
            else:
                _chain(call, done)

        self._helper_thread().submit(job)
        return done

    def state_dict(self) -> concurrent.futures.Future[dict[str, Any]]:
        """The future of the state after every step sent before this call (see
        :meth:`CPUAdam.state_dict`); built on the reader thread when the reply arrives."""
        return self._transfer.snapshot(self.check_running(), self.registry)

    def load_state_dict(self, state_dict: object) -> concurrent.futures.Future[None]:
        """Check ``state_dict`` here (raising :class:`OptimizerError`, changing nothing),
        then load it on the helper thread; submits and registrations are refused until the
        returned future is done."""
        worker = self.check_running()
        registry = self.registry
        with registry.lock:
            if registry.loading:
                raise OptimizerError("another load_state_dict() is in progress")
            registered = registry.numels()
            plan = parse(state_dict, len(self.groups), registered)
            registry.loading = True
        done: concurrent.futures.Future[None] = running_future()

        def job() -> None:
            try:
                self._transfer.load(worker, plan)
                with registry.lock:
                    registry.loaded = {
                        (gid, sid): numel
                        for gid, sid, numel, *_ in plan.entries
                        if (gid, sid) not in registered
                    }
                    self.groups = plan.groups
            finally:
                registry.loading = False

        try:
            _chain(self._helper_thread().submit(job), done)
        except BaseException:
            registry.loading = False
            raise
        return done
