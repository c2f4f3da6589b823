"""OffloadAdam: a ``torch.optim`` AdamW whose step runs in a worker process, overlapped with
the backward (ZeRO-Offload-style for plain PyTorch, speculative as SuperOffload).

The parameters are laid out in buckets (:mod:`._buckets`), each one sub-group of the
optimizer core's worker, with an fp32 master and gradient in shared memory. A
post-accumulate-grad hook takes each gradient as autograd produces it and submits a
bucket the moment it is complete, from the thread that runs the backward
(:mod:`._offloader`); ``step()``/``astep()`` submits what remains, validates the global
norm (speculation, :mod:`._offload_step`) and settles each bucket as it is done.
``step()`` blocks on the core; ``astep()`` awaits the same flow, and the loop wakes once
per burst of results.

fp32 CPU parameters *live in* the shared masters, their gradients in the shared grads:
the backward writes each gradient once, where the worker reads it, and the worker's step
lands in the parameters themselves, with no copy either way on the trainer's thread. So
they are written by the worker from the moment the backward sends their bucket until the
step returns, and their version counters move when the step settles. A checkpoint of
them is exact or fails loudly, never torn: a staging copy taken between steps holds back
the next backward's first send of that memory until it has ended, one taken during a
step is refused, and one fenced after the step fails its version check
(:mod:`aoffload._runtime.gate`). Other parameters (bf16/fp16, CUDA) keep a master of their
own, and change only inside ``step()``/``astep()``, by copies on the calling thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from ..._errors import ClosedError, OptimizerError
from ..._runtime.resource import State
from ..._runtime.threads import run_in_thread, running_future
from .._core import OptimizerCore
from .._results import Outcomes
from .._subgroups import BACKENDS
from .._waits import LoopWaits
from ._offloader import Offloader, Options
from ._state import FORMAT, Loaded, config_of, from_torch, packed_groups, to_torch
from ._step import OUTCOMES, Flow, StepReport, step_flow

__all__ = ["DEFAULT_BUCKET_MB", "OffloadAdam"]

DEFAULT_BUCKET_MB = 32.0
"""Bucket size in MiB of fp32. Not yet settled by measurement: ``python -m aoffload.bench
offload_adam`` compares 32, 4 and 1 MiB on a 21 MB model, and on the shared 2-core host it
ran on the differences were within the noise (see docs/offload_adam.md)."""


def _block(outcomes: Outcomes, need: object) -> None:
    if need is OUTCOMES:
        outcomes.wait(outcomes.has_next)
    elif isinstance(need, concurrent.futures.Future):
        concurrent.futures.wait([need])


def _drive(outcomes: Outcomes, flow: Flow, need: object = None) -> StepReport:
    """Run the step's flow to its end on this thread, blocking for what it waits on."""
    try:
        if need is None:
            need = next(flow)
        while True:
            _block(outcomes, need)
            need = flow.send(None)
    except StopIteration as stop:
        report: StepReport = stop.value
        return report


def _options(
    backend: str,
    bucket_mb: float,
    max_grad_norm: float | None,
    skip_nonfinite: bool,
    worker_cores: float | None,
    start_timeout: float,
    close_timeout: float,
) -> Options:
    if backend not in BACKENDS:
        raise OptimizerError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0:
        raise OptimizerError(f"bucket_mb must be a number > 0, got {bucket_mb!r}")
    if max_grad_norm is not None and not (
        isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0
    ):
        raise OptimizerError(f"max_grad_norm must be None or a number > 0, got {max_grad_norm!r}")
    if worker_cores is not None and not 0.0 < worker_cores <= 1.0:
        raise OptimizerError(f"worker_cores must be in (0, 1], got {worker_cores!r}")
    return Options(
        backend=backend,
        bucket_bytes=int(bucket_mb * (1 << 20)),
        max_grad_norm=None if max_grad_norm is None else float(max_grad_norm),
        skip_nonfinite=bool(skip_nonfinite),
        worker_cores=worker_cores,
        start_timeout=start_timeout,
        close_timeout=close_timeout,
    )


