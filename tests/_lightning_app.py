"""A tiny Lightning model and trainer for tests/test_lightning.py (also run as a process).

``python -m tests._lightning_app DIR STEPS WIDTH`` fits the model on CPU with
``ModelCheckpoint(every_n_train_steps=1, save_top_k=2)`` and aoffload's plugin, printing
``saving <step> <pid>`` as each save begins and ``staged <step> <pid>`` as it returns (its
commit begins): the test SIGKILLs it around those.

``python -m tests._lightning_app --zygote`` imports Lightning once and then forks one such
run per line ``DIR STEPS WIDTH`` it reads, so that each run the test kills costs a fork, not
an interpreter importing Lightning (seconds on a loaded host).
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from aoffload.lightning import AsyncCheckpointIO


class Tiny(L.LightningModule):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh())
        self.head = torch.nn.Linear(width, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.head(self.net(x)), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def data(batches: int = 8) -> torch.utils.data.DataLoader[Any]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batches * 4, 8, generator=generator)
    y = x.sum(dim=1, keepdim=True)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


class Record(Callback):
    """What the trainer saw: the global step it started at, each checkpoint as dumped."""

    def __init__(self, announce: AsyncCheckpointIO | None = None) -> None:
        self.started_at: int | None = None
        self.dumped: dict[int, dict[str, torch.Tensor]] = {}
        self.announce = announce

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.started_at = trainer.global_step

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        state = checkpoint["state_dict"]
        self.dumped[checkpoint["global_step"]] = {k: v.clone() for k, v in state.items()}
        if self.announce is not None:  # the writer starts on the first save
            print(f"saving {checkpoint['global_step']} {self.announce.pid}", flush=True)


def trainer(
    directory: Path, max_steps: int, plugin: AsyncCheckpointIO, *callbacks: Callback, **options: Any
) -> tuple[L.Trainer, ModelCheckpoint]:
    checkpoints = ModelCheckpoint(
        dirpath=directory,
        every_n_train_steps=options.pop("every", 2),
        save_top_k=options.pop("top_k", 2),
        monitor="step",
        mode="max",
        save_last=options.pop("save_last", None),
    )
    fit = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        plugins=[plugin],
        callbacks=[checkpoints, *callbacks],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **options,
    )
    return fit, checkpoints


class Announcing(AsyncCheckpointIO):
    """Prints ``staged <path>`` when a save returns: its commit has just begun."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        print(f"staged {checkpoint['global_step']} {self.pid}", flush=True)


def run(directory: Path, steps: int, width: int) -> None:
    plugin = Announcing(durable=True)
    fit, _ = trainer(directory, steps, plugin, Record(announce=plugin), every=1)
    fit.fit(Tiny(width), data(steps))
    print("done", flush=True)


def zygote() -> None:
    """Fork a run per line ``DIR STEPS WIDTH`` of stdin. The run prints ``run <pid>`` first;
    this process prints ``ended <pid> <wait status>`` once it ended (killed, or done)."""
    print("ready", flush=True)
    for line in sys.stdin:
        directory, steps, width = line.split()
        pid = os.fork()
        if pid == 0:  # the run: a process of its own, as a trainer is
            code = 0
            try:
                print(f"run {os.getpid()}", flush=True)
                run(Path(directory), int(steps), int(width))
            except BaseException:  # noqa: BLE001 - reported on stderr, the exit code says it
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(f"ended {pid} {status}", flush=True)


def main() -> None:
    if sys.argv[1:] == ["--zygote"]:
        zygote()
        return
    run(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))


if __name__ == "__main__":
    main()
