"""The writer never unpickles the state (#33): the file is ``torch.save``'s own, made from a
pickle the trainer's side produced, and whatever ``torch.save`` saves, aoffload saves.

On 4d44aee the writer unpickled the state's skeleton and called ``torch.save`` again, so a
class defined in the training script's ``__main__`` failed every save (``Can't get
attribute 'Config' on <module '__main__'>``), Lightning's ``save_hyperparameters()`` with
such a config included. The oracle here is torch itself: ``torch.save``'s bytes and
``torch.load`` without aoffload.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import struct
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

import aoffload
from aoffload.checkpoint.core import plan as _plan
from aoffload.checkpoint.writer.archive import Archive

from .test_checkpoint import _warm_up, assert_same  # noqa: F401 - the module's warm-up

ROOT = Path(__file__).resolve().parent.parent


def run_script(tmp_path: Path, source: str, *args: str) -> str:
    """Run ``source`` as a script (its classes live in ``__main__``); its stdout."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source))
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_a_dataclass_of_the_training_script_saves_and_loads(tmp_path: Path) -> None:
    out = run_script(
        tmp_path,
        """
        import dataclasses, sys
        import torch
        import aoffload

        @dataclasses.dataclass
        class Config:
            width: int = 16
            name: str = "run"

        def main() -> None:
            directory = sys.argv[1]
            state = {"config": Config(8, "x"), "w": torch.arange(4.0)}
            with aoffload.CheckpointEngine(directory, unloadable="ignore") as engine:
                engine.save(state, "m.pt", tag="t").result()
                engine.commit("t").result()
                loaded = engine.load("m.pt", weights_only=False).result()
            assert type(loaded["config"]) is Config and loaded["config"] == Config(8, "x")
            plain = torch.load(f"{directory}/t/m.pt", weights_only=False)  # no aoffload
            assert plain["config"] == Config(8, "x") and torch.equal(plain["w"], state["w"])
            print("ok")

        main()
        """,
        str(tmp_path / "ckpt"),
    )
    assert out.strip().endswith("ok")


@pytest.mark.filterwarnings("ignore")
def test_lightning_save_hyperparameters_with_a_config_of_the_script(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    out = run_script(
        tmp_path,
        """
        import dataclasses, os, sys
        import lightning as L
        import torch
        from lightning.pytorch.callbacks import ModelCheckpoint
        from aoffload.lightning import AsyncCheckpointIO

        @dataclasses.dataclass
        class Config:
            width: int = 4

        class Model(L.LightningModule):
            def __init__(self, config: Config) -> None:
                super().__init__()
                self.save_hyperparameters()
                self.net = torch.nn.Linear(2, config.width)

            def training_step(self, batch, batch_idx):
                return self.net(batch[0]).square().mean()

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        def main() -> None:
            directory = sys.argv[1]
            x = torch.randn(8, 2)
            loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)
            fit = L.Trainer(
                accelerator="cpu", devices=1, max_steps=2, logger=False,
                enable_progress_bar=False, enable_model_summary=False,
                plugins=[AsyncCheckpointIO(durable=False)],
                callbacks=[
                    ModelCheckpoint(dirpath=directory, every_n_train_steps=1, save_top_k=-1)
                ],
            )
            fit.fit(Model(Config(3)), loader)
            names = sorted(n for n in os.listdir(directory) if n.endswith(".ckpt"))
            assert names, os.listdir(directory)
            for name in names:
                loaded = torch.load(os.path.join(directory, name), weights_only=False)
                assert loaded["hyper_parameters"]["config"] == Config(3), loaded
            print("ok", len(names))

        main()
        """,
        str(tmp_path / "ckpt"),
    )
    assert out.strip().startswith("ok")


def many_things() -> dict[str, Any]:
    """What torch.save handles: every case below takes a path of its own."""
    base = torch.arange(64, dtype=torch.float32)
    return {
        "nested": {
            "list": [1, 2.5, "three", None, (4, 5)],
            "set": {1, 2},
            "od": collections.OrderedDict(a=1),
        },
        "shared": base,
        "view": base[8:24],
        "strided": base.view(8, 8).t(),
        "parameter": torch.nn.Parameter(torch.ones(3, 3)),
        "frozen": torch.nn.Parameter(torch.zeros(2), requires_grad=False),
        "grad": torch.ones(2, requires_grad=True),
        "bf16": torch.randn(5, 3).to(torch.bfloat16),
        "uint16": torch.arange(7).to(torch.uint16),  # saved untyped (_rebuild_tensor_v3)
        "conj": torch.randn(4, dtype=torch.complex64).conj(),
        "neg": torch.randn(4).neg(),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(3.5),
        "bool": torch.rand(9) > 0.5,
        "small bytes": b"\x00\xff" * 10,
        "big bytes": bytes(range(256)) * 1024,  # 256 KiB, high bytes included
        "again": None,  # the same big value twice (below)
        "bytearray": bytearray(b"\x80" * (100 << 10)),
        "text": "\u00e9t\u00e9 " * 50_000,  # a large non-ASCII str, kept by reference
        "dtype": torch.float16,
        "size": torch.Size([2, 3]),
    }


def loaded_equal(actual: Any, expected: Any) -> None:
    if isinstance(expected, torch.Tensor):
        assert type(actual) is type(expected)
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape)
        assert actual.stride() == expected.stride()
        assert actual.requires_grad == expected.requires_grad
        assert (actual.is_conj(), actual.is_neg()) == (expected.is_conj(), expected.is_neg())
        assert torch.equal(actual.detach().resolve_conj().resolve_neg(),
                           expected.detach().resolve_conj().resolve_neg())  # fmt: skip
    elif isinstance(expected, dict):
        assert type(actual) is type(expected)
        assert actual.keys() == expected.keys()
        for key in expected:
            loaded_equal(actual[key], expected[key])
    elif isinstance(expected, (list, tuple)) and not isinstance(expected, torch.Size):
        assert type(actual) is type(expected)
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            loaded_equal(a, e)
    else:
        assert type(actual) is type(expected)
        assert actual == expected


