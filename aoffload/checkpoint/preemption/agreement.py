"""How the ranks agree on the step to save at, once any of them got a preemption notice.

The ranks meet through the engine's own store (``meet/rendezvous.py``), with keys
``aoffload/<run>/preempt/...`` (``Keys.preemption``), and only once a notice came: until then
each rank's threads block on a key, which costs no traffic at all. Each rank has two
threads, never the loop's:

- the *announcer* waits for this rank's notice (a signal or ``request()``), then sets every
  rank's ``wake/<rank>`` key with ``compare_set``: the first notice wins;
- the *watcher* blocks on this rank's own ``wake/<rank>``, on a store connection of its own.
  When it is set, the watcher *freezes* its rank (:meth:`Party.freeze`: from then on
  ``reached()`` waits instead of answering False), posts the last step the rank was told
  False for as ``step/<rank>``, and counts itself in ``count``. The rank that completes the
  count sets ``agreed`` to the highest posted step plus one: the first step every rank can
  still reach, since none was told False for it. Every watcher waits for ``agreed`` (at most
  ``commit_timeout``) and hands it to its rank (:meth:`Party.agreed`).

A rank whose loop is blocked in a long synchronous step posts all the same: its watcher does.
``agreed`` may instead hold a failure, set with ``compare_set`` by whoever sees it first: a
watcher whose wait ran out names the ranks that never posted (they did not call
``preemption()``, or died); a rank that closes its engine during the agreement, or had closed
it before (its ``wake`` key says ``closed``), is named as gone. A rank that closes without a
notice sets its own ``wake`` key to ``closed``, which ends its watcher.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
from typing import TYPE_CHECKING, Any, Protocol

import torch.distributed as dist

from ..._errors import CheckpointError, first_line
from ..meet.keys import Keys

if TYPE_CHECKING:
    from ..meet.rendezvous import Rendezvous

__all__ = ["Agreement", "Party"]

logger = logging.getLogger(__name__)

_CLOSED = "closed"
_IDLE_WAIT = datetime.timedelta(days=1)  # a store wait's bound; the watcher waits again after it
_JOIN_SECONDS = 1.0


class Party(Protocol):
    """The rank's side of the agreement (the preemption notice)."""

    @property
    def why(self) -> str:
        """Who gave notice on this rank, and how (for messages)."""

    def freeze(self) -> int | None:
        """Stop answering False; the last step answered False (``None``: none yet)."""

    def agreed(self, step: int | None) -> None:
        """Every rank saves at ``step`` (``None``: at the first step each one asks about)."""

    def failed(self, error: BaseException) -> None:
        """The ranks cannot agree."""


class Agreement:
    """This rank's part in agreeing on a step with the other ranks; see the module."""

    def __init__(self, meet: Rendezvous, party: Party) -> None:
        self._meet = meet
        self._party = party
        self._keys = Keys.preemption(meet.run)
        self._noticed = threading.Event()
        self._closed = False
        self._threads = [
            threading.Thread(target=target, name=f"aoffload-preempt-{name}", daemon=True)
            for target, name in ((self._watch, "watch"), (self._announce, "announce"))
        ]

    def start(self) -> None:
        """Start the announcer and the watcher."""
        for thread in self._threads:
            thread.start()

    def notice(self) -> None:
        """This rank got notice: wake the announcer (safe in a signal handler, called once)."""
        self._noticed.set()

    def close(self) -> None:
        """End this rank's part (blocking, briefly): a pending agreement fails on every rank."""
        self._closed = True
        self._noticed.set()
        try:
            if self._meet.claim(self._keys.wake(self._meet.rank), _CLOSED) != _CLOSED:
                self._fail_everywhere(f"rank {self._meet.rank} closed its engine")  # if open
        except dist.DistError as exc:  # the store is gone: so are the watcher's waits
            logger.debug("preemption notice: the store is gone (%s)", first_line(exc))
        for thread in self._threads:
            if thread.is_alive():
                thread.join(_JOIN_SECONDS)

    def _fail_everywhere(self, why: str) -> None:
        self._meet.claim(self._keys.agreed, json.dumps({"error": why}))

    # -- the threads ---------------------------------------------------------------------

    def _announce(self) -> None:
        self._noticed.wait()
        if self._closed:
            return
        meet, keys = self._meet, self._keys
        why = self._party.why
        logger.warning("preemption notice (%s): telling every rank to save", why)
        notice = json.dumps({"rank": meet.rank, "why": why})
        try:
            for rank in range(meet.world):
                if meet.claim(keys.wake(rank), notice) == _CLOSED:
                    self._fail_everywhere(f"rank {rank} had closed its engine")
        except dist.DistError as exc:
            self._party.failed(_store_lost(exc))

    def _watch(self) -> None:
        meet, keys = self._meet, self._keys
        try:
            store = meet.connect()
            key = keys.wake(meet.rank)
            while True:
                try:
                    store.wait([key], _IDLE_WAIT)
                    break
                except dist.DistStoreError:  # a day without notice: wait again
                    continue
            notice = bytes(store.get(key)).decode()
            if notice == _CLOSED:
                return
            last = self._party.freeze()
            store.set(keys.step(meet.rank), "" if last is None else str(last))
            if int(store.add(keys.count, 1)) == meet.world:
                self._decide(store)
            self._party_hears(store, json.loads(notice)["why"])
        except dist.DistError as exc:
            if self._closed:
                logger.debug("preemption notice: the store is gone (%s)", first_line(exc))
            self._party.failed(_store_lost(exc))
        except BaseException as exc:  # noqa: BLE001 - raised by reached() on every later call
            self._party.failed(exc)

    def _decide(self, store: Any) -> None:
        """The last rank to post: the agreed step is the highest posted step plus one."""
        posts = store.multi_get([self._keys.step(rank) for rank in range(self._meet.world)])
        steps = [int(value) for value in map(bytes, posts) if value]
        step = max(steps) + 1 if steps else None
        store.compare_set(self._keys.agreed, "", json.dumps({"step": step}))

    def _party_hears(self, store: Any, why: str) -> None:
        meet, keys = self._meet, self._keys
        try:
            store.wait([keys.agreed], datetime.timedelta(seconds=meet.timeout))
        except dist.DistStoreError:
            missing = [r for r in range(meet.world) if not store.check([keys.step(r)])]
            self._fail_everywhere(
                f"rank(s) {missing} did not answer within commit_timeout={meet.timeout} s "
                "(did every rank call engine.preemption()? did one die?)"
            )
        outcome = json.loads(bytes(store.get(keys.agreed)).decode())
        if "error" in outcome:
            error = f"the ranks cannot agree on a step to save ({why}): {outcome['error']}"
            self._party.failed(CheckpointError(error))
            return
        self._party.agreed(outcome["step"])
        where = "the first step" if outcome["step"] is None else f"step {outcome['step']}"
        logger.info("preemption notice (%s): every rank saves at %s", why, where)


def _store_lost(exc: BaseException) -> CheckpointError:
    return CheckpointError(
        "the preemption notice lost the connection to the commit store on rank 0 (rank 0 "
        f"died or closed its engine: {first_line(exc)})"
    )
