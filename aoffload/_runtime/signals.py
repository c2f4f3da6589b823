"""Signals in the trainer: handlers that only take note, for notices any thread reads.

A handler installed with :func:`signal.signal` runs on the main thread, between two bytecodes,
as soon as the main thread runs Python again: during a synchronous step that sleeps, waits on
a lock or runs Python code, and at the latest when the torch operation in progress returns.
That is what a notice needs. A callback of ``loop.add_signal_handler`` runs only when the event
loop turns, and a training loop whose awaits complete without suspending never turns it.

:func:`listen` installs one process-wide handler per signal (the main thread only, as Python
requires) and keeps what was installed before. The handler tells every :class:`Listener` of the
signal, and nothing else: no lock, no I/O (a listener's :meth:`~Listener.signalled` must not
block either). A *second* delivery of the same signal, a delivery nobody listens for any more,
or a delivery in a process forked from this one (a DataLoader worker) is handed to the previous
disposition, which is restored: Ctrl-C twice still interrupts, ``kill`` twice still kills.
:func:`unlisten` removes a listener and, on the main thread, restores the previous handler once
a signal has no listener left (off the main thread the restore waits for that next delivery).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import FrameType
from typing import Any, Protocol

__all__ = ["Listener", "listen", "listeners", "unlisten"]

logger = logging.getLogger(__name__)

_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class Listener(Protocol):
    """Something that takes note of a signal."""

    def signalled(self, signum: int) -> None:
        """Called in the signal handler, on the main thread: take note, never block."""


@dataclass
class _Slot:
    previous: _Handler
    pid: int  # the process that listens (a forked child inherits the slot, not the notices)
    listeners: tuple[Listener, ...] = ()  # replaced whole, so the handler reads it lock-free
    deliveries: int = 0


_slots: dict[int, _Slot] = {}
_lock = threading.Lock()  # changes to _slots; never taken by the handler


def _handle(signum: int, frame: FrameType | None) -> None:
    slot = _slots.get(signum)
    if slot is None:  # pragma: no cover - a delivery racing the restore of the previous handler
        return
    slot.deliveries += 1
    listening = slot.listeners
    if slot.deliveries == 1 and listening and os.getpid() == slot.pid:
        for listener in listening:
            listener.signalled(signum)
        return
    _escalate(signum, slot, frame)


def _escalate(signum: int, slot: _Slot, frame: FrameType | None) -> None:
    """Hand this delivery to what was installed before (restored from now on)."""
    _slots.pop(signum, None)
    previous = slot.previous
    if previous is None:  # installed outside Python: the default is the best we can restore
        previous = signal.SIG_DFL
    signal.signal(signum, previous)
    if previous == signal.SIG_DFL:
        signal.raise_signal(signum)  # its default action: terminate (or what it is)
    elif callable(previous):
        previous(signum, frame)  # e.g. default_int_handler raises KeyboardInterrupt


def listen(listener: Listener, signals: Iterable[int]) -> None:
    """Have ``listener`` told of ``signals`` (from the main thread: Python's rule)."""
    wanted = [signal.Signals(signum) for signum in signals]
    if not wanted:
        return
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("signal handlers can only be installed on the main thread")
    with _lock:
        for signum in wanted:
            slot = _slots.get(signum)
            if slot is None or signal.getsignal(signum) is not _handle:
                slot = _slots[signum] = _Slot(signal.getsignal(signum), os.getpid())
                signal.signal(signum, _handle)
            elif slot.pid != os.getpid():  # a forked child listens for itself
                slot = _slots[signum] = _Slot(slot.previous, os.getpid())
            if listener not in slot.listeners:
                slot.listeners = (*slot.listeners, listener)


def unlisten(listener: Listener) -> None:
    """Stop telling ``listener``; restore a signal's previous handler once nobody listens.

    The restore needs the main thread; elsewhere the handler stays until the signal's next
    delivery, which it hands to the previous handler (and restores it then).
    """
    main = threading.current_thread() is threading.main_thread()
    with _lock:
        for signum, slot in list(_slots.items()):
            slot.listeners = tuple(other for other in slot.listeners if other is not listener)
            if slot.listeners or not main:
                continue
            del _slots[signum]
            if signal.getsignal(signum) is _handle:  # else someone replaced it: theirs stays
                signal.signal(signum, signal.SIG_DFL if slot.previous is None else slot.previous)


def listeners(signum: int) -> tuple[Listener, ...]:
    """Who is told of ``signum`` now (for tests and diagnostics)."""
    slot = _slots.get(signum)
    return slot.listeners if slot is not None else ()
