"""The core: the engine of one process writing one local directory, with no feature flags.

It imports the on-disk format (``format/``), the writer's calls (``writer/calls.py``) and the
process machinery (``aoffload._runtime``), nothing else: who takes part in a commit and what
stands behind the directory are roles it is handed (:mod:`.roles`), by the assembler.

- :mod:`.engine`: :class:`~.engine.EngineCore`, synchronous and thread-safe, and which
  thread does what;
- :mod:`.roles`: the :class:`~.roles.Coordinator` and :class:`~.roles.Tier` protocols;
  :mod:`.alone`: their defaults (one process; no second tier);
- :mod:`.tags`: the one owner of the tags in flight and their staging slots;
- :mod:`.pipeline`: ``stage()`` to the writer, on threads (:mod:`.plan`, :mod:`.loadable`,
  :mod:`.copy`, :mod:`.staging`);
- :mod:`.commit`: a commit on the commit thread; :mod:`.catalog`: the committed tags;
  :mod:`.retention`: which of them are kept; :mod:`.result`: what a commit published;
- :mod:`.load`: verified loads.
"""
