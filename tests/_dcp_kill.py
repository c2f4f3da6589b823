"""A rank that saves through aoffload's DCP route until it is killed (``test_dcp_write.py``).

:func:`main` runs in a process of its own (forked by ``tests._ranks``' forkserver, which
has imported torch already), with the environment a launcher sets (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``). Each step's state (a sharded tensor, a
4 MiB sharded vector, a plain tensor, a plain value: all a function of the step) is saved
with ``dcp.async_save`` (``THREAD`` mode), aoffload's ``Stager`` and ``StorageWriter``
into an engine on ``directory``; the step is sent on ``committed`` once it is published.
"""

from __future__ import annotations

import datetime
import itertools
import os
from multiprocessing.connection import Connection
from pathlib import Path


def main(directory: str, environ: dict[str, str], committed: Connection) -> None:
    os.environ.clear()
    os.environ.update(environ)
    quiet = os.open(os.devnull, os.O_WRONLY)  # what a rank killed mid-write prints is noise
    os.dup2(quiet, 1)
    os.dup2(quiet, 2)

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import aoffload
    from aoffload.dcp import Stager, StorageWriter
    from tests._dcp_scenarios import _state, whole

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    world = dist.get_world_size()
    with aoffload.CheckpointEngine(Path(directory), distributed=True, keep_last=2) as engine:
        stager = Stager()
        for step in itertools.count(1):
            response = dcp.async_save(
                _state(world, whole(step), step, big=True),
                storage_writer=StorageWriter(directory, tag=f"step-{step}"),
                async_stager=stager,
            )
            response.staging_completion.result()
            response.upload_completion.result()
            engine.commit(f"step-{step}").result()
            committed.send(step)
