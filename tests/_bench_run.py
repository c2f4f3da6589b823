"""The suite's one run of the whole benchmark (``--smoke``), shared by the tests that read it.

It is the suite's longest run (about 90 s of one core), and the rest of the suite leaves a
core idle about half the time: so it starts in the background as soon as the suite is
collected (:func:`start_bench_smoke`, from ``tests/conftest.py``) and the first test that
reads it waits for what is left of it (:meth:`BenchSmoke.wait`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests import _leaks

__all__ = ["BenchRun", "BenchSmoke", "start_bench_smoke"]

TIMEOUT = 600.0


@dataclasses.dataclass(frozen=True)
class BenchRun:
    """One run of ``python -m aoffload.bench``: its exit status, output, JSON report, the
    per-section reports of ``--json-dir`` (by section) and the charts of ``--plot``."""

    returncode: int
    stdout: str
    stderr: str
    data: dict[str, Any] | None
    sections: dict[str, dict[str, Any]]
    charts: Path


class BenchSmoke:
    """``python -m aoffload.bench all --smoke`` running in ``directory`` (its files and
    reports); :meth:`wait` for its :class:`BenchRun`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._out = directory / "bench.json"
        self._sections, self._charts = directory / "sections", directory / "plots"
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        self._process = subprocess.Popen(  # --smoke: every section and system once, tiny states
            [sys.executable, "-m", "aoffload.bench", "all", "--smoke", "--json", str(self._out),
             "--json-dir", str(self._sections), "--plot", str(self._charts),
             "--dir", str(directory)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        _leaks.BACKGROUND.add(self._process.pid)  # its /dev/shm segments are not the tests'
        self._run: BenchRun | None = None

    def wait(self) -> BenchRun:
        """What the run reported, once it has ended (the same object on every call)."""
        if self._run is None:
            try:
                stdout, stderr = self._process.communicate(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                self._process.kill()
                stdout, stderr = self._process.communicate()
                stderr += f"\n(killed: the smoke run outlasted {TIMEOUT:.0f} s)"
            data = json.loads(self._out.read_text()) if self._out.exists() else None
            sections = {
                path.stem.removeprefix("bench-"): json.loads(path.read_text())
                for path in sorted(self._sections.glob("bench-*.json"))
            }
            self._run = BenchRun(
                self._process.returncode, stdout, stderr, data, sections, self._charts
            )
        return self._run

    def stop(self) -> None:
        """Kill the run if it is still going, then remove its directory."""
        if self._process.poll() is None:
            self._process.kill()
        self._process.communicate()
        shutil.rmtree(self.directory, ignore_errors=True)


def start_bench_smoke() -> BenchSmoke:
    """Start the smoke run in a directory of its own (removed by :meth:`BenchSmoke.stop`)."""
    return BenchSmoke(Path(tempfile.mkdtemp(prefix="aoffload-bench-smoke-")))
