"""aoffload for ``torch.distributed.checkpoint`` (DCP): imported on demand.

- :class:`Stager`: DCP's ``AsyncStager``: ``stage()`` returns at once, the copy runs on
  aoffload's threads into shared memory (GIL-free, mutations caught naming the key).
- :class:`StorageWriter`: DCP's ``StorageWriter`` through a running
  :class:`~aoffload.CheckpointEngine`: every file through its writer process, ``finish()``
  an aoffload commit (manifest with checksums, atomic publication, ``latest``, retention,
  the remote tier), every rank or none.
- :class:`StorageReader`: DCP's ``StorageReader`` for aoffload checkpoint directories and
  remote tiers: each file verified against the tag's manifest before DCP reads it,
  ``.metadata`` unpickled with an allow-list of DCP's classes; plain DCP directories read
  too (without verification, said in the log). DCP's planners reshard: saved on N ranks,
  loaded on M.
- ``engine.dcp`` (:class:`DcpFace`, its saves return :class:`AsyncSave`): the same route as
  an engine's face, both styles.

::

    import torch.distributed.checkpoint as dcp
    from aoffload.dcp import Stager, StorageReader, StorageWriter

    response = dcp.async_save(state_dict, async_stager=stager,
                              storage_writer=StorageWriter("ckpt", tag=f"step-{step}"))
    dcp.load(state_dict, storage_reader=StorageReader("ckpt"))   # latest; or tag="step-100"
"""

from __future__ import annotations

from ._face import AsyncSave as AsyncSave
from ._face import DcpFace as DcpFace
from ._reader import StorageReader as StorageReader
from ._stager import Stager as Stager
from ._writer import StorageWriter as StorageWriter

__all__ = ("AsyncSave", "DcpFace", "Stager", "StorageReader", "StorageWriter")
