"""``python -m aoffload``: ls, verify, inspect and clean on real checkpoint directories, and the
directory lock that keeps ``clean`` (and other engines) off a live engine's files."""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import aoffload
from aoffload._cli import EXIT_BUSY, EXIT_DAMAGED, EXIT_OK, EXIT_USAGE, main

ROOT = Path(__file__).resolve().parent.parent


def state(step: int) -> dict[str, object]:
    return {
        "model": {"w": torch.full((256,), float(step)), "b": torch.zeros(4, dtype=torch.int64)},
        "step": step,
        "config": {"lr": 0.1},
    }


async def _commit_two_tags(directory: Path) -> None:
    async with aoffload.CheckpointEngine(directory, durable=False) as engine:
        for step in (10, 20):
            await engine.save(state(step), "model.pt", tag=f"step-{step}")
            await engine.save([torch.ones(3, dtype=torch.float16)], "optim.pt", tag=f"step-{step}")
            await engine.commit(metadata={"step": step, "loss": 0.25} if step == 20 else None)


@pytest.fixture(scope="module")
def committed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with two committed tags, step-10 and step-20 (latest), two files each;
    step-20 was committed with metadata."""
    directory = tmp_path_factory.mktemp("committed") / "ckpt"
    asyncio.run(_commit_two_tags(directory))
    return directory


@pytest.fixture
def ckpt(committed: Path, tmp_path: Path) -> Path:
    """A private copy of ``committed`` that a test may damage."""
    return Path(shutil.copytree(committed, tmp_path / "ckpt"))


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(argv), out=out), out.getvalue()


def test_ls_lists_tags_with_latest_marked(ckpt: Path) -> None:
    (ckpt / ".tmp-step-30-0123abcd").mkdir()
    status, out = run("ls", str(ckpt))
    assert status == EXIT_OK
    lines = out.splitlines()
    assert lines[0].split() == ["TAG", "FILES", "BYTES", "AGE", "METADATA"]
    assert lines[1].split()[:2] == ["step-10", "2"]
    assert lines[1].endswith("ago")  # no metadata
    assert lines[2].split()[:3] == ["step-20", "*", "2"]
    assert "KiB" in lines[2]
    assert lines[2].endswith('ago    {"step": 20, "loss": 0.25}')  # after the padded age
    assert "1 leftover of interrupted runs" in out


async def _commit_one(directory: Path, state: object, **options: Any) -> None:
    metadata = options.pop("metadata", None)
    async with aoffload.CheckpointEngine(directory, durable=False, **options) as engine:
        await engine.save(state, "m.pt", tag="t")
        await engine.commit(metadata=metadata)


def test_ls_cuts_long_metadata_and_shows_no_column_without_any(tmp_path: Path) -> None:
    asyncio.run(_commit_one(tmp_path / "plain", {"w": torch.ones(2)}))
    lines = run("ls", str(tmp_path / "plain"))[1].splitlines()
    assert lines[0].split() == ["TAG", "FILES", "BYTES", "AGE"]
    asyncio.run(_commit_one(tmp_path / "long", {"w": torch.ones(2)}, metadata={"note": "x" * 200}))
    row = run("ls", str(tmp_path / "long"))[1].splitlines()[1]
    assert row.endswith('{"note": "' + "x" * 47 + "...")
    status, out = run("inspect", str(tmp_path / "long"))
    assert status == EXIT_OK
    assert 'metadata: {"note": "' + "x" * 200 + '"}' in out


def test_verify_passes_on_an_intact_checkpoint(ckpt: Path) -> None:
    assert run("verify", str(ckpt)) == (EXIT_OK, run("verify", str(ckpt), "--tag", "step-20")[1])
    status, out = run("verify", str(ckpt), "--all")
    assert status == EXIT_OK
    assert "step-10: 2 files" in out
    assert "step-20: 2 files" in out
    assert "FAILED" not in out


def test_verify_names_every_corrupt_and_missing_file(ckpt: Path) -> None:
    model = ckpt / "step-20" / "model.pt"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0x01
    model.write_bytes(data)
    (ckpt / "step-10" / "optim.pt").unlink()
    (ckpt / "step-10" / "model.pt").write_bytes(b"short")
    status, out = run("verify", str(ckpt), "--all")
    assert status == EXIT_DAMAGED
    assert "FAILED step-20/model.pt" in out
    assert "checksum mismatch" in out
    assert "FAILED step-10/optim.pt" in out
    assert "missing" in out
    assert "FAILED step-10/model.pt" in out
    assert "bytes on disk" in out
    assert "step-20/optim.pt" not in out
    assert "3 of 4 files failed verification" in out
    status, out = run("verify", str(ckpt))  # latest only: step-20
    assert status == EXIT_DAMAGED
    assert "step-20/model.pt" in out
    assert "step-10" not in out


def test_inspect_shows_tensors_dtypes_bytes_and_keys(ckpt: Path) -> None:
    status, out = run("inspect", str(ckpt), "--tag", "step-10")
    assert status == EXIT_OK
    assert "metadata" not in out
    assert 'metadata: {"step": 20, "loss": 0.25}' in run("inspect", str(ckpt))[1]
    assert "step-10/model.pt" in out
    assert "tensors: 2, 1.0 KiB (float32 x1, int64 x1)" in out
    assert "keys: model (dict, 2 tensors), step (int), config (dict)" in out
    assert "tensors: 1, 6 B (float16 x1)" in out
    assert "top level: list" in out
    (ckpt / "step-20" / "optim.pt").write_bytes(b"not a torch file")
    status, out = run("inspect", str(ckpt))
    assert status == EXIT_DAMAGED
    assert "optim.pt: 16 bytes on disk, the manifest says" in out  # verified before it loads


def test_inspect_loads_trusted_files_with_no_weights_only(tmp_path: Path) -> None:
    import collections

    state = {"w": torch.ones(2), "q": collections.deque([1])}
    asyncio.run(_commit_one(tmp_path, state, unloadable="ignore"))
    status, out = run("inspect", str(tmp_path))
    assert status == EXIT_DAMAGED
    assert "could not load" in out
    assert "weights_only=True" in out
    status, out = run("inspect", str(tmp_path), "--no-weights-only")
    assert status == EXIT_OK, out
    assert "keys: w (Tensor, 1 tensors), q (deque)" in out


def test_usage_errors_exit_2(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run("verify", str(tmp_path / "nowhere"))[0] == EXIT_USAGE
    assert run("verify", str(ckpt), "--tag", "nope")[0] == EXIT_USAGE
    assert "no committed checkpoint 'nope' (it has: step-10, step-20)" in capsys.readouterr().err
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / ".tmp-keep").mkdir()
    assert run("clean", str(tmp_path / "plain"))[0] == EXIT_USAGE
    assert (tmp_path / "plain" / ".tmp-keep").exists()  # not aoffload's: never touched
    with pytest.raises(SystemExit) as info:
        main(["verify", str(ckpt), "--tag", "step-10", "--all"])
    assert info.value.code == EXIT_USAGE
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == EXIT_OK
    assert "exit codes:" in capsys.readouterr().out


def test_clean_removes_leftovers_of_dead_runs_only(ckpt: Path) -> None:
    leftovers = [ckpt / ".tmp-step-30-0123abcd", ckpt / ".trash-step-1-89abcdef"]
    for path in leftovers:
        path.mkdir()
        (path / "model.pt").write_bytes(b"x" * 100)
    (ckpt / ".latest.tmp").write_text("step-30\n")
    status, out = run("clean", str(ckpt), "--dry-run")
    assert status == EXIT_OK
    assert "would remove 3 leftovers" in out
    assert all(path.exists() for path in leftovers)
    status, out = run("clean", str(ckpt))
    assert status == EXIT_OK
    assert "removed 3 leftovers, 208 B" in out
    assert not any(path.exists() for path in [*leftovers, ckpt / ".latest.tmp"])
    assert run("verify", str(ckpt), "--all")[0] == EXIT_OK
    assert (ckpt / "latest").read_text().strip() == "step-20"


def test_clean_and_a_second_engine_leave_a_live_engine_alone(tmp_path: Path) -> None:
    # Sync on purpose: the commands run asyncio.run() of their own while the engines' loop idles.
    directory = tmp_path / "ckpt"
    with asyncio.Runner() as runner:
        first = aoffload.CheckpointEngine(directory, durable=False)
        runner.run(first.astart())
        try:
            first.save(state(1), "model.pt", tag="step-1").result()
            staged = directory / ".tmp-step-0-live"  # as the live engine's writer would make it
            staged.mkdir()
            replica = aoffload.CheckpointEngine(directory, writer=False)  # readers may share
            runner.run(replica.astart())
            runner.run(replica.aclose())
            second = aoffload.CheckpointEngine(directory, durable=False)  # a second writer
            with pytest.raises(aoffload.CheckpointError, match="another live checkpoint engine"):
                runner.run(second.astart())
            assert staged.exists()  # neither touched the live engine's files
            assert run("clean", str(directory)) == (EXIT_BUSY, "")
            assert staged.exists()
            result = first.commit().result()
            assert result.files == ("model.pt",)
        finally:
            runner.run(first.aclose())
    (directory / ".tmp-step-2-dead").mkdir()
    status, out = run("clean", str(directory))
    assert status == EXIT_OK
    assert "removed 2 leftovers" in out


def test_python_m_aoffload_runs_the_command_line(
    ckpt: Path,
) -> None:
    (ckpt / ".tmp-step-30-dead").mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "aoffload", "verify", str(ckpt), "--all"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == EXIT_OK, done.stdout + done.stderr
    assert "step-20: 2 files" in done.stdout


@pytest.mark.parametrize(
    ("argv", "torch_imported"),
    [
        (["--help"], False),
        (["ls", "{ckpt}"], False),
        (["verify", "{ckpt}", "--all"], False),
        (["clean", "--dry-run", "{ckpt}"], False),
        (["inspect", "{ckpt}"], True),
    ],
    ids=["help", "ls", "verify", "clean", "inspect"],
)
def test_the_command_line_imports_torch_only_for_inspect(
    ckpt: Path, argv: list[str], torch_imported: bool
) -> None:
    """As the console script runs it: `from aoffload._cli import main; sys.exit(main())`."""
    code = (
        "import sys\n"
        "from aoffload._cli import main\n"
        "try:\n"
        "    main()\n"
        "finally:\n"
        "    print('torch imported:', 'torch' in sys.modules)\n"
    )
    args = [arg.format(ckpt=ckpt) for arg in argv]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == EXIT_OK, done.stderr
    assert done.stdout.splitlines()[-1] == f"torch imported: {torch_imported}"


def test_progress_bar_only_on_a_terminal_for_large_checkpoints() -> None:
    from aoffload._cli import PROGRESS_BYTES, _progress_bar

    assert _progress_bar(PROGRESS_BYTES - 1, True) is None
    assert _progress_bar(PROGRESS_BYTES, False) is None
    if not sys.stderr.isatty():
        assert _progress_bar(PROGRESS_BYTES, True) is None
