"""Remote section: uploads to an S3 endpoint, against s3fs doing the same, and what they cost.

The endpoint is moto's S3 server on loopback (:class:`aoffload._moto.S3Endpoint`), started
for the section; it runs on this machine's cores, so it is the ceiling of every figure here
(measured beside them: ``pipe`` of the same bytes from memory). In one run:

* **upload throughput**: ``commit()`` to ``uploaded()`` of a tag (local commit included),
  against ``s3fs.put`` of the same committed files from this process (its concurrent
  files and multipart parts), alternating repetitions; goal >= 0.9x;
* **the trainer's stall** (``stage()`` + the fence after a step that blocks the loop's
  thread, then ``commit_soon()``) with a remote tier whose uploads run during the next
  steps, against the same engine without one; goal <= 1.05x;
* **commit() time** (its ``commit_seconds``: the call until the tag is durable locally) in
  the same runs, with and without a remote tier: the remote tier must not slow it.

Needs ``s3fs`` and ``moto[server]`` (``pip install aoffload[dev]``); skipped without them.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ._common import Report, progress

__all__ = ["run"]

SECTION = "remote"
MB = 1e6


def _state(total_mib: int, files: int) -> dict[str, dict[str, torch.Tensor]]:
    rows = max(1, total_mib * (1 << 20) // files // 4 // 1024)
    return {f"part-{i}.pt": {"w": torch.rand(rows, 1024)} for i in range(files)}


def _block(seconds: float) -> None:
    time.sleep(seconds)  # the loop's thread waits for its accelerator: the loop never turns


async def _throughput(
    report: Report, url: str, root: Path, state: dict[str, Any], reps: int
) -> None:
    import fsspec

    import aoffload

    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    bucket = url.removeprefix("s3://").split("/")[0]
    ours, theirs, ceiling, after = [], [], [], []
    nbytes = 0
    # no retention: the removal of an old tag, which runs once uploaded() resolved, would
    # overlap (and slow) the s3fs.put timed next
    async with aoffload.CheckpointEngine(root / "tput", remote=url) as engine:
        for rep in range(reps + 1):  # the first is a warm-up
            tag = f"t{rep}"
            for name, part in state.items():
                await engine.save(part, name, tag=tag)
            started = time.perf_counter()
            result = await engine.commit(tag)
            committed = time.perf_counter()
            await engine.uploaded(tag)
            seconds = time.perf_counter() - started
            upload_only = time.perf_counter() - committed
            nbytes = result.bytes
            local = [str(root / "tput" / tag / name) for name in result.files]
            remote = [f"{bucket}/s3fs/{tag}/{name}" for name in result.files]
            started = time.perf_counter()
            await asyncio.to_thread(fs.put, local, remote)
            put_seconds = time.perf_counter() - started
            blobs = {
                f"{bucket}/pipe/{tag}/{n}": await asyncio.to_thread(Path(p).read_bytes)
                for n, p in zip(result.files, local, strict=True)
            }
            started = time.perf_counter()
            await asyncio.to_thread(fs.pipe, blobs)
            pipe_seconds = time.perf_counter() - started
            del blobs
            await asyncio.to_thread(fs.rm, [f"{bucket}/s3fs/{tag}", f"{bucket}/pipe/{tag}"], True)
            if rep:
                ours.append(nbytes / seconds / MB)
                after.append(nbytes / upload_only / MB)
                theirs.append(nbytes / put_seconds / MB)
                ceiling.append(nbytes / pipe_seconds / MB)
            progress(
                f"remote: {nbytes / MB:.0f} MB: aoffload {nbytes / seconds / MB:.1f} MB/s (local "
                f"commit {result.commit_seconds * 1e3:.0f} ms), s3fs"
                f".put {nbytes / put_seconds / MB:.1f} MB/s, pipe {nbytes / pipe_seconds / MB:.1f}"
            )
    size = f"{nbytes / MB:.0f} MB in {len(state)} files"
    a = report.add(
        SECTION, "aoffload commit() -> uploaded()", "upload throughput", "MB/s", ours, size
    )
    b = report.add(
        SECTION, "s3fs.put (same files, same process)", "upload throughput", "MB/s", theirs, size
    )
    report.add(
        SECTION, "moto ceiling (s3fs.pipe from memory)", "upload throughput", "MB/s", ceiling, size
    )
    c = report.add(
        SECTION,
        "aoffload commit() returned -> uploaded()",
        "upload throughput",
        "MB/s",
        after,
        size + "; the local commit's time left out",
    )
    report.ratio(SECTION, "aoffload / s3fs.put upload throughput (goal >= 0.9)", a, b)
    report.ratio(SECTION, "aoffload after the local commit / s3fs.put", c, b)


async def _stall(
    url: str | None, directory: Path, state: dict[str, Any], steps: int, step: float
) -> tuple[list[float], list[float]]:
    """The trainer's stall per step, and each ``commit()``'s own time (``commit_seconds``:
    from the call until the tag is durable locally), with or without a remote tier."""
    import aoffload

    stalls, commits = [], []
    async with aoffload.CheckpointEngine(directory, remote=url, keep_last=2) as engine:
        for n in range(steps + 1):
            tag = f"s{n}"
            started = time.perf_counter()
            staged = [engine.stage(part, name, tag=tag) for name, part in state.items()]
            call = time.perf_counter() - started
            _block(step)
            fenced = time.perf_counter()
            for one in staged:
                await one
            stall = call + time.perf_counter() - fenced
            if n > 1:  # the previous commit ended during this step: its result, at once
                commits.append((await engine.commit(f"s{n - 1}")).commit_seconds)
            engine.commit_soon(tag)
            if n:
                stalls.append(stall)
        commits.append((await engine.commit(f"s{steps}")).commit_seconds)
        if url is not None:
            await engine.uploaded()
    return stalls, commits


def run(report: Report, *, quick: bool, smoke: bool = False) -> None:
    """Measure the remote section (moto on loopback)."""
    missing = [m for m in ("s3fs", "moto", "boto3") if importlib.util.find_spec(m) is None]
    if missing:
        report.skip(
            SECTION, "remote tier", f"needs {', '.join(missing)} (pip install aoffload[dev])"
        )
        return
    from .._moto import S3Endpoint

    total_mib, files = (4, 2) if smoke else (16, 2) if quick else (64, 4)
    # 9 repetitions: one upload takes 0.3-0.5 s, and on a shared host single ones spread
    # 0.8-1.4x around the median (5 left the ratio of medians swinging by +-0.1)
    reps, steps, step = (1, 1, 0.05) if smoke else (3, 4, 0.5) if quick else (9, 8, 1.0)
    alternations = 1 if smoke else 2  # --smoke: each system once; it measures nothing
    state = _state(total_mib, files)
    with (
        S3Endpoint.start() as endpoint,
        tempfile.TemporaryDirectory(prefix="aoffload-bench-") as tmp,
    ):
        saved = {name: os.environ.get(name) for name in endpoint.environ}
        os.environ.update(endpoint.environ)  # the uploader processes inherit it
        try:
            url = f"s3://{endpoint.bucket()}/bench"
            root = Path(tmp)
            progress(f"remote: moto on {endpoint.url}, {total_mib} MiB per checkpoint")
            asyncio.run(_throughput(report, url, root, state, reps))
            without: list[float] = []
            with_remote: list[float] = []
            commit_without: list[float] = []
            commit_with: list[float] = []
            for rep in range(alternations):  # alternate, twice, to spread the host's noise
                stalls, commits = asyncio.run(
                    _stall(None, root / f"local-{rep}", state, steps, step)
                )
                without += stalls
                commit_without += commits
                stalls, commits = asyncio.run(
                    _stall(f"{url}-stall-{rep}", root / f"remote-{rep}", state, steps, step)
                )
                with_remote += stalls
                commit_with += commits
            stall_note = f"stage() + fence after a {step} s step that blocks the loop"
            for metric, note, ratio, with_, without_ in (
                ("trainer stall", stall_note, "stall with / without a remote tier (goal <= 1.05)",
                 with_remote, without),
                ("commit() time", "commit() call to durable locally (commit_seconds)",
                 "commit() time with / without a remote tier", commit_with, commit_without),
            ):  # fmt: skip
                a = report.add(SECTION, "aoffload with remote=", metric, "ms",
                               [s * 1e3 for s in with_], f"{note}, {total_mib} MiB")  # fmt: skip
                b = report.add(SECTION, "aoffload without remote", metric, "ms",
                               [s * 1e3 for s in without_], f"{note}, {total_mib} MiB")  # fmt: skip
                report.ratio(SECTION, ratio, a, b)
            progress(
                f"remote: stall {statistics.median(with_remote) * 1e3:.1f} ms with, "
                f"{statistics.median(without) * 1e3:.1f} ms without"
            )
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    report.notes.append(
        "remote: the S3 endpoint is moto on loopback, on this machine's cores (its ceiling "
        "is shown); a real object store's figures differ"
    )
