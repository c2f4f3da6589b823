"""Copies of DeepSpeed's CPU Adam op build, for the tests that load it."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from aoffload import CPUAdam
from aoffload.optimizer.worker._deepspeed_op import build_directory
from aoffload.optimizer.worker._deepspeed_stamp import STAMP, stamp_mismatch


def built_op() -> str:
    """The build directory of DeepSpeed's op in this environment, built and stamped (by a
    worker loading it through DeepSpeed) if it was not."""
    directory = build_directory()
    if stamp_mismatch(directory) is not None:

        async def start() -> None:
            async with CPUAdam([{"lr": 0.1}], backend="deepspeed", worker_cores=None):
                pass

        asyncio.run(start())
    return directory


def copy_of_build(built: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of that build without a stamp (every mtime kept, so ninja has nothing to do),
    which the calling test's workers use (its TORCH_EXTENSIONS_DIR)."""
    copy = tmp_path.resolve() / "extensions" / "cpu_adam"  # as /proc/PID/maps names it
    copy.mkdir(parents=True)
    for entry in os.scandir(built):
        if entry.is_file() and entry.name != "lock" and STAMP not in entry.name:
            shutil.copy2(entry.path, copy / entry.name)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(copy.parent))
    return copy
