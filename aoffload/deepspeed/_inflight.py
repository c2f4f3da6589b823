"""The DeepSpeed checkpoint adapter's commits in flight, seen from the trainer's thread.

:meth:`AsyncCheckpointEngine.commit <._checkpoint.AsyncCheckpointEngine.commit>` returns as
soon as the snapshot copy has ended; the commit itself runs on the engine's commit thread,
and the trainer's thread holds its :class:`~aoffload.Handle`. :class:`CommitsInFlight`
keeps those handles in commit order: it re-raises a failed one (once) from the adapter's
next call, and :meth:`CommitsInFlight.wait` blocks the trainer's thread until all of them
are durable, bounded by ``commit_timeout``.
"""

from __future__ import annotations

import time
from typing import Any

from .. import CheckpointError, Handle

__all__ = ["CommitsInFlight"]


class CommitsInFlight:
    """The commits started in the background and not yet seen to end, oldest first."""

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self._commits: list[tuple[str, Handle[Any]]] = []

    def add(self, tag: str, commit: Handle[Any]) -> None:
        """Track the commit of ``tag`` (its failure is this adapter's to raise)."""
        self._commits.append((tag, commit))

    def raise_failed(self) -> None:
        """Re-raise (once) the error of a background commit that has finished badly."""
        for tag, commit in list(self._commits):
            if commit.done():
                self._commits.remove((tag, commit))
                commit.result()  # raises its failure, which counts as seen

    def wait(self, directory: str | None, *, distributed: bool) -> None:
        """Block until every commit has ended; raise the first failure.

        Waits at most ``timeout`` seconds in all, then raises :class:`CheckpointError`
        naming the checkpoint of ``directory`` still in flight.
        """
        deadline = time.monotonic() + self._timeout
        while self._commits:
            tag, commit = self._commits[0]
            try:
                commit.result(timeout=max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                if commit.done():  # its own error
                    raise
                where = "on every rank " if distributed else ""
                raise CheckpointError(
                    f"waited {self._timeout} s (commit_timeout) for checkpoint {tag!r} "
                    f"in {directory} to become durable {where}and published; it is still "
                    "being committed in the background. Check the writer's disk and the other "
                    "ranks, or raise commit_timeout"
                ) from None
            finally:
                if commit.done():
                    self._commits.remove((tag, commit))
