"""A rank that saves through aoffload's DCP route until it is killed (``test_dcp_write.py``).

Run with the environment a launcher sets (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``): ``python -m tests._dcp_kill DIR``. Each step's state (a sharded tensor,
a 4 MiB sharded vector, a plain tensor, a plain value: all a function of the step) is saved
with ``dcp.async_save`` (``THREAD`` mode), aoffload's ``Stager`` and ``StorageWriter``
into an engine on ``DIR``; ``committed <step>`` is printed once each is published.
"""

from __future__ import annotations

import datetime
import itertools
import sys
from pathlib import Path


def main() -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import aoffload
    from aoffload.dcp import Stager, StorageWriter
    from tests._dcp_scenarios import _state, whole

    directory = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    world = dist.get_world_size()
    with aoffload.CheckpointEngine(directory, distributed=True, keep_last=2) as engine:
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
            print(f"committed {step}", flush=True)


if __name__ == "__main__":
    main()
