"""The ranks of a ``torch.distributed`` job as one checkpoint (``distributed=True``).

A role the assembler plugs into the core: :class:`~.commit.RankCommits` is the core's
:class:`~..core.roles.Coordinator` for ranks.

- :mod:`.rendezvous`: where the ranks meet (their own gloo group, a ``TCPStore``);
- :mod:`.keys`: the store's keys, one class for every exchange;
- :mod:`.reports`: what the ranks tell each other, as dataclasses (JSON only in the store);
- :mod:`.commit`: the commit protocol on every rank's commit thread;
- :mod:`.departure`: a rank that closes or dies tells the others at once.
"""
