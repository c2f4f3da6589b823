"""OffloadAdam: a ``torch.optim`` AdamW whose step runs in a worker process, overlapped with
the backward (ZeRO-Offload-style for plain PyTorch, speculative as SuperOffload).

The face only: the worker, the buckets and the hooks are the offloader's
(:mod:`._offloader`, :mod:`._hooks`, :mod:`._buckets`: fp32 CPU parameters *live in* the
worker's shared memory, and checkpoints of them are exact or fail loudly), a step is a
flow (:mod:`._step`) that ``step()`` drives blocking and ``astep()`` awaits
(:mod:`._drive`), and the worker's lifecycle and the state kept between its lives are
:mod:`._life`'s.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from ..._errors import ClosedError, OptimizerError
from ..._runtime.resource import State
from .._waits import LoopWaits
from ._drive import adrive, drive
from ._life import Life
from ._offloader import Offloader
from ._options import DEFAULT_BUCKET_MB, Options
from ._state import Loaded, config_of, from_torch, to_torch
from ._step import Amp, StepReport, step_flow

__all__ = ["DEFAULT_BUCKET_MB", "OffloadAdam"]

logger = logging.getLogger(__name__)


class OffloadAdam(torch.optim.Optimizer):
    """AdamW (``torch.optim.AdamW``'s math) stepped in a worker process, overlapped with the
    backward; a real :class:`torch.optim.Optimizer`, for a plain synchronous loop::

        opt = aoffload.OffloadAdam(model.parameters(), lr=1e-3)
        with opt:                # starts the worker (or opt.start() ... opt.close())
            for batch in data:
                loss = model(batch).loss
                loss.backward()  # each bucket's step is sent as soon as its gradients are in
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # allowed: exact
                opt.step()       # the rest; parameters updated in place
                opt.zero_grad()
        torch.save(opt.state_dict(), "optim.pt")  # works after the block too

    In asyncio code: ``async with opt:`` (``await opt.astart()`` / ``await opt.aclose()``)
    and ``await opt.astep()``, which never blocks the loop. A closed optimizer keeps its
    state and can be started again (alternating train and eval blocks): the next step is
    the one an unbroken run would take.

    ``params``, ``lr``, ``betas``, ``eps`` and ``weight_decay`` are ``torch.optim.AdamW``'s
    (param groups with their own hyper-parameters; schedulers change ``lr``, and ``betas``,
    ``eps`` and ``weight_decay`` too, and the next step uses them).

    ``backend``: ``"torch"`` (torch's fused AdamW kernel: bit-identical to
    ``torch.optim.AdamW(fused=True)``), ``"deepspeed"`` (DeepSpeed's CPU Adam, built on
    first use: a minute or two, logged) or ``"auto"`` (DeepSpeed's op when it is already
    built and proven, else the torch backend: it never builds, and says which it picked).
    ``bucket_mb``: the size of a bucket of parameters in MiB of fp32; the worker steps one
    bucket at a time, as soon as it is complete. ``worker_cores`` is
    :class:`~aoffload.CPUAdam`'s.

    **Gradients edited before the step** (``clip_grad_norm_``, ``GradScaler``, a hand-made
    ``p.grad.mul_(...)``) give exactly what ``torch.optim.AdamW(fused=True)`` gives after
    the same edit (bit for bit with ``backend="torch"``), only slower: the backward has
    already sent the buckets, so each bucket whose gradients changed is rolled back exactly
    and stepped again (:attr:`StepReport.redone`), after the backward instead of during it.
    ``GradScaler`` works through ``scaler.step(opt)`` (a step it finds an inf or a nan in
    is skipped). The fast path for clipping is ``max_grad_norm``: clip by the global 2-norm
    as ``clip_grad_norm_`` before the step would, redoing buckets only when the norm is
    over it. ``skip_nonfinite``: skip a step whose gradients hold an inf or a nan (always,
    with ``max_grad_norm``). The worker keeps an exact pre-step copy of every bucket for
    this (12 bytes per parameter, on top of the moments' 8).

    Gradient accumulation: run every backward of a step but the last inside
    :meth:`no_sync` (the hooks then let autograd accumulate); the last backward submits.

    Memory and devices: every parameter has an fp32 master and an fp32 gradient in shared
    memory, and Adam's two fp32 moments live in the worker. An fp32 CPU parameter (one
    that is contiguous and alone in its storage) *is* its master while the worker runs:
    its ``.data`` becomes a view of the worker's shared memory, and so does the ``.grad``
    the backward makes, so no copy runs on the trainer's thread; the worker writes it from
    the moment the backward sends its bucket until the step returns, and closing gives it
    memory of its own again. Other CPU parameters (bf16, fp16) get their new values copied
    in by the step; CUDA parameters send their gradients through pinned buffers on a side
    stream and get their values back the same way (the step does not wait for the device).
    The state (:meth:`state_dict`) has ``torch.optim.AdamW``'s layout and loads into either.
    """

    _step_supports_amp_scaling = True
    """``GradScaler.step`` calls :meth:`step` itself, with ``found_inf`` and ``grad_scale``
    set (see :mod:`._step`): an optimizer that has already stepped cannot be skipped by not
    being called."""

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
        options = Options.checked(
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
        self._waits = LoopWaits()
        self._life = Life(self._offloader, self.param_groups, self._waits)
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
        return core.pid if core is not None and self._life.state is State.RUNNING else None

    @property
    def backend(self) -> str | None:
        """The backend the worker runs (``"torch"`` or ``"deepspeed"``) once started."""
        core = self._off.core
        return None if core is None else core.backend

    @property
    def last_step(self) -> StepReport | None:
        """What the last finished step did (its gradient norm, clipped, skipped, redone)."""
        return self._last

    @property
    def max_grad_norm(self) -> float | None:
        """The clipping threshold given to the constructor."""
        return self._off.options.max_grad_norm

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker and register the buckets; blocking (``with opt:``).

        A closed optimizer starts again with the state it kept. In asyncio code use
        ``async with opt:`` or ``await opt.astart()``.
        """
        self._life.start()

    async def astart(self) -> None:
        """:meth:`start`, awaited: the start runs on a thread (``async with opt:``).

        Cancelling the await abandons the wait; the start runs on, and the optimizer is
        closed when it has ended.
        """
        await self._life.astart()

    def close(self) -> None:
        """Stop the worker after the steps sent and remove the hooks; blocking, idempotent.

        The optimizer keeps its state (:meth:`state_dict`, and the next :meth:`start`
        continues from it); a step begun by a backward and not finished is undone. The
        parameters keep their last values, in memory of their own.
        """
        self._life.close()

    async def aclose(self) -> None:
        """:meth:`close`, awaited: the close runs on a thread. Cancelling the await
        abandons the wait only: the close runs to its end."""
        await self._life.aclose()

    async def __aenter__(self) -> OffloadAdam:
        """``await astart()``."""
        await self.astart()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """``await aclose()``."""
        await self.aclose()

    def __enter__(self) -> OffloadAdam:
        """``start()``."""
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        """``close()``."""
        self.close()

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

        Submits the buckets no hook submitted, redoes those whose gradients changed since
        they were sent, validates the global gradient norm (clipping or skipping, if
        asked), waits for every bucket and publishes the new values. ``closure``
        (re-evaluating the loss, with its backward) runs first, as in ``torch.optim``.
        Returns its loss; :attr:`last_step` says what the step did. Raises
        :class:`~aoffload.WorkerDiedError` if the worker died (never hangs),
        :class:`~aoffload.RemoteError` for a failed bucket, and the errors the hooks met
        (:class:`~aoffload.OptimizerError`), once nothing is in flight.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        outcomes = self._life.running_core().outcomes
        unfinished = self._take_unfinished()
        if unfinished is not None:
            unfinished.result()  # the step a cancelled astep() left: its error is raised here
        self._last = drive(outcomes, step_flow(self._off, Amp.of(self)))
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
        outcomes = self._life.running_core().outcomes
        unfinished = self._take_unfinished()
        if unfinished is not None:
            await self._waits.done(unfinished)
            unfinished.result()
        flow = step_flow(self._off, Amp.of(self))
        return await adrive(self._waits, outcomes, flow, self._finished, self._abandoned)

    def _finished(self, report: StepReport) -> None:
        self._last = report
        self._opt_called = True  # what torch's LR schedulers check to know a step ran

    def _abandoned(self, unfinished: concurrent.futures.Future[StepReport]) -> None:
        self._off.unfinished = unfinished  # type: ignore[assignment]

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
            state = self._life.state
            if state not in (State.NEW, State.RUNNING, State.CLOSED):
                raise ClosedError(f"this OffloadAdam is {state.value}")
            offloader.add_group(index)
        except BaseException:
            self.param_groups.pop()
            raise
        if state is not State.RUNNING:
            self._life.added_group(self.param_groups[index])

    # -- state ---------------------------------------------------------------------------

    def _check_between_steps(self, what: str) -> None:
        if self._off.in_step():
            raise OptimizerError(
                f"{what} during a step (after the backward submitted buckets, before step() or "
                "astep() returned): call it between steps"
            )

    def state_dict(self) -> dict[str, Any]:
        """The state in ``torch.optim.AdamW``'s layout (see :mod:`._state`); blocking.

        Covers every step finished; call it between steps. The moments are views of
        memory you own (later steps never change them). Outside its block (before the
        first start, after a close) it is the state kept (or loaded), without a worker.
        """
        kept = self._life.kept_state()
        if kept is not None:
            return kept
        core = self._life.running_core()
        self._check_between_steps("state_dict()")
        return to_torch(core.state_dict().result(), self._off.buckets, self.param_groups)

    async def astate_dict(self) -> dict[str, Any]:
        """:meth:`state_dict`, awaited: the snapshot is taken by the worker, off the loop."""
        kept = self._life.kept_state()
        if kept is not None:
            return kept
        core = self._life.running_core()
        self._check_between_steps("astate_dict()")
        core_state = await self._waits.result(core.state_dict())
        return to_torch(core_state, self._off.buckets, self.param_groups)

    def _validate(self, state_dict: Mapping[str, Any]) -> Loaded:
        state = self._life.state
        if state not in (State.NEW, State.RUNNING, State.CLOSED):
            raise ClosedError(f"this OffloadAdam is {state.value}")
        if state is State.RUNNING:
            self._check_between_steps("load_state_dict()")
        return from_torch(state_dict, self._off.buckets, self.param_groups)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state from :meth:`state_dict` or from ``torch.optim.AdamW``; blocking.

        Everything is checked first (:class:`~aoffload.OptimizerError`, nothing changed).
        The next step is bit-identical to the saved optimizer's (on the same backend).
        Outside its block, the state is kept and loaded when the worker starts. The
        groups' hyper-parameters are replaced, as ``torch.optim`` does.
        """
        loaded = self._validate(state_dict)
        if self._life.state is State.RUNNING:
            self._off.load(loaded)
        else:
            self._life.keep(loaded, state_dict)
        self._off.apply_groups(loaded)

    async def aload_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """:meth:`load_state_dict`, awaited: the worker loads the state off the loop."""
        loaded = self._validate(state_dict)
        if self._life.state is State.RUNNING:
            core = self._life.running_core()
            await self._waits.result(core.load_state_dict(loaded.core_state))
            self._off.loaded(loaded)
        else:
            self._life.keep(loaded, state_dict)
        self._off.apply_groups(loaded)
