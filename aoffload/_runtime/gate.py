"""Shared memory that a worker writes while the trainer runs: who reads it, who writes it.

OffloadAdam keeps fp32 CPU parameters in the shared memory its worker steps in place: from the
moment the backward sends a bucket until the step returns, the worker may be writing it. A
checkpoint staging that copies those parameters must not overlap that. The two sides meet
here, by the address of the memory (a storage's data pointer), with no import of each other:

* a **writer** (OffloadAdam, before it sends a bucket) waits until no staging copy of that
  memory is in progress, then marks it written until its step has landed;
* a **reader** (the checkpoint pipeline, at ``stage()``) registers the guarded memory it will
  copy until its copy has ended, and is refused at once while that memory is being written.

So a staging taken between steps is exact even when the next backward starts before its
copy ends (the backward's first send of that memory waits for the copy), and one taken while
a step is in flight fails loudly. A reader never waits, so neither side can deadlock the
other. Memory nobody guards costs a reader nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

__all__ = ["GATE", "Gate", "Reading"]


class _Region:
    __slots__ = ("name", "readers", "writing")

    def __init__(self, name: str) -> None:
        self.name = name
        self.readers = 0
        self.writing = False


class Reading:
    """The guarded regions one reader holds; ``busy`` names one being written (none held)."""

    __slots__ = ("busy", "regions")

    def __init__(self, regions: list[_Region], busy: str | None) -> None:
        self.regions = regions
        self.busy = busy


class Gate:
    """Readers and writers of guarded memory, keyed by its address; thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._regions: dict[int, _Region] = {}

    def guard(self, address: int, name: str) -> None:
        """Guard the memory at ``address`` (a writer's, for as long as it may write it)."""
        with self._cond:
            self._regions[address] = _Region(name)

    def unguard(self, address: int) -> None:
        """Stop guarding ``address`` (its writer is gone); readers holding it keep their hold."""
        with self._cond:
            self._regions.pop(address, None)
            self._cond.notify_all()

    def guarding(self) -> bool:
        """Whether any memory is guarded now (if not, readers need not look)."""
        return bool(self._regions)

    def begin_read(self, addresses: Iterable[int]) -> Reading:
        """Hold every guarded region among ``addresses`` until :meth:`end_read`; never waits.

        If one is being written, nothing is held and :attr:`Reading.busy` names it.
        """
        if not self._regions:  # nothing guarded: no lock
            return Reading([], None)
        with self._cond:
            regions = [self._regions[a] for a in set(addresses) if a in self._regions]
            for region in regions:
                if region.writing:
                    return Reading([], region.name)
            for region in regions:
                region.readers += 1
            return Reading(regions, None)

    def end_read(self, reading: Reading) -> None:
        """Release what :meth:`begin_read` held (once; later calls do nothing)."""
        if not reading.regions:
            return
        with self._cond:
            for region in reading.regions:
                region.readers -= 1
            reading.regions = []
            self._cond.notify_all()

    def begin_write(self, address: int) -> None:
        """Wait until no reader holds the region at ``address``, then mark it written."""
        with self._cond:
            region = self._regions.get(address)
            if region is None:
                return
            while region.readers:
                self._cond.wait()
            region.writing = True

    def end_write(self, address: int) -> None:
        """The writes to ``address`` have landed: readers may hold it again."""
        with self._cond:
            region = self._regions.get(address)
            if region is not None:
                region.writing = False


GATE = Gate()
"""The process's one gate: OffloadAdam writes through it, the checkpoint pipeline reads."""
