"""aoffload.deepspeed.AsyncCheckpointEngine on a real DeepSpeed engine (CPU, gloo, world size 1)."""

from __future__ import annotations

import gc
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip(
    "deepspeed", reason="DeepSpeed is not installed (pip install aoffload[deepspeed])"
)

import aoffload
from tests._leaks import Snapshot

pytestmark = pytest.mark.deepspeed

CONFIG: dict[str, Any] = {
    "train_batch_size": 4,
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
    "zero_optimization": {"stage": 0},
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def single_process_env() -> None:
    """The environment deepspeed.initialize needs for world size 1 on this machine."""
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    # What the deepspeed launcher sets; its decoupled writer config reads them.
    env.update(CROSS_RANK="0", CROSS_SIZE="1")
    for key, value in env.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def initialize_engine(config: dict[str, Any] = CONFIG) -> Any:
    """A tiny MLP under deepspeed.initialize, on CPU with gloo and world size 1."""
    import deepspeed

    single_process_env()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    engine, _, _, _ = deepspeed.initialize(
        model=model, config=config, model_parameters=model.parameters()
    )
    return engine


def train_step(engine: Any) -> None:
    x = torch.randn(4, 8)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()


def weights(engine: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def optimizer_state(engine: Any) -> dict[str, Any]:
    state = engine.optimizer.state_dict()
    return {
        "step": [s["step"].clone() for s in state["state"].values()],
        "exp_avg": [s["exp_avg"].clone() for s in state["state"].values()],
        "exp_avg_sq": [s["exp_avg_sq"].clone() for s in state["state"].values()],
    }


def read_latest(directory: Path) -> str | None:
    try:
        return (directory / "latest").read_text().strip()
    except FileNotFoundError:
        return None


@pytest.fixture(scope="module")
def ds_engine() -> Iterator[Any]:
    engine = initialize_engine()
    yield engine
    engine.destroy()


@pytest.fixture
def ckpt(ds_engine: Any, tmp_path: Path) -> Iterator[Any]:
    from aoffload.deepspeed import install

    installed = install(ds_engine, directory=tmp_path / "ckpt")
    yield installed
    installed.cleanup()


def test_install_puts_a_real_checkpoint_engine_subclass_on_the_engine(
    ds_engine: Any, ckpt: Any
) -> None:
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    from aoffload.deepspeed import AsyncCheckpointEngine

    assert ds_engine.checkpoint_engine is ckpt
    assert isinstance(ckpt, AsyncCheckpointEngine)
    assert isinstance(ckpt, CheckpointEngine)
    assert ckpt.is_decoupled()
    assert ckpt.pid is not None


def test_save_commit_at_step_and_load_round_trip(ds_engine: Any, ckpt: Any) -> None:
    directory = Path(ckpt.directory)
    train_step(ds_engine)
    saved_weights, saved_optim = weights(ds_engine), optimizer_state(ds_engine)
    ds_engine.save_checkpoint(str(directory), tag="t1")
    # Nothing is published until the step boundary commits, and DeepSpeed must not name it.
    assert read_latest(directory) is None
    train_step(ds_engine)  # commit starts here, the trainer does not wait for it
    train_step(ds_engine)
    ckpt.wait()
    assert read_latest(directory) == "t1"
    # Plain torch.load reads the file written by aoffload's worker.
    state = torch.load(directory / "t1" / "mp_rank_00_model_states.pt", weights_only=False)
    for key, value in saved_weights.items():
        assert torch.equal(state["module"][key], value), key
    # Training moved on after the snapshot.
    assert any(not torch.equal(v, saved_weights[k]) for k, v in weights(ds_engine).items())
    load_path, _ = ds_engine.load_checkpoint(str(directory))
    assert load_path is not None
    for key, value in weights(ds_engine).items():
        assert torch.equal(value, saved_weights[key]), key
    for key, values in optimizer_state(ds_engine).items():
        for got, want in zip(values, saved_optim[key], strict=True):
            assert torch.equal(got, want), key


def saved_module(directory: Path, tag: str) -> dict[str, torch.Tensor]:
    """The module weights of checkpoint ``tag``, verified against its manifest."""
    state = aoffload.load_checkpoint(directory, "mp_rank_00_model_states.pt", tag=tag).result()
    return dict(state["module"])


def assert_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key


def test_latest_only_ever_names_durable_checkpoints(ds_engine: Any, ckpt: Any) -> None:
    directory = Path(ckpt.directory)
    seen: list[str] = []
    saved: dict[str, dict[str, torch.Tensor]] = {}
    for index in range(4):
        train_step(ds_engine)
        saved[f"s{index}"] = weights(ds_engine)
        ds_engine.save_checkpoint(str(directory), tag=f"s{index}")
        for _ in range(2):
            train_step(ds_engine)
            latest = read_latest(directory)
            if latest is not None:
                # Whatever `latest` names is complete and holds what was saved under it.
                assert_weights(saved_module(directory, latest), saved[latest])
                seen.append(latest)
    ckpt.wait()
    assert read_latest(directory) == "s3"
    assert_weights(saved_module(directory, "s3"), saved["s3"])
    assert seen == sorted(seen)  # never moves backwards


def test_two_saves_without_a_step_both_commit(ds_engine: Any, ckpt: Any) -> None:
    directory = Path(ckpt.directory)
    train_step(ds_engine)
    at_a = weights(ds_engine)
    ds_engine.save_checkpoint(str(directory), tag="a")
    ds_engine.save_checkpoint(str(directory), tag="b")
    train_step(ds_engine)
    ckpt.wait()
    assert read_latest(directory) == "b"
    assert_weights(saved_module(directory, "a"), at_a)
    assert_weights(saved_module(directory, "b"), at_a)  # no step between the two saves


def test_writer_killed_before_commit_keeps_latest_and_raises_at_the_next_step(
    ds_engine: Any, tmp_path: Path
) -> None:
    """The step that commits "doomed" raises if the death is already seen when it starts the
    commit (the reader thread sees it a few ms after the SIGKILL: a race this test does not
    control); otherwise the commit starts and the next wait raises. Either way the error is
    WorkerDiedError and `latest` still names the good tag."""
    from aoffload.deepspeed import install

    before = Snapshot.take()
    directory = tmp_path / "ckpt"
    ckpt = install(ds_engine, directory=directory)
    try:
        train_step(ds_engine)
        ds_engine.save_checkpoint(str(directory), tag="good")
        train_step(ds_engine)
        ckpt.wait()
        ds_engine.save_checkpoint(str(directory), tag="doomed")
        os.kill(ckpt.pid, signal.SIGKILL)

        def step_then_wait() -> None:
            train_step(ds_engine)  # starts the commit of "doomed"; the trainer does not wait
            ckpt.wait()

        with pytest.raises(aoffload.WorkerDiedError, match="checkpoint-writer worker"):
            step_then_wait()
        assert read_latest(directory) == "good"
        aoffload.load_checkpoint(directory, "mp_rank_00_model_states.pt").result()
    finally:
        ckpt.cleanup()
        ckpt.cleanup()  # idempotent
    # The model engine itself is fine: put a working checkpoint engine back.
    fresh = install(ds_engine, directory=tmp_path / "again")
    fresh.cleanup()
    gc.collect()
    # Processes, threads and shared memory; not fds, which torch/uvloop open lazily on first use.
    leaks = [p for p in Snapshot.take().leaked_since(before) if "file descriptors" not in p]
    assert leaks == []


def test_replica_writes_nothing(ds_engine: Any, tmp_path: Path) -> None:
    from aoffload.deepspeed import install

    directory = tmp_path / "replica"
    ckpt = install(ds_engine, directory=directory, writer=False)
    try:
        assert not ckpt.is_data_parallel_writer(0)
        train_step(ds_engine)
        ds_engine.save_checkpoint(str(directory), tag="r")
        train_step(ds_engine)
        ckpt.wait()
        assert read_latest(directory) is None
        assert not (directory / "r").exists()
    finally:
        ckpt.cleanup()


def test_save_16bit_model_is_a_plain_synchronous_export(ds_engine: Any, ckpt: Any) -> None:
    export = Path(ckpt.directory).parent / "export"
    train_step(ds_engine)
    assert ds_engine.save_16bit_model(str(export), "model.bin")
    state = torch.load(export / "model.bin", weights_only=True)
    for key, value in weights(ds_engine).items():
        assert torch.equal(state[key], value), key
    train_step(ds_engine)  # DeepSpeed's commit of the export finds nothing to publish
    ckpt.wait()
    assert read_latest(export) is None
    assert read_latest(Path(ckpt.directory)) is None


def test_every_public_name_is_documented() -> None:
    import inspect

    import aoffload.deepspeed

    for name in aoffload.deepspeed.__all__:
        obj = getattr(aoffload.deepspeed, name)
        assert inspect.getdoc(obj), name
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if not attr.startswith("_") and (callable(member) or isinstance(member, property)):
                    assert inspect.getdoc(member), f"{name}.{attr}"
