"""FSDP2 with torch.distributed.checkpoint through aoffload: saved on 2 ranks, resumed on 1 or 4.

The model is sharded with FSDP2's ``fully_shard`` over a CPU device mesh (gloo ranks), and
the model and optimizer state go through DCP's ``get_state_dict`` / ``set_state_dict``, so
every rank saves only its shards. They are saved with DCP's own ``async_save``, through
aoffload's route: ``aoffload.dcp.Stager`` copies the state while the next forward and
backward run, and ``aoffload.dcp.StorageWriter`` writes it through the engine's writer
process and commits it (checksums, the tag published atomically, ``latest``, old tags
retired). ``aoffload.dcp.StorageReader`` loads ``latest`` on any number of ranks: DCP's
planner reshards, the reader verifies every file and unpickles nothing it does not know.
Rank 0 prints the loss of every step, and a digest of the whole state (every rank's
shards) when a save is committed and when it resumes::

    python examples/dcp_fsdp2.py --dir /tmp/run --ranks 2 --kill-at 9   # dies at step 9
    python examples/dcp_fsdp2.py --dir /tmp/run --ranks 4               # resumes at step 6
    torchrun --nproc-per-node 4 examples/dcp_fsdp2.py --dir /tmp/run    # the same

The global batch is the same whatever the number of ranks (each takes an equal slice), so
a resumed run prints the losses the first run printed, up to the rounding of a sum over
another number of ranks; the digests at a save and at its resume are equal bit for bit.
Checkpoints are the tags ``DIR/step-N`` of an aoffload checkpoint directory, each a plain
DCP checkpoint too (``FileSystemReader`` reads it).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import aoffload
from aoffload.dcp import Stager, StorageReader, StorageWriter

GLOBAL_BATCH = 16


def build(mesh: DeviceMesh) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same initial model whatever the number of ranks
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
        torch.nn.Linear(64, 4),
    )  # fmt: skip
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)  # <- FSDP2: each rank holds a shard of each layer
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)  # step N's global batch never varies
    x = torch.randn(GLOBAL_BATCH, 32, generator=generator)
    y = x[:, :4].sin()
    rows = GLOBAL_BATCH // world
    return x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]


def digest(state: Any) -> str:
    """A hash of every value of the state, each DTensor gathered whole (a collective)."""
    hashed = hashlib.sha256()

    def walk(value: Any, key: str) -> None:
        if isinstance(value, dict):
            for name in sorted(value, key=str):
                walk(value[name], f"{key}.{name}")
        elif isinstance(value, list | tuple):
            for index, item in enumerate(value):
                walk(item, f"{key}.{index}")
        else:
            if isinstance(value, DTensor):
                value = value.full_tensor()
            if isinstance(value, torch.Tensor):
                data = value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
            else:
                data = repr(value).encode()
            hashed.update(key.encode() + b"=" + data)

    walk(state, "")
    return hashed.hexdigest()[:16]


def train(args: argparse.Namespace) -> None:
    world = dist.get_world_size()
    if GLOBAL_BATCH % world:
        raise SystemExit(f"--ranks must divide {GLOBAL_BATCH}")
    torch.set_num_threads(1)
    model, optimizer = build(init_device_mesh("cpu", (world,)))
    # DCP's save runs on a thread of its own: its collectives go on a group of their own,
    # never interleaved with the training step's on the default group
    checkpoint_group = dist.new_group(backend="gloo")
    with aoffload.CheckpointEngine(args.dir, distributed=world > 1, keep_last=2) as engine:
        stager = Stager()  # <- the copy runs on aoffload's threads, into shared memory
        try:
            run(args, model, optimizer, engine, stager, checkpoint_group)
        finally:
            stager.close()


def run(
    args: argparse.Namespace,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    engine: aoffload.CheckpointEngine,
    stager: Stager,
    checkpoint_group: Any,
) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    start = 0
    if engine.latest() is not None:  # <- resume on this many ranks, whatever saved it
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state, "step": 0}
        dcp.load(state, storage_reader=StorageReader(args.dir))  # latest, resharded, verified
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        start = state["step"]
        check = digest(state)
        if rank == 0:
            print(f"resumed from {engine.latest()} on {world} ranks, digest {check}", flush=True)
    saving: tuple[int, Any, str] | None = None
    for step in range(start + 1, args.steps + 1):
        if step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash: no rank says goodbye
        x, y = batch(step, rank, world)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()  # forward and backward overlapped the copy of the last save
        if saving is not None:
            saving[1].staging_completion.result()  # <- the fence: parameters change next
        optimizer.step()
        if saving is not None:  # one step later, the save is durable and published
            saved, response, check = saving
            response.upload_completion.result()
            if rank == 0:
                print(f"saved step-{saved} on {world} ranks, digest {check}", flush=True)
            saving = None
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            print(f"step {step} loss {total.item() / world:.8f}", flush=True)
        if step % args.save_every == 0:
            model_state, optim_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optim": optim_state, "step": step}
            response = dcp.async_save(  # <- save: returns while the copy runs
                state,
                storage_writer=StorageWriter(args.dir, tag=f"step-{step}"),
                async_stager=stager,
                process_group=checkpoint_group,
            )
            saving = (step, response, digest(state))
    if saving is not None:
        saving[1].upload_completion.result()


def run_rank(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        train(args)
    finally:
        dist.destroy_process_group()


def spawn_ranks(args: argparse.Namespace) -> int:
    """Start ``--ranks`` gloo ranks of this script, as torchrun would. When one fails, the
    others are stopped; the exit status is 0 only when every rank's was."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ranks = []
    for rank in range(args.ranks):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(args.ranks),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        ranks.append(subprocess.Popen([sys.executable, __file__, *sys.argv[1:]], env=env))
    pending = {process.pid: process for process in ranks}
    status = 0
    while pending:
        pid, how = os.wait()  # whichever rank ends first
        process, code = pending.pop(pid), os.waitstatus_to_exitcode(how)
        process.returncode, rank = code, ranks.index(process)
        if code != 0 and status == 0:
            what = f"killed by signal {-code}" if code < 0 else f"exited with {code}"
            print(f"rank {rank} {what}; stopping the others", file=sys.stderr, flush=True)
            for other in ranks:
                if other.pid in pending:
                    other.kill()
            status = 1
    return status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True, help="checkpoint directory")
    parser.add_argument("--ranks", type=int, default=2, help="gloo ranks to spawn")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--kill-at", type=int, default=0, help="SIGKILL every rank at this step")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        raise SystemExit(spawn_ranks(args))
    run_rank(args)


if __name__ == "__main__":
    main()
