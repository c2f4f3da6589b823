"""The DeepSpeed checkpoint adapter's commits in flight, seen from the trainer's thread.

:meth:`AsyncCheckpointEngine.commit <._checkpoint.AsyncCheckpointEngine.commit>` returns as
soon as the snapshot copy has ended; the commit itself runs on the engine's commit thread,
and the trainer's thread holds a ``concurrent.futures.Future`` of it.
:class:`CommitsInFlight` keeps those futures in commit order: it re-raises a failed one
(once) from the adapter's next call, and :meth:`CommitsInFlight.wait` blocks the trainer's
thread until all of them are durable, bounded by ``commit_timeout``.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

from .._errors import CheckpointError
from ..checkpoint.core.tags import Tags

__all__ = ["CommitsInFlight"]


class CommitsInFlight:
    """The commits started in the background and not yet seen to end, oldest first."""

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self._commits: list[tuple[str, concurrent.futures.Future[Any]]] = []
        self._owners: dict[int, Tags] = {}

    def add(self, tag: str, future: concurrent.futures.Future[Any], owner: Tags) -> None:
        """Track the commit of ``tag``; ``owner`` is told when its failure was raised here."""
        self._commits.append((tag, future))
        self._owners[id(future)] = owner

    def _raise(self, future: concurrent.futures.Future[Any]) -> None:
        owner = self._owners.pop(id(future), None)
        try:
            future.result()
        except BaseException:
            if owner is not None:
                owner.commit_seen(future)  # raised here: the engine need not raise it again
            raise

    def raise_failed(self) -> None:
        """Re-raise (once) the error of a background commit that has finished badly."""
        for tag, future in list(self._commits):
            if future.done() and future.exception() is not None:
                self._commits.remove((tag, future))
                self._raise(future)
        for _, future in self._commits:
            if future.done():
                self._owners.pop(id(future), None)
        self._commits = [(tag, future) for tag, future in self._commits if not future.done()]

    def wait(self, directory: str | None, *, distributed: bool) -> None:
        """Block until every commit has ended; raise the first failure.

        Waits at most ``timeout`` seconds in all, then raises :class:`CheckpointError`
        naming the checkpoint of ``directory`` still in flight.
        """
        deadline = time.monotonic() + self._timeout
        while self._commits:
            tag, future = self._commits[0]
            try:
                concurrent.futures.wait([future], timeout=max(deadline - time.monotonic(), 0.0))
                if not future.done():
                    raise concurrent.futures.TimeoutError
                self._raise(future)
            except concurrent.futures.TimeoutError:
                where = "on every rank " if distributed else ""
                raise CheckpointError(
                    f"waited {self._timeout} s (commit_timeout) for checkpoint {tag!r} "
                    f"in {directory} to become durable {where}and published; it is still "
                    "being committed in the background. Check the writer's disk and the other "
                    "ranks, or raise commit_timeout"
                ) from None
            finally:
                if future.done():
                    self._commits.remove((tag, future))
