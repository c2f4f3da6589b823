"""Process machinery shared by every feature: no feature knowledge, no torch code.

- :mod:`.protocol`: typed calls (a request type names its result type) and the envelopes;
- :mod:`.core`: :class:`~.core.WorkerCore`, one worker as any thread sees it (the ladder too);
- :mod:`.bridge`: :class:`~.bridge.Bridge`, the core's asyncio face;
- :mod:`.process`: :class:`~.process.WorkerProcess`, the worker's two pipes and its signals;
- :mod:`.launcher`, :mod:`.forked`: the trainer's worker servers, and a forked worker as the
  trainer sees it (pid, pidfd, exit code);
- :mod:`.forkserver`: the worker server, a preloaded interpreter that forks workers;
- :mod:`.inherit`: what a worker inherits from the trainer, per server and per start;
- :mod:`.serve`: the worker's side (boot, handshake, dispatch by request type, log forwarding);
- :mod:`.census`: counting workers and staging segments, for the leak checks;
- :mod:`.resource`: the one lifecycle (:class:`~.resource.Resource`, both faces;
  :class:`~.resource.AsyncResource`, the asyncio face alone);
- :mod:`.handle`: :class:`~.handle.Handle`, what every call that waits returns;
- :mod:`.threads`: the library's own threads and the primitives they share;
- :mod:`.loops`: the choice of event loop (uvloop when installed).
"""
