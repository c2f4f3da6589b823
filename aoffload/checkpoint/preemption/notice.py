"""A preemption notice: every rank saves at one step, once any rank got a preemption signal.

:meth:`~aoffload.CheckpointEngine.preemption` makes one :class:`PreemptionNotice` per engine.
Its signal handlers (:mod:`.._runtime.signals`) only take note, on the main thread, as soon as
it runs Python again, even in the middle of a synchronous step. ``await notice.reached(step)``
reads what was noted; without a notice it is a lock and two comparisons: no collective, no
network traffic, no suspension.

**One process** (no ranks): ``reached(step)`` is True from the first call after the signal.

**Several ranks** (``distributed=True``): the ranks agree on the first step every rank can
still reach, on the notice's threads (:mod:`.agreement`), never on the event loop. A rank
is *frozen* once it knows of a notice (its own signal, seen by its next ``reached()``, or a
peer's, seen by its watcher): from then on ``reached()`` never answers False before the
agreement, which it may wait for a moment. Every rank then answers True from the agreed step
on, so the ranks must call ``reached()`` with the same steps, in order.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Iterable
from signal import SIGKILL, SIGSTOP, Signals
from typing import TYPE_CHECKING

from ..._errors import ClosedError, InvalidStateError
from ..._runtime import signals as _signals
from ..._runtime.handle import Handle
from ..._runtime.threads import mark_retrieved, running_future
from .agreement import Agreement

if TYPE_CHECKING:
    from ..meet.rendezvous import Rendezvous

__all__ = ["PreemptionNotice", "signal_set"]

logger = logging.getLogger(__name__)


def signal_set(signals: Iterable[int]) -> tuple[Signals, ...]:
    """``signals`` as :class:`signal.Signals`, once each; SIGKILL and SIGSTOP are refused."""
    chosen = tuple(dict.fromkeys(Signals(signum) for signum in signals))
    for signum in chosen:
        if signum in (SIGKILL, SIGSTOP):
            raise InvalidStateError(f"{signum.name} cannot be caught: it cannot give notice")
    return chosen


class PreemptionNotice:
    """Tells every rank at which step to save, once any rank got a preemption signal.

    Made by :meth:`CheckpointEngine.preemption`; see there. ``await notice.reached(step)``
    is True on every rank at the same step; :attr:`requested` tells whether a signal
    reached this rank; :meth:`request` gives notice without a signal.
    """

    def __init__(self, signals: Iterable[int], rendezvous: Rendezvous | None) -> None:
        self.signals: tuple[Signals, ...] = signal_set(signals)
        """The signals this notice listens for."""
        self._rank = None if rendezvous is None else rendezvous.rank
        self._lock = threading.Lock()  # reached() and the watcher; never the signal handler
        self._requested = False
        self._signal: int | None = None
        self._seen: int | None = None  # the last step asked about
        self._last: int | None = None  # the last step answered False
        self._frozen = False
        self._agreed = False
        self._step: int | None = None
        self._agreement: concurrent.futures.Future[int | None] = running_future()
        self._agreement.add_done_callback(mark_retrieved)
        self._closed = False
        self._ranks = None if rendezvous is None else Agreement(rendezvous, self)

    # -- what the trainer reads ---------------------------------------------------------

    @property
    def requested(self) -> bool:
        """Whether a signal (or :meth:`request`) reached this rank."""
        return self._requested

    @property
    def signal(self) -> Signals | None:
        """The first signal that reached this rank, or ``None``."""
        return None if self._signal is None else Signals(self._signal)

    @property
    def step(self) -> int | None:
        """The step every rank saves at, once agreed (``None`` before)."""
        return self._step

    def request(self) -> None:
        """Give notice on this rank as a signal would (from any thread, or a handler of yours).

        For notices that do not come as signals (a cloud's metadata endpoint), and for a
        trainer whose loop runs off the main thread (``preemption(signals=())``, then call
        this from a handler installed on the main thread).
        """
        self._note(None)

    def reached(self, step: int) -> Handle[bool]:
        """Whether to save at ``step`` and stop: True on every rank at the same step.

        A :class:`~aoffload.Handle` of the answer: ``if await notice.reached(step):`` in
        asyncio code, ``if notice.reached(step).result():`` in a synchronous loop. Call it
        once per step on every rank with the same increasing steps. Without a notice the
        answer is there at once (awaiting it does not suspend). Once any rank was signalled
        it is True from the first step every rank can still reach (on a single process: at
        once); it may wait for the ranks' agreement for a moment, off the loop. Raises
        :class:`~aoffload.CheckpointError` when the ranks cannot agree (a rank died, closed
        its engine, or did not call ``preemption()``); :class:`~aoffload.ClosedError` once
        the engine closed.
        """
        answer = self._answer(step)
        if answer is not None:
            return Handle.of(answer)
        return Handle(self._agreement, then=lambda _: self._agreed_at(step))

    def _agreed_at(self, step: int) -> bool:
        answer = self._answer(step)
        if answer is None:  # pragma: no cover - agreed() is set before the future
            raise RuntimeError("the preemption agreement resolved without a step")
        return answer

    def _answer(self, step: int) -> bool | None:
        """The answer for ``step`` now; ``None``: wait for the ranks to agree."""
        if isinstance(step, bool) or not isinstance(step, int):
            raise InvalidStateError(f"reached() takes the step as an int, not {step!r}")
        if self._closed:
            raise ClosedError("the checkpoint engine of this preemption notice is closed")
        error = self._agreement.exception() if self._agreement.done() else None
        if error is not None:
            raise error
        with self._lock:
            if self._seen is not None and step < self._seen:
                raise InvalidStateError(
                    f"reached({step}) after reached({self._seen}): steps must not go back"
                )
            self._seen = step
            if self._agreed:
                if self._step is None:  # no rank had been asked yet: this first step it is
                    self._step = step
                return step >= self._step
            if self._requested:
                if self._ranks is None:
                    self._agreed, self._step = True, step
                    logger.info("preemption notice (%s): saving at step %d", self.why, step)
                    return True
                self._frozen = True  # this rank knows: it waits for the agreement from now on
            if self._frozen:
                return None
            self._last = step
            return False

    @property
    def why(self) -> str:
        """Who gave notice on this rank, and how (for messages)."""
        how = self.signal.name if self.signal is not None else "request()"
        return how if self._rank is None else f"rank {self._rank}: {how}"

    # -- the notice (a signal handler's, on the main thread: no lock, no I/O) ------------

    def signalled(self, signum: int) -> None:
        """Take note of ``signum`` (:class:`~.._runtime.signals.Listener`)."""
        self._note(signum)

    def _note(self, signum: int | None) -> None:
        if self._requested or self._closed:  # also keeps a nested handler out of the Event
            return
        self._signal = signum
        self._requested = True
        if self._ranks is not None:
            self._ranks.notice()

    # -- the agreement's side (:class:`~.agreement.Party`) --------------------------------

    def freeze(self) -> int | None:
        """Stop answering False; the last step answered False."""
        with self._lock:
            self._frozen = True
            return self._last

    def agreed(self, step: int | None) -> None:
        """Every rank saves at ``step`` (``None``: the first step each is asked about)."""
        with self._lock:
            self._agreed, self._step = True, step
        if not self._agreement.done():
            self._agreement.set_result(step)

    def failed(self, error: BaseException) -> None:
        """The ranks cannot agree: ``reached()`` raises ``error`` from now on."""
        if not self._agreement.done():
            self._agreement.set_exception(error)

    # -- lifecycle (the engine) -----------------------------------------------------------

    def start(self) -> None:
        """Install the handlers (on the main thread) and, with ranks, start the threads."""
        try:
            _signals.listen(self, self.signals)
        except RuntimeError:
            raise InvalidStateError(
                "engine.preemption(signals=...) installs signal handlers, which Python allows "
                "on the main thread only; off it, use preemption(signals=()) and call "
                "notice.request() from a handler installed on the main thread"
            ) from None
        if self._ranks is not None:
            self._ranks.start()

    def uninstall(self) -> None:
        """Restore the handlers installed before (needs the main thread: see ``signals``)."""
        _signals.unlisten(self)

    def close(self) -> None:
        """Stop listening and end the threads (blocking, briefly); idempotent."""
        if self._closed:
            return
        self._closed = True  # first: a handler running from now on returns at once
        self.uninstall()
        if self._ranks is not None:
            self._ranks.close()
        self.failed(ClosedError("the checkpoint engine closed before the ranks agreed"))
