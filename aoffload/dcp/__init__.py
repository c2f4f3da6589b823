"""aoffload for ``torch.distributed.checkpoint`` (DCP): imported on demand.

- :class:`StorageReader`: DCP's ``StorageReader`` for aoffload checkpoint directories:
  each file verified against the tag's manifest before DCP reads it, ``.metadata``
  unpickled with an allow-list of DCP's classes; plain DCP directories read too (without
  verification, said in the log). DCP's planners reshard: saved on N ranks, loaded on M.

::

    import torch.distributed.checkpoint as dcp
    from aoffload.dcp import StorageReader

    dcp.load(state_dict, storage_reader=StorageReader("ckpt"))   # latest; or tag="step-100"
"""

from __future__ import annotations

from ._reader import StorageReader as StorageReader

__all__ = ("StorageReader",)
