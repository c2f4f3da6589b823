"""Process machinery shared by every feature: no torch, no knowledge of checkpoints or Adam.

- :mod:`.protocol`: typed calls (a request type names its result type) and the envelopes;
- :mod:`.bridge`: :class:`~.bridge.Bridge`, one spawned worker and everything around it;
- :mod:`.serve`: the worker's side (handshake, dispatch by request type, log forwarding);
- :mod:`.resource`: :class:`~.resource.AsyncResource`, the one lifecycle;
- :mod:`.threads`: the library's own threads (executors, the sync adapters' portal);
- :mod:`.loops`: the choice of event loop (uvloop when installed).
"""