async def test_what_torch_save_handles_comes_back_as_torch_save_gives_it(tmp_path: Path) -> None:
    state = many_things()
    state["again"] = state["big bytes"]
    async with aoffload.CheckpointEngine(tmp_path, durable=False) as engine:
        await engine.save(state, "m.pt", tag="t")
        await engine.commit("t")
        ours = await engine.load("m.pt")
    path = tmp_path / "t" / "m.pt"
    plain = torch.load(path, weights_only=True)  # torch alone reads it
    reference = io.BytesIO()  # torch.save into a stream names its records archive/...
    torch.save(state, reference)
    expected = torch.load(io.BytesIO(reference.getvalue()), weights_only=True)
    for loaded in (ours, plain):
        loaded_equal(loaded, expected)
        views = [loaded[key].untyped_storage().data_ptr() for key in ("shared", "view", "strided")]
        assert len(set(views)) == 1, "views lost their one storage"
    raw = path.read_bytes()
    with zipfile.ZipFile(path) as archive, zipfile.ZipFile(reference) as other:
        assert archive.namelist() == other.namelist()  # torch.save's records, in its order
        for info in archive.infolist():
            name, extra = struct.unpack("<HH", raw[info.header_offset + 26 :][:4])
            assert (info.header_offset + 30 + name + extra) % 64 == 0, info.filename


def data_pkl(path_or_buffer: Any) -> bytes:
    with zipfile.ZipFile(path_or_buffer) as archive:
        info = archive.getinfo("archive/data.pkl")
        raw = archive.fp
        assert raw is not None
        raw.seek(info.header_offset + 26)
        name, extra = struct.unpack("<HH", raw.read(4))
        raw.seek(info.header_offset + 30 + name + extra)
        return raw.read(info.file_size)


def test_the_pickle_is_torch_saves_byte_for_byte() -> None:
    """The trainer's pickler reduces plain tensors itself, for speed: it must make the very
    opcodes torch's own reduction makes (no large bytes here: those the writer encodes)."""
    state = {k: v for k, v in many_things().items() if k not in ("big bytes", "bytearray")}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    planned = _plan.plan(state, "m.pt")
    assert b"".join(bytes(piece) for piece in planned.pickle) == data_pkl(buffer)
    assert not planned.blobs


class SparseOut:
    """A file the archive writes into, with holes where large records lie."""

    def __init__(self, file: Any) -> None:
        self.file, self.nbytes = file, 0

    def write(self, data: bytes | memoryview) -> int:
        self.file.write(data)
        self.nbytes += len(data)
        return len(data)

    def hole(self, nbytes: int, tail: bytes) -> None:
        self.file.seek(nbytes - len(tail), os.SEEK_CUR)
        self.file.write(tail)
        self.nbytes += nbytes


class _Storage:
    def __init__(self, kind: Any, key: str, numel: int) -> None:
        self.kind, self.key, self.numel = kind, key, numel


class _Tensor:
    """Pickles as torch pickles a flat tensor over a whole storage."""

    def __init__(self, storage: _Storage) -> None:
        self.storage = storage

    def __reduce__(self) -> Any:
        rebuild = torch._utils._rebuild_tensor_v2
        args = (self.storage, 0, (self.storage.numel,), (1,), False, collections.OrderedDict())
        return rebuild, args


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            return ("storage", obj.kind, obj.key, "cpu", obj.numel)
        return None


def test_records_of_4_gib_and_past_4_gib_are_zip64(tmp_path: Path) -> None:
    """A storage of 4 GiB or more, and records past the 4 GiB mark, need zip64 fields;
    written with holes (a sparse file), read back by torch.load(mmap=True)."""
    nbytes = (4 << 30) + 4096 + 3
    small = torch.arange(5.0)
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=2).dump(
        {
            "big": _Tensor(_Storage(torch.ByteStorage, "0", nbytes)),
            "small": _Tensor(_Storage(torch.FloatStorage, "1", 5)),
        }
    )
    path = tmp_path / "big.pt"
    with open(path, "wb") as file:
        out = SparseOut(file)
        archive = Archive(out)
        archive.record("data.pkl", buffer.getvalue())
        archive.preamble()
        archive.begin("data/0", nbytes)
        out.hole(nbytes, b"\x07\x08\x09")
        archive.end()
        archive.record("data/1", small.numpy().tobytes())
        archive.close()
    with zipfile.ZipFile(path) as listing:
        entries = {i.filename: (i.header_offset, i.file_size) for i in listing.infolist()}
    assert entries["archive/data/0"][1] == nbytes
    assert entries["archive/data/1"][0] > 1 << 32
    loaded = torch.load(path, mmap=True, weights_only=True)
    assert loaded["big"].shape == (nbytes,)
    assert loaded["big"][-3:].tolist() == [7, 8, 9]
    assert loaded["big"].data_ptr() % 64 == 0
    assert torch.equal(loaded["small"], small)
