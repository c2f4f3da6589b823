"""Run a function on N real ranks: processes joined by torch.distributed on gloo.

``run_ranks(world, "tests.module:function", tmp_path, **kwargs)`` starts ``world``
processes with the environment a launcher sets (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT, CROSS_RANK, CROSS_SIZE), initialises the default process group on gloo
and calls ``function(rank, world, directory, **kwargs)`` in each. It returns one
:class:`Outcome` per rank: what the function returned (JSON), or its traceback, or the
exit code of a rank that died.

The ranks are forked from multiprocessing's forkserver, which has imported torch once for
the whole session: a rank then starts in milliseconds instead of the seconds of its own
import of torch (four ranks at once took several seconds of both cores, test after test).
Each rank gets the environment of the moment it is started, as a spawned one would.
"""

from __future__ import annotations

import datetime
import importlib
import io
import json
import multiprocessing
import os
import socket
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Outcome:
    rank: int
    exitcode: int | None
    value: Any = None
    error: str | None = None

    def check(self) -> Any:
        if self.error is not None or self.exitcode != 0:
            raise AssertionError(f"rank {self.rank} (exit {self.exitcode}) failed:\n{self.error}")
        return self.value


_PRELOAD = ["torch", "torch.distributed", "tests._ranks"]
"""What the forkserver imports before it forks any rank: no threads start, CUDA stays
uninitialised (forking after either would be unsafe)."""


def forkserver_context() -> Any:
    """multiprocessing's forkserver context, its server preloaded with torch."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def _rank_main(
    target: str,
    rank: int,
    world: int,
    port: int,
    directory: str,
    kwargs: dict[str, Any],
    environ: dict[str, str],
) -> None:
    # The forkserver's environment is that of its own start: the caller's, as of now, wins.
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        CROSS_RANK="0",
        CROSS_SIZE="1",
    )
    import torch.distributed as dist

    result_path = Path(directory) / f".rank-{rank}.json"
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    try:
        module, _, name = target.partition(":")
        value = getattr(importlib.import_module(module), name)(
            rank, world, Path(directory), **kwargs
        )
        result_path.write_text(json.dumps({"value": value}))
    except BaseException:
        result_path.write_text(json.dumps({"error": traceback.format_exc()}))
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(
    world: int, target: str, directory: Path, *, timeout: float = 90.0, **kwargs: Any
) -> list[Outcome]:
    """Run ``target`` on ``world`` ranks; every rank's :class:`Outcome`, in rank order."""
    context = forkserver_context()
    port = free_port()
    directory.mkdir(parents=True, exist_ok=True)
    processes = [
        context.Process(
            target=_rank_main,
            args=(target, rank, world, port, str(directory), kwargs, dict(os.environ)),
            name=f"rank-{rank}",
        )
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    outcomes = []
    for rank, process in enumerate(processes):
        process.join(timeout)
        if process.is_alive():
            for other in processes:
                other.kill()
            raise AssertionError(f"rank {rank} did not finish within {timeout} s")
        result_path = directory / f".rank-{rank}.json"
        found = json.loads(result_path.read_text()) if result_path.exists() else {}
        result_path.unlink(missing_ok=True)
        outcomes.append(Outcome(rank, process.exitcode, found.get("value"), found.get("error")))
    return outcomes


MANIFEST = ".aoffload-manifest.json"
"""A tag's manifest, named here, not imported: these checks do not trust aoffload's code."""


def check_files(tag: str, manifest: bytes, read: Callable[[str], bytes]) -> dict[str, bytes]:
    """Every file the manifest ``tag`` lists, read with ``read(name)``, with the manifest's
    size and xxh3-64 (computed here with xxhash, not by aoffload's verifier); each ``.pt``
    file loads with ``torch.load``. Their contents by name; AssertionError for a partial tag.
    """
    import xxhash

    try:
        listed = json.loads(manifest)["files"]
    except (ValueError, KeyError) as exc:
        raise AssertionError(f"tag {tag!r}: an unreadable manifest ({exc!r})") from exc
    contents = {}
    for name, entry in listed.items():
        data = read(name)
        if len(data) != entry["bytes"]:
            raise AssertionError(f"partial tag {tag!r}: {name} has {len(data)} bytes, not {entry}")
        if xxhash.xxh3_64(data).hexdigest() != entry["xxh3_64"]:
            raise AssertionError(f"partial tag {tag!r}: {name} does not hash to {entry}")
        if name.endswith(".pt"):
            torch.load(io.BytesIO(data), weights_only=False)  # a whole torch.save file
        contents[name] = data
    return contents


def complete_tags(directory: Path) -> list[str]:
    """Every visible tag directory, each checked complete without aoffload's code: its
    manifest read as JSON, every file it lists present with that size and xxh3-64
    (:func:`check_files`), and nothing else in the tag.

    Raises AssertionError for a tag directory without a manifest or with a file that
    does not match it: a partial tag.
    """
    tags = []
    for entry in sorted(os.listdir(directory)):
        path = directory / entry
        if entry.startswith(".") or not path.is_dir():
            continue
        manifest_path = path / MANIFEST
        if not manifest_path.is_file():
            raise AssertionError(f"partial tag {entry!r}: no manifest; it holds {os.listdir(path)}")
        listed = check_files(
            entry, manifest_path.read_bytes(), lambda name, path=path: (path / name).read_bytes()
        )
        present = {
            str((Path(folder) / name).relative_to(path))
            for folder, _, names in os.walk(path)
            for name in names
        }
        expected = set(listed) | {MANIFEST}
        if present != expected:
            raise AssertionError(f"tag {entry!r}: files {present ^ expected} not as listed")
        tags.append(entry)
    return tags


def assert_saved(data: bytes | Path, expected: Mapping[str, torch.Tensor]) -> None:
    """The ``torch.save`` file ``data`` holds exactly ``expected``: the values a rank saved."""
    source = io.BytesIO(data) if isinstance(data, bytes) else data
    loaded = torch.load(source, weights_only=True)
    assert sorted(loaded) == sorted(expected), (sorted(loaded), sorted(expected))
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), f"{key} differs from what was saved"
