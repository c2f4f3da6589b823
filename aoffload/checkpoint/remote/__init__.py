"""The remote tier (``remote=URL``): uploads, resume from an object store, no shared filesystem.

A role the assembler plugs into the core: :class:`~.tier.RemoteTier` is the core's
:class:`~..core.roles.Tier` when the engine has a remote tier.

- :mod:`.tier`: one engine's uploads, in commit order, and its remote retention;
- :mod:`.uploader`: the uploader process as the trainer sees it; both tiers as one
  catalog; downloads, verified and cached;
- :mod:`.early`: a file's upload starts once it is durable, before the commit ends;
- :mod:`.ranks`: ranks without a shared filesystem upload their own files;
- :mod:`.url`: loading from a URL without an engine;
- :mod:`.inspect`: what the command line shows of a URL;
- ``worker/``: the uploader process's side (and the command line's store).
"""
