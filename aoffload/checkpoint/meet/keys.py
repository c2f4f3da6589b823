"""The commit store's keys: every exchange among the ranks is one :class:`Keys`.

Each exchange of a run (commit ``n``, the upload of commit ``n``, the preemption notice)
has its own prefix, ``aoffload/<run>/<scope>/``, and the same few kinds of keys under it:
a rank's ``report/<rank>`` and ``ack/<rank>``, a ``count`` of reports, the ``outcome`` (the
first verdict, set with ``compare_set``), rank 0's ``result``; the preemption notice adds
``wake/<rank>``, ``step/<rank>`` and ``agreed``.
"""

from __future__ import annotations

__all__ = ["Keys"]


class Keys:
    """The store keys of one exchange among the ranks of run ``run``: ``outcome`` (the first
    verdict, set with ``compare_set``), ``count`` (how many ranks reported), ``result``
    (rank 0's answer), ``agreed`` (the preemption's step, or why the ranks cannot agree)."""

    __slots__ = ("agreed", "count", "outcome", "prefix", "result", "run")

    def __init__(self, run: str, scope: str) -> None:
        self.run = run
        self.prefix = f"aoffload/{run}/{scope}/"
        """What every key of the exchange starts with."""
        self.outcome, self.count, self.result, self.agreed = (
            self.prefix + name for name in ("outcome", "count", "result", "agreed")
        )

    @classmethod
    def commit(cls, run: str, n: int) -> Keys:
        """The keys of commit ``n`` (every rank counts its commits alike)."""
        return cls(run, str(n))

    @classmethod
    def upload(cls, run: str, n: int) -> Keys:
        """The keys of the upload of commit ``n`` (ranks without a shared filesystem)."""
        return cls(run, f"{n}/up")

    @classmethod
    def preemption(cls, run: str) -> Keys:
        """The keys of the run's preemption notice."""
        return cls(run, "preempt")

    def report(self, rank: int) -> str:
        """Where ``rank`` reports."""
        return f"{self.prefix}report/{rank}"

    def ack(self, rank: int) -> str:
        """Where ``rank`` acknowledges rank 0's result."""
        return f"{self.prefix}ack/{rank}"

    def wake(self, rank: int) -> str:
        """Set once: the notice for ``rank``, or ``closed`` when it closed first."""
        return f"{self.prefix}wake/{rank}"

    def step(self, rank: int) -> str:
        """The last step ``rank`` was told False for (``""``: none)."""
        return f"{self.prefix}step/{rank}"

    def spent(self, world: int) -> list[str]:
        """The keys of a finished commit or upload, for rank 0 to drop."""
        per_rank = [key for rank in range(world) for key in (self.report(rank), self.ack(rank))]
        return [self.outcome, self.count, self.result, *per_rank]
