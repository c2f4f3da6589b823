"""The systems the checkpoint section measures aoffload against: torch.save, DCP, DeepSpeed.

Each ``*_stall`` function checkpoints once, lets a ``compute``-second step run (a sleep: the
trainer waiting for its accelerator), and returns a :class:`Timing`: the blocking time, the
trainer's stall (every wait the trainer has for this checkpoint), and the time from the save
call until the checkpoint is durable (all of it timed, nothing left to an untimed wait).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

__all__ = [
    "DeepSpeedDecoupled",
    "Timing",
    "dcp_stall",
    "init_single_process_group",
    "scratch",
    "torch_save_stall",
]


@contextlib.contextmanager
def scratch(root: Path, name: str) -> Iterator[Path]:
    """A fresh directory under ``root``, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def init_single_process_group() -> None:
    """A world of one (gloo), as DCP's process mode and DeepSpeed's engine need."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.update(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        CROSS_RANK="0",
        CROSS_SIZE="1",
        MASTER_ADDR="127.0.0.1",
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    dist.init_process_group("gloo", rank=0, world_size=1)


class Timing(NamedTuple):
    """One checkpoint of one system, in seconds."""

    blocking: float
    """The save call itself."""
    stall: float
    """Every wait the trainer has for this checkpoint: the call plus its fence after the step."""
    durable: float
    """From the save call until the checkpoint is durable (for a system that cannot overlap
    the step, its save comes first and the step after: the step is not in it)."""


# -- the systems ------------------------------------------------------------------------------


def torch_save_stall(root: Path, state: dict[str, torch.Tensor], compute: float) -> Timing:
    """torch.save + fsync after a ``compute``-second step: it blocks for all of it."""
    with scratch(root, "torch-save") as directory:
        time.sleep(compute)
        path = directory / "model.pt"
        started = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        stall = time.perf_counter() - started
        return Timing(stall, stall, stall)


def dcp_stall(
    root: Path, state: dict[str, torch.Tensor], compute: float, kind: Any, stager: Any = None
) -> Timing:
    """async_save of ``state`` with ``kind`` (THREAD or PROCESS) and ``stager``.

    With ``stager`` (DCP's async staging, :class:`DefaultStager`) the trainer's stall is the
    call plus the staging future after the step (its fence); the upload future is then waited
    for, and timed, as the time to durable. Without a stager DCP copies synchronously inside
    ``async_save``, and the trainer waits for the whole save at its next checkpoint.
    """
    from torch.distributed.checkpoint.state_dict_saver import async_save

    with scratch(root, "dcp") as directory:
        started = time.perf_counter()
        future: Any = async_save(
            state, checkpoint_id=str(directory), async_checkpointer_type=kind, async_stager=stager
        )
        blocked = time.perf_counter() - started
        time.sleep(compute)
        waited = time.perf_counter()
        if hasattr(future, "staging_completion"):
            future.staging_completion.result()
            stall = blocked + time.perf_counter() - waited
            future.upload_completion.result()
            return Timing(blocked, stall, time.perf_counter() - started)
        future.result()
        stall = blocked + time.perf_counter() - waited
        return Timing(blocked, stall, time.perf_counter() - started)


class DeepSpeedDecoupled:
    """DeepSpeed's DecoupledCheckpointEngine (python writer), built outside a training engine."""

    def __init__(self) -> None:
        init_single_process_group()
        import deepspeed
        from deepspeed.runtime.checkpoint_engine.utils import create_checkpoint_engine
        from deepspeed.runtime.config import DeepSpeedConfig

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        if not deepspeed.comm.is_initialized():
            deepspeed.init_distributed("gloo")
        config = DeepSpeedConfig(
            {
                "train_batch_size": 1,
                "checkpoint": {
                    "writer": {"type": "python", "decoupled": True, "data_parallel": "replica"}
                },
            }
        )
        self.engine: Any = create_checkpoint_engine(
            config,
            deepspeed.utils.groups,
            zero_stage=0,
            has_moe_layers=False,
            optimize_dp_state=True,
        )

    def stall(self, root: Path, state: dict[str, torch.Tensor], compute: float) -> Timing:
        """save(), then ``commit()`` after the step: the stall is both; durable when
        ``commit()`` returns (its python writer flushes but does not fsync)."""
        from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

        with scratch(root, "deepspeed") as directory:
            info = CheckpointCommitInfo(tag="step", save_dir=str(directory), save_latest=True)
            (directory / "step").mkdir()
            started = time.perf_counter()
            self.engine.create(info)
            self.engine.save(state, str(directory / "step" / "model.pt"))
            saved = time.perf_counter() - started
            time.sleep(compute)
            waited = time.perf_counter()
            self.engine.commit(info)
            ended = time.perf_counter()
            return Timing(saved, saved + ended - waited, ended - started)

    def death_detection(self, root: Path, state: dict[str, torch.Tensor]) -> float:
        from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

        with scratch(root, "deepspeed-death") as directory:
            info = CheckpointCommitInfo(tag="step", save_dir=str(directory), save_latest=True)
            (directory / "step").mkdir()
            self.engine.create(info)
            self.engine.save(state, str(directory / "step" / "model.pt"))
            os.kill(self.engine.ckpt_process.pid, signal.SIGKILL)
            started = time.perf_counter()
            try:
                self.engine.commit(info)
            except RuntimeError:
                return time.perf_counter() - started
            raise RuntimeError("DeepSpeed's commit succeeded after its writer was killed")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.engine.cleanup()
