"""Where the ranks of a distributed engine meet: not a role, what the roles share.

- :mod:`.rendezvous`: the ranks' own gloo group and rank 0's ``TCPStore``, waited on off
  the event loop;
- :mod:`.keys`: the store's keys, one class for every exchange (a commit, its upload, a
  preemption notice);
- :mod:`.reports`: what the ranks tell each other, as dataclasses (JSON only in the store).

The roles that speak across ranks (``ranks/``, ``remote/``, ``preemption/``) build on it;
it imports only the format and the runtime, so they all stand on one floor.
"""