class OffloadAdam(torch.optim.Optimizer):
    """AdamW (``torch.optim.AdamW``'s math) stepped in a worker process, overlapped with the
    backward; a real :class:`torch.optim.Optimizer`.

    ``params``, ``lr``, ``betas``, ``eps`` and ``weight_decay`` are ``torch.optim.AdamW``'s
    (param groups with their own hyper-parameters; schedulers change ``lr``, and ``betas``,
    ``eps`` and ``weight_decay`` too, and the next step uses them). Start the worker with
    ``async with opt:`` (or ``await opt.start()`` / ``await opt.aclose()``) or, in
    synchronous code, ``with opt:`` (``opt.open()`` / ``opt.close()``). Then::

        loss.backward()      # each bucket's step is sent as soon as its gradients are in
        await opt.astep()    # or opt.step(): the rest, validated; parameters updated
        opt.zero_grad()

    ``backend``: ``"torch"`` (torch's fused AdamW kernel: bit-identical to
    ``torch.optim.AdamW(fused=True)``), ``"deepspeed"`` (DeepSpeed's CPU Adam) or
    ``"auto"`` (DeepSpeed when its op builds). ``bucket_mb``: the size of a bucket of
    parameters in MiB of fp32; the worker steps one bucket at a time, as soon as it is
    complete. ``max_grad_norm``: clip by the global 2-norm, as
    ``torch.nn.utils.clip_grad_norm_`` before the step would; ``skip_nonfinite``: skip a
    step whose gradients hold an inf or a nan (always, with ``max_grad_norm``). Either
    makes the steps speculative: each bucket steps as soon as it is complete, and is
    rolled back exactly and redone with scaled gradients (clipping) or undone (skipped)
    once the global norm is known; the worker then keeps a pre-step copy of each bucket
    (12 more bytes per parameter). ``worker_cores`` is :class:`~aoffload.CPUAdam`'s.

    Gradient accumulation: run every backward of a step but the last inside
    :meth:`no_sync` (the hooks then let autograd accumulate); the last backward submits.

    Memory and devices: every parameter has an fp32 master and an fp32 gradient in shared
    memory, and Adam's two fp32 moments live in the worker. An fp32 CPU parameter (one
    that is contiguous and alone in its storage) *is* its master from :meth:`start` on:
    its ``.data`` becomes a view of the worker's shared memory, and so does the
    ``.grad`` the backward makes, so no copy runs on the trainer's thread; the worker
    writes it from the moment the backward sends its bucket until the step returns.
    Other CPU parameters (bf16, fp16) get their new values copied in by the step; CUDA
    parameters send their gradients through pinned buffers on a side stream and get their
    values back the same way (the step does not wait for the device). The state
    (:meth:`state_dict`) has ``torch.optim.AdamW``'s layout and loads into either.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        backend: str = "auto",
        bucket_mb: float = DEFAULT_BUCKET_MB,
        max_grad_norm: float | None = None,
        skip_nonfinite: bool = False,
        worker_cores: float | None = None,
        start_timeout: float = 120.0,
        close_timeout: float = 30.0,
    ) -> None:
        options = _options(
            backend,
            bucket_mb,
            max_grad_norm,
            skip_nonfinite,
            worker_cores,
            start_timeout,
            close_timeout,
        )
        self._offloader: Offloader | None = None  # add_param_group runs before it exists
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": False,
            "maximize": False,
        }
        super().__init__(params, defaults)
        for index, group in enumerate(self.param_groups):
            config_of(index, group)
        self._offloader = Offloader(self.param_groups, options)
        self._life = State.NEW
        self._life_lock = threading.Lock()
        self._closing: concurrent.futures.Future[None] | None = None
        self._waits = LoopWaits()
        self._pending: Loaded | None = None  # a state loaded before start
        self._pending_state: Mapping[str, Any] | None = None
        self._last: StepReport | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Refused: an OffloadAdam owns a process; save :meth:`state_dict` instead."""
        raise TypeError("an OffloadAdam cannot be pickled or copied; save its state_dict()")

    @property
    def _off(self) -> Offloader:
        offloader = self._offloader
        if offloader is None:
            raise ClosedError("OffloadAdam is not initialised")  # only inside __init__
        return offloader

    # -- introspection -------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The worker's process id while it runs, else ``None``."""
        core = self._off.core
        return core.pid if core is not None and self._life is State.RUNNING else None

    @property
    def backend(self) -> str | None:
        """The backend the worker runs (``"torch"`` or ``"deepspeed"``) once started."""
        core = self._off.core
        return None if core is None else core.backend

    @property
    def last_step(self) -> StepReport | None:
        """What the last finished step did (its gradient norm, clipped, skipped)."""
        return self._last

    @property
    def max_grad_norm(self) -> float | None:
        """The clipping threshold given to the constructor."""
        return self._off.options.max_grad_norm

    # -- lifecycle -----------------------------------------------------------------------

    def _begin_start(self) -> None:
        with self._life_lock:
            if self._life is not State.NEW:
                raise ClosedError("this OffloadAdam was already started; create a new one")
            self._life = State.STARTING

    def _open(self) -> None:
        pending, self._pending, self._pending_state = self._pending, None, None
        self._off.start(pending)

    def _started(self) -> None:
        self._off.pin()
        with self._life_lock:
            self._life = State.RUNNING

    async def start(self) -> None:
        """Start the worker and register the buckets, off the event loop (``async with``)."""
        self._begin_start()
        self._waits.bind(asyncio.get_running_loop())
        try:
            await run_in_thread(self._open, name="aoffload-offload-adam-start")
        except BaseException:
            await self.aclose()
            raise
        self._started()

    def open(self) -> None:
        """Start the worker and register the buckets; blocking (``with opt:``)."""
        self._begin_start()
        try:
            self._open()
        except BaseException:
            self.close()
            raise
        self._started()

    def _begin_close(self) -> tuple[concurrent.futures.Future[None] | None, bool]:
        """(the close's future, whether this call runs it); ``None``: nothing to close."""
        with self._life_lock:
            if self._life is State.NEW:
                self._life = State.CLOSED
                return None, False
            if self._closing is not None:
                return self._closing, False
            self._closing = running_future()
            self._life = State.CLOSING
            return self._closing, True

    def _closed(self, closing: concurrent.futures.Future[None]) -> None:
        with self._life_lock:
            self._life = State.CLOSED
        closing.set_result(None)

    def close(self) -> None:
        """Stop the worker after the steps sent and remove the hooks; blocking, idempotent.

        The parameters keep their last published values; the optimizer state is gone (save
        :meth:`state_dict` first).
        """
        closing, mine = self._begin_close()
        if closing is None:
            return
        if not mine:
            closing.result()
            return
        try:
            self._off.close()
        finally:
            self._off.unpin()
            self._closed(closing)

    async def aclose(self) -> None:
        """:meth:`close` off the event loop; a cancelled wait still leaves no worker."""
        closing, mine = self._begin_close()
        if closing is None:
            return
        if not mine:
            await self._waits.done(closing)
            return
        try:
            await run_in_thread(self._off.close, name="aoffload-offload-adam-close")
        finally:
            core = self._off.core
            if core is not None:
                core.kill()  # cancelled: never leave the worker behind
            self._off.unpin()
            self._closed(closing)

    async def __aenter__(self) -> OffloadAdam:
        """``await start()``."""
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """``await aclose()``."""
        await self.aclose()

    def __enter__(self) -> OffloadAdam:
        """``open()``."""
        self.open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        """``close()``."""
        self.close()

    def _running_core(self) -> OptimizerCore:
        core = self._off.core
        if self._life is not State.RUNNING or core is None:
            raise ClosedError(
                f"this OffloadAdam is {self._life.value}; use it inside `async with opt:` or "
                "`with opt:` (or after start()/open()) and before it is closed"
            )
        return core

    # -- steps ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients: the backward passes inside submit nothing.

        Use it for every micro-batch of a step but the last (as with DDP's ``no_sync``);
        the last backward, outside it, submits each bucket as its gradients complete.
        """
        offloader = self._off
        previous, offloader.sync = offloader.sync, False
        try:
            yield
        finally:
            offloader.sync = previous

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``torch.optim``'s ``zero_grad``. Between the backward and the end of the step the
        worker may still read the gradients kept in shared memory: those are set to
        ``None`` then, never zeroed in place."""
        offloader = self._offloader
        if offloader is not None and offloader.running and offloader.in_step():
            offloader.let_go()
        super().zero_grad(set_to_none)

    def _take_unfinished(self) -> concurrent.futures.Future[object] | None:
        unfinished, self._off.unfinished = self._off.unfinished, None
        return unfinished

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Finish the step the backward began; block until the parameters are updated.

        Submits the buckets no hook submitted, validates the global gradient norm
        (clipping or skipping, if asked), waits for every bucket and copies the new values
        into the parameters. ``closure`` (re-evaluating the loss, with its backward) runs
        first, as in ``torch.optim``. Returns its loss; :attr:`last_step` says what the
        step did. Raises :class:`~aoffload.WorkerDiedError` if the worker died (never
        hangs), :class:`~aoffload.RemoteError` for a failed bucket, and the errors the
        hooks met (:class:`~aoffload.OptimizerError`), once nothing is in flight.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        outcomes = self._running_core().outcomes
        unfinished = self._take_unfinished()
        if unfinished is not None:
            unfinished.result()  # the step a cancelled astep() left: its error is raised here
        self._last = _drive(outcomes, step_flow(self._off))
        return loss

    async def astep(self) -> StepReport:
        """:meth:`step` for asyncio: the same flow, awaited, never blocking the loop.

        The results are recorded by the worker's reader thread while the loop is busy;
        the loop wakes once per burst. Returns what the step did (also :attr:`last_step`).

        Cancelling it lets the step finish first (the parameters must be updated before
        the next forward), then raises :class:`asyncio.CancelledError`. A second
        cancellation abandons the wait: the step finishes on a thread, and the next step
        and the next backward's hooks wait for it, but a forward run meanwhile would see
        parameters that the worker is still writing (or, for copied ones, their values
        of before the step).
        """
        outcomes = self._running_core().outcomes
        unfinished = self._take_unfinished()
        if unfinished is not None:
            await self._waits.done(unfinished)
            unfinished.result()
        flow = step_flow(self._off)
        need: object = None
        cancelled = False
        try:
            need = next(flow)
            while True:
                try:
                    if need is OUTCOMES:
                        await self._waits.until(outcomes, outcomes.has_next)
                    elif isinstance(need, concurrent.futures.Future):
                        await self._waits.done(need)
                except asyncio.CancelledError:
                    if cancelled:
                        self._finish_later(outcomes, flow, need)
                        raise
                    cancelled = True  # finish the step, then raise
                    continue
                need = flow.send(None)
        except StopIteration as stop:
            report: StepReport = stop.value
        self._last = report
        self._opt_called = True  # what torch's LR schedulers check to know a step ran
        if cancelled:
            raise asyncio.CancelledError
        return report

    def _finish_later(self, outcomes: Outcomes, flow: Flow, need: object) -> None:
        done: concurrent.futures.Future[object] = running_future()

        def finish() -> None:
            try:
                done.set_result(_drive(outcomes, flow, need))
            except BaseException as exc:  # noqa: BLE001 - raised by the next step
                done.set_exception(exc)

        self._off.unfinished = done
        threading.Thread(target=finish, name="aoffload-offload-adam-step", daemon=True).start()

    # -- param groups --------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (``torch.optim``'s checks and defaults); its parameters are
        bucketed and, while running, registered with the worker at once (blocking)."""
        super().add_param_group(param_group)
        offloader = self._offloader
        if offloader is None:
            return  # the constructor's own groups
        index = len(self.param_groups) - 1
        try:
            config_of(index, self.param_groups[index])
            if self._life not in (State.NEW, State.RUNNING):
                raise ClosedError("this OffloadAdam is closed")
            offloader.add_group(index)
        except BaseException:
            self.param_groups.pop()
            raise

    # -- state ---------------------------------------------------------------------------

    def _check_between_steps(self, what: str) -> None:
        if self._off.in_step():
            raise OptimizerError(
                f"{what} during a step (after the backward submitted buckets, before step() or "
                "astep() returned): call it between steps"
            )

    def _unstarted_state(self) -> dict[str, Any]:
        saved = self._pending_state
        return {
            "state": dict(saved["state"]) if saved is not None else {},
            "param_groups": packed_groups(self.param_groups),
            "offload": (
                saved.get("offload")
                if saved is not None and saved.get("offload") is not None
                else {"format": FORMAT, "backend": None, "kernel": None}
            ),
        }

    def state_dict(self) -> dict[str, Any]:
        """The state in ``torch.optim.AdamW``'s layout (see :mod:`._offload_state`); blocking.

        Covers every step finished; call it between steps. The moments are views of
        memory you own (later steps never change them). Before start: the state loaded
        (or none); after close: :class:`~aoffload.ClosedError`.
        """
        if self._life is State.NEW:
            return self._unstarted_state()
        core = self._running_core()
        self._check_between_steps("state_dict()")
        return to_torch(core.state_dict().result(), self._off.buckets, self.param_groups)

    async def astate_dict(self) -> dict[str, Any]:
        """:meth:`state_dict`, awaited: the snapshot is taken by the worker, off the loop."""
        if self._life is State.NEW:
            return self._unstarted_state()
        core = self._running_core()
        self._check_between_steps("astate_dict()")
        core_state = await self._waits.result(core.state_dict())
        return to_torch(core_state, self._off.buckets, self.param_groups)

    def _validate(self, state_dict: Mapping[str, Any]) -> Loaded:
        if self._life not in (State.NEW, State.RUNNING):
            raise ClosedError(f"this OffloadAdam is {self._life.value}")
        if self._life is State.RUNNING:
            self._check_between_steps("load_state_dict()")
        return from_torch(state_dict, self._off.buckets, self.param_groups)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state from :meth:`state_dict` or from ``torch.optim.AdamW``; blocking.

        Everything is checked first (:class:`~aoffload.OptimizerError`, nothing changed).
        The next step is bit-identical to the saved optimizer's (on the same backend).
        Before start, the state is kept and loaded when the worker starts. The groups'
        hyper-parameters are replaced, as ``torch.optim`` does.
        """
        loaded = self._validate(state_dict)
        if self._life is State.NEW:
            self._pending, self._pending_state = loaded, state_dict
        else:
            self._off.load(loaded)
        self._off.apply_groups(loaded)

    async def aload_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """:meth:`load_state_dict`, awaited: the worker loads the state off the loop."""
        loaded = self._validate(state_dict)
        if self._life is State.NEW:
            self._pending, self._pending_state = loaded, state_dict
        else:
            core = self._running_core()
            await self._waits.result(core.load_state_dict(loaded.core_state))
            self._off.loaded(loaded)
        self._off.apply_groups(loaded)
