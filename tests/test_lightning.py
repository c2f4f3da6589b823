"""aoffload.lightning.AsyncCheckpointIO under a real lightning.Trainer, on CPU.

Fits, resumes with ``ckpt_path=``, refuses a corrupt file, deletes only after the newer
checkpoints are durable, and a training process SIGKILLed in the middle of its saves
never leaves a checkpoint that Lightning would load half-written.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

import psutil
import torch
from lightning.pytorch.callbacks import Callback

import aoffload
from aoffload._cli import EXIT_OK, main
from aoffload.checkpoint.format import layout, read
from aoffload.lightning import AsyncCheckpointIO

from ._lightning_app import Record, Tiny, data, trainer

# Lightning's own warnings (about torch's pytree API, the data loader, a reused directory);
# aoffload's stay errors.
pytestmark = [
    pytest.mark.filterwarnings(r"ignore:.*isinstance\(treespec, LeafSpec\):FutureWarning"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),
    pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before"),
]

ROOT = Path(__file__).resolve().parent.parent
STORE = ".aoffload"


def checkpoints(directory: Path) -> list[str]:
    return sorted(e for e in os.listdir(directory) if e.endswith(".ckpt"))


def check_complete(path: Path) -> dict[str, Any]:
    """``path`` is a link to a published, verified file that torch.load reads whole."""
    assert path.is_symlink(), f"{path} is not aoffload's link"
    target = Path(os.path.realpath(path))
    assert target.is_file(), f"{path} links to nothing ({os.readlink(path)})"
    assert target.parent.parent == path.parent / STORE
    manifest = read.read_manifest(target.parent / layout.MANIFEST)
    read.verify_file(target, manifest["files"][target.name])
    loaded: dict[str, Any] = torch.load(path, weights_only=True)
    assert manifest["metadata"]["global_step"] == loaded["global_step"]
    assert manifest["metadata"]["lightning_path"] == path.name
    return loaded


def test_fit_saves_exact_snapshots_keeps_the_top_k_and_resumes(tmp_path: Path) -> None:
    record = Record()
    fit, saved = trainer(tmp_path, 8, AsyncCheckpointIO(durable=False), record, every=2)
    fit.fit(Tiny(), data())
    assert checkpoints(tmp_path) == ["epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt"]
    assert sorted(record.dumped) == [2, 4, 6, 8]
    for name in checkpoints(tmp_path):
        loaded = check_complete(tmp_path / name)
        # The file holds the state as Lightning dumped it, although training went on at
        # once: the plugin returned only after its copy.
        expected = record.dumped[loaded["global_step"]]
        assert loaded["state_dict"].keys() == expected.keys()
        for key, tensor in expected.items():
            assert torch.equal(loaded["state_dict"][key], tensor), key
    # save_top_k=2: the tags of steps 2 and 4 went with their links; `latest` is step 8.
    store = tmp_path / STORE
    assert read.scan(store, clean=False).tags == ["epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt"]
    assert read.read_latest(store) == "epoch=0-step=8.ckpt"

    resumed = Record()
    fit, saved = trainer(tmp_path, 12, AsyncCheckpointIO(durable=False), resumed, every=2)
    fit.fit(Tiny(), data(), ckpt_path=str(tmp_path / "epoch=0-step=8.ckpt"))
    assert resumed.started_at == 8
    assert sorted(resumed.dumped) == [10, 12]
    assert Path(saved.best_model_path).name == "epoch=1-step=12.ckpt"
    for name in checkpoints(tmp_path):
        check_complete(tmp_path / name)


def test_save_last_resumes_with_ckpt_path_last(tmp_path: Path) -> None:
    fit, _ = trainer(tmp_path, 4, AsyncCheckpointIO(durable=False), every=2, save_last=True)
    fit.fit(Tiny(), data())
    assert "last.ckpt" in checkpoints(tmp_path)
    assert check_complete(tmp_path / "last.ckpt")["global_step"] == 4
    resumed = Record()
    fit, _ = trainer(
        tmp_path, 6, AsyncCheckpointIO(durable=False), resumed, every=2, save_last=True
    )
    fit.fit(Tiny(), data(), ckpt_path="last")
    assert resumed.started_at == 4
    assert check_complete(tmp_path / "last.ckpt")["global_step"] == 6  # re-linked


class Disk(Callback):
    """The plugin's directory at each step, once the previous step's saves are under way:
    the tags there (committed, and being written) and the bytes of their files."""

    def __init__(self, store: Path) -> None:
        self.store = store
        self.seen: list[tuple[int, int, int]] = []  # step, tags, bytes
        self.largest = 0  # the bytes of the largest tag seen

    def look(self, step: int) -> None:
        if not self.store.is_dir():
            return
        tags, nbytes = 0, 0
        for entry in os.listdir(self.store):
            folder = self.store / entry
            kept = not entry.startswith(".") or entry.startswith(layout.TMP_PREFIX)
            if not kept or not folder.is_dir():
                continue  # the lock files; a retired tag being deleted (.trash-*)
            try:
                size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
            except FileNotFoundError:
                continue  # retired (renamed to .trash-*) while it was counted
            tags, nbytes, self.largest = tags + 1, nbytes + size, max(self.largest, size)
        self.seen.append((step, tags, nbytes))

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        self.look(trainer.global_step)


def test_save_last_and_dropped_checkpoints_free_their_space(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """10 saves of ``ModelCheckpoint(every_n_train_steps=8, save_top_k=2, save_last=True)``
    left 12 tags: each ``last.ckpt`` was a new tag, and none was removed."""
    disk = Disk(tmp_path / STORE)
    plugin = AsyncCheckpointIO(durable=False)
    fit, _ = trainer(tmp_path, 80, plugin, disk, every=8, save_last=True, top_k=2)
    fit.fit(Tiny(width=256), data(80))  # teardown: every save durable, every removal done
    disk.look(80)
    # In flight at any step: the checkpoint being written (max_pending=1), and the two a
    # save event replaces (the top-k one Lightning dropped, the older last.ckpt), each
    # removed on the commit thread once its newer one is durable, behind the commits
    # queued there by then. Without the fix the tags grew by one per save event (12 here).
    top_k, in_flight = 2, 3
    assert checkpoints(tmp_path) == ["epoch=0-step=72.ckpt", "epoch=0-step=80.ckpt", "last.ckpt"]
    assert check_complete(tmp_path / "last.ckpt")["global_step"] == 80
    store = read.scan(tmp_path / STORE, clean=False)
    assert len(store.tags) == top_k + 1
    linked = {Path(os.path.realpath(tmp_path / name)).parent.name for name in checkpoints(tmp_path)}
    assert set(store.tags) == linked  # nothing on disk that Lightning does not name
    for step, tags, nbytes in disk.seen:  # the bound held at every step
        assert tags <= top_k + 1 + in_flight, (step, tags, disk.seen)
        assert nbytes <= (top_k + 1 + in_flight) * disk.largest, (step, nbytes, disk.seen)
    assert disk.seen[-1][1] == top_k + 1

    # `aoffload ls` of the folder Lightning names finds them (in .aoffload/, and says so)
    out = io.StringIO()
    assert main(["ls", str(tmp_path)], out) == EXIT_OK, capsys.readouterr().err
    listed = out.getvalue()
    assert f"kept in {tmp_path / STORE}" in listed
    for tag in store.tags:
        assert tag in listed
    assert main(["verify", str(tmp_path), "--all"], io.StringIO()) == EXIT_OK


def test_a_corrupt_checkpoint_is_refused(tmp_path: Path) -> None:
    fit, _ = trainer(tmp_path, 2, AsyncCheckpointIO(durable=False), every=2)
    fit.fit(Tiny(), data())
    [name] = checkpoints(tmp_path)
    target = Path(os.path.realpath(tmp_path / name))
    with open(target, "r+b") as file:
        file.seek(-9, os.SEEK_END)
        byte = file.read(1)
        file.seek(-9, os.SEEK_END)
        file.write(bytes([byte[0] ^ 0xFF]))
    plugin = AsyncCheckpointIO(durable=False)
    with pytest.raises(aoffload.CorruptCheckpointError, match="checksum mismatch"):
        plugin.load_checkpoint(tmp_path / name)
    fit, _ = trainer(tmp_path, 4, AsyncCheckpointIO(durable=False), every=2)
    with pytest.raises(aoffload.CorruptCheckpointError, match="checksum mismatch"):
        fit.fit(Tiny(), data(), ckpt_path=str(tmp_path / name))


def test_removal_waits_for_the_newer_checkpoints_and_keeps_what_a_failure_needs(
    tmp_path: Path,
) -> None:
    plugin = AsyncCheckpointIO(durable=False)
    plugin.save_checkpoint({"w": torch.ones(4), "global_step": 1}, tmp_path / "a.ckpt")
    plugin.save_checkpoint({"w": torch.ones(4) * 2, "global_step": 2}, tmp_path / "b.ckpt")
    plugin.remove_checkpoint(tmp_path / "b.ckpt")  # the newest: `latest` moves back to a
    plugin.teardown()
    assert checkpoints(tmp_path) == ["a.ckpt"]
    assert read.read_latest(tmp_path / STORE) == "a.ckpt"
    assert read.scan(tmp_path / STORE, clean=False).tags == ["a.ckpt"]

    # A file where c's tag must go makes c's publication fail: a's removal, requested
    # after c's save, must then keep a, and c's failure is raised by the next call.
    (tmp_path / STORE / "c.ckpt").write_bytes(b"in the way")
    plugin.save_checkpoint({"w": torch.ones(4) * 3, "global_step": 3}, tmp_path / "c.ckpt")
    plugin.remove_checkpoint(tmp_path / "a.ckpt")
    with pytest.raises(aoffload.CheckpointError, match=r"could not publish checkpoint 'c\.ckpt'"):
        plugin.load_checkpoint(tmp_path / "a.ckpt")
    loaded = plugin.load_checkpoint(tmp_path / "a.ckpt")  # kept, and verified
    assert torch.equal(loaded["w"], torch.ones(4))
    plugin.teardown()
    assert checkpoints(tmp_path) == ["a.ckpt"]
    check_complete(tmp_path / "a.ckpt")


def test_weights_only_false_loads_what_the_default_refuses(tmp_path: Path) -> None:
    import collections

    plugin = AsyncCheckpointIO(durable=False, unloadable="ignore")
    state = {"w": torch.ones(2), "queue": collections.deque([1, 2]), "global_step": 0}
    plugin.save_checkpoint(state, tmp_path / "odd.ckpt")
    with pytest.raises(aoffload.CheckpointError, match="weights_only=True"):
        plugin.load_checkpoint(tmp_path / "odd.ckpt")
    assert plugin.load_checkpoint(tmp_path / "odd.ckpt", weights_only=False)["queue"] == (
        collections.deque([1, 2])
    )
    plugin.teardown()


def test_a_file_the_plugin_did_not_write_loads_and_removes_as_lightning_does(
    tmp_path: Path,
) -> None:
    torch.save({"w": torch.arange(3)}, tmp_path / "plain.ckpt")
    plugin = AsyncCheckpointIO(durable=False)
    assert torch.equal(plugin.load_checkpoint(tmp_path / "plain.ckpt")["w"], torch.arange(3))
    plugin.remove_checkpoint(tmp_path / "plain.ckpt")
    assert not (tmp_path / "plain.ckpt").exists()
    with pytest.raises(FileNotFoundError):
        plugin.load_checkpoint(tmp_path / "plain.ckpt")
    with pytest.raises(TypeError, match="storage_options"):
        plugin.save_checkpoint({}, tmp_path / "x.ckpt", storage_options={"a": 1})
    plugin.teardown()


@pytest.fixture
def zygote() -> Iterator[subprocess.Popen[str]]:
    """``python -m tests._lightning_app --zygote``: forks each run the test kills."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    process = subprocess.Popen(
        [sys.executable, "-m", "tests._lightning_app", "--zygote"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline() == "ready\n"
        yield process
    finally:
        process.kill()
        process.wait()
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                stream.close()


def _kill_during_a_save(
    zygote: subprocess.Popen[str], directory: Path, seed: int
) -> tuple[int, int]:
    """Fork a run of tests._lightning_app saving every step; SIGKILL it during a save.

    Even seeds kill it in a commit (up to 0.3 s after a save returned: the write, fsync,
    publication or link), odd ones in a copy (up to 30 ms after a save began). Returns the
    writer's pid and the step whose save was under way.
    """
    assert zygote.stdin is not None
    assert zygote.stdout is not None
    zygote.stdin.write(f"{directory} 60 {1 << 20}\n")
    zygote.stdin.flush()
    rng = random.Random(seed)
    phase, delay = ("staged", 0.3) if seed % 2 == 0 else ("saving", 0.03)
    run, killed = 0, None
    for line in zygote.stdout:
        words = line.split()
        if words[:1] == ["run"]:
            run = int(words[1])
        elif words[:1] == ["ended"]:
            assert killed is not None, "the run ended before it was killed"
            assert int(words[1]) == run
            status = int(words[2])
            assert os.WIFSIGNALED(status), status
            assert os.WTERMSIG(status) == signal.SIGKILL
            return killed
        elif killed is None and len(words) == 3:
            event, step, pid = words
            if event == phase and pid != "None" and int(step) >= 2 + seed % 3:
                time.sleep(rng.uniform(0.0, delay))
                os.kill(run, signal.SIGKILL)
                killed = int(pid), int(step)
    raise AssertionError("the zygote exited")


@pytest.mark.timeout(900)
def test_a_run_killed_during_saves_leaves_only_complete_checkpoints(
    tmp_path: Path, zygote: subprocess.Popen[str]
) -> None:
    seen: list[int] = []
    for seed in range(4):
        writer, step = _kill_during_a_save(zygote, tmp_path, seed)
        seen.append(step)
        # The writer follows its trainer (EOF on its pipe), once the write it is in ends.
        with contextlib.suppress(psutil.NoSuchProcess):  # gone already
            psutil.Process(writer).wait(timeout=120)  # raises TimeoutExpired if it stays
        assert not psutil.pid_exists(writer)
        names = checkpoints(tmp_path)
        assert names, "nothing was ever published"
        for name in names:  # every file Lightning could load is whole
            check_complete(tmp_path / name)
        store = read.scan(tmp_path / STORE, clean=False)  # every published tag complete
        for tag in store.tags:
            assert (tmp_path / STORE / tag / layout.MANIFEST).is_file()
    # Lightning resumes from the newest one a killed run left.
    steps = {name: check_complete(tmp_path / name)["global_step"] for name in names}
    newest = max(names, key=steps.__getitem__)
    resumed = Record()
    plugin = AsyncCheckpointIO(durable=False)
    fit, _ = trainer(tmp_path, steps[newest] + 1, plugin, resumed, every=1)
    fit.fit(Tiny(1 << 20), data(60), ckpt_path=str(tmp_path / newest))
    assert resumed.started_at == steps[newest]
    print(json.dumps({"killed during the saves of steps": seen, "left": names}))
