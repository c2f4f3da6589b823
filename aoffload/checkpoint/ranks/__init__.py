"""The ranks of a ``torch.distributed`` job as one checkpoint (``distributed=True``).

A role the assembler plugs into the core: :class:`~.commit.RankCommits` is the core's
:class:`~..core.roles.Coordinator` for ranks.

- :mod:`.commit`: the commit protocol on every rank's commit thread;
- :mod:`.departure`: a rank that closes or dies tells the others at once.

Where the ranks meet (their gloo group and store, the keys, the reports) is ``meet/``, below
every role that speaks across ranks (this one, ``remote/``, ``preemption/``).
"""
