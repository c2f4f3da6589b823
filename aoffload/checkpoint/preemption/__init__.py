"""The preemption notice: every rank saves at one step once any rank got a signal.

A role the assembler plugs into the engine's face (``engine.preemption()``); with ranks,
the agreement on a step runs over the ranks' rendezvous (``meet/rendezvous.py``).

- :mod:`.notice`: :class:`~.notice.PreemptionNotice`, what the trainer asks each step;
- :mod:`.agreement`: how the ranks agree on the step, on threads of their own.
"""
