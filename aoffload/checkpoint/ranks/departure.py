"""How a rank's departure reaches the other ranks at once, whether it closes or dies.

A peer must never wait ``commit_timeout`` for a rank that is gone. So:

- while it runs, a rank keeps its writer *armed* (:meth:`Departure.arm`): if the trainer
  dies, the writer, which outlives it by a moment, sets the outcome of the commit in
  flight and the next one to "rank r's trainer died" (``writer/watch.py``; the trainer
  chose the keys and the words, the writer knows nothing of the protocol);
- an orderly close first *disarms* the writer (:meth:`Departure.disarm`), then, once the
  writer stopped, says goodbye (:meth:`Departure.leave`): a rank that leaves work undone
  (or whose writer died) sets that outcome to why; rank 0 keeps the store up until the
  last commit's acknowledgements arrive, at most ``_ACK_SECONDS``.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

import torch.distributed as dist

from ..._errors import AoffloadError, first_line
from ..meet.keys import Keys
from ..meet.reports import Failure, encode
from ..writer.calls import WatchRank

if TYPE_CHECKING:
    from ..._runtime.core import WorkerCore
    from ..meet.rendezvous import Rendezvous

__all__ = ["Departure"]

logger = logging.getLogger(__name__)

_ACK_SECONDS = 10.0
"""How long rank 0's close keeps the store up for the others to read the last result."""


def _ignore(value: object, error: BaseException | None) -> None:
    """A watch needs no answer (a dead writer fails it; the close says so)."""


class Departure:
    """This rank's last word to the others, said by its writer or by its close."""

    def __init__(self, rendezvous: Rendezvous, writer: WorkerCore | None) -> None:
        self._meet = rendezvous
        self._writer = writer

    def arm(self, n: int) -> None:
        """Arm the writer: if this trainer dies before commit ``n`` or the one after ends,
        the writer fails them on every rank; a replica has no writer to say it."""
        writer, run = self._writer, self._meet.run
        if writer is None or not run:
            return
        host, port = self._meet.address
        outcomes = (Keys.commit(run, n).outcome, Keys.commit(run, n + 1).outcome)
        why = f"its trainer process died (its checkpoint writer, pid {writer.pid}, saw it go)"
        call = WatchRank(host, port, outcomes, encode(Failure(self._meet.rank, why)))
        with contextlib.suppress(AoffloadError):  # a dead writer: the commit reports it
            writer.submit_callback(call, _ignore)

    def disarm(self) -> None:
        """An orderly close: the writer stops without speaking for this rank."""
        writer = self._writer
        if writer is None or writer.pid is None or writer.death is not None:
            return  # never started (a failed start), or gone
        with contextlib.suppress(AoffloadError):
            writer.submit_callback(WatchRank(), _ignore)

    def leave(self, n: int, *, settled: bool, unfinished: str | None, last_ok: int | None) -> None:
        """Say goodbye (once the writer stopped), keep the store up for the others' last
        read, leave (blocking). ``n`` is the commit in flight or the next one; ``settled``:
        every commit of this rank succeeded."""
        died = self._writer is not None and self._writer.death is not None
        self._meet.leave(lambda: self._farewell(n, settled and not died, died, unfinished, last_ok))

    def _farewell(
        self, n: int, settled: bool, writer_died: bool, unfinished: str | None, last_ok: int | None
    ) -> None:
        meet = self._meet
        if meet.rank != 0 and settled and unfinished is None:
            # The usual end: every commit of this rank succeeded and nothing is left
            # undone. Rank 0 may have closed its store already; leave quietly (a rank
            # that fails says so, below).
            return
        if writer_died:
            why = "its checkpoint writer died"
        elif unfinished is not None:
            why = f"it closed its engine: {unfinished}"
        else:
            why = "it closed its engine"
        if not meet.store_alive():  # rank 0 closed first (the usual order) or died
            logger.debug("closing: the commit store is gone; rank %d leaves (%s)", meet.rank, why)
            return
        try:
            meet.claim(Keys.commit(meet.run, n).outcome, encode(Failure(meet.rank, why)))
        except dist.DistError as exc:  # rank 0 closed first (the usual order) or died
            logger.debug("closing: the commit store is gone (%s)", first_line(exc))
            return
        if meet.rank == 0 and last_ok is not None:
            try:
                meet.wait_acks(Keys.commit(meet.run, last_ok), _ACK_SECONDS)
            except dist.DistError as exc:
                logger.warning(
                    "closing: not every rank acknowledged the last checkpoint within %s s "
                    "(%s); a rank that was still reading it reports a lost store",
                    _ACK_SECONDS,
                    first_line(exc),
                )
