"""What :meth:`~aoffload.CheckpointEngine.stage` returns: :class:`Staged`, the fence."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from .._runtime.handle import Handle
from .._runtime.threads import running_future

if TYPE_CHECKING:
    from .core.engine import EngineCore
    from .core.tags import FileJob

__all__ = ["Staged"]


class Staged(Handle[None]):
    """What :meth:`CheckpointEngine.stage` returns: one call's snapshot copy, in flight.

    A :class:`~aoffload.Handle`: ``await staged`` (asyncio) or ``staged.result()`` (any
    thread) returns ``None`` once every tensor of the call is copied into staging memory
    (at once, without suspending, if it already is); from then on the caller may mutate
    or free them. Run the fence on the thread that owns the state (the training loop's):
    it checks that nothing was modified in place since ``stage()``. It raises what the
    staging raised (:class:`InvalidStateError` naming the key for bad input,
    :class:`CheckpointError` naming the key of a tensor modified in place since
    ``stage()`` was called, :class:`WorkerDiedError`). A failure raised here is not raised
    again by ``commit()``. An abandoned wait (a cancelled await, a ``result(timeout)``
    that ran out) abandons the wait only. :meth:`done` tells without waiting.
    """

    __slots__ = ("_core", "_job", "name", "tag")

    def __init__(self, job: FileJob | None, core: EngineCore, name: str, tag: str) -> None:
        if job is None:  # a replica: nothing to copy
            nothing = running_future()
            nothing.set_result(None)
            super().__init__(nothing)
        else:
            super().__init__(job.staged, seen=lambda exc: core.tags.seen(job, exc))
        self._job, self._core, self.name, self.tag = job, core, name, tag

    def done(self) -> bool:
        """Whether the copy has ended (successfully or not).

        Once it returns ``True`` the fence has been passed: the tensors may be modified.
        """
        if not super().done():
            return False
        if self._job is not None:
            with contextlib.suppress(Exception):  # raised by the wait
                self._core.seal(self._job)
        return True

    def _finish(self, value: Any) -> None:
        if self._job is not None:
            self._core.seal(self._job)

    def __repr__(self) -> str:
        state = "done" if super().done() else "copying"
        return f"<Staged {self.tag}/{self.name} {state}>"
