"""Bridge section, worker starts: where a start goes, the first and the later ones.

Each sample is a fresh interpreter (a *probe*, run with ``-c`` so nothing is re-imported as a
main module) that imports aoffload like a trainer, then measures, in this order:

* a multiprocessing ``spawn`` child that imports aoffload's worker side and reports ready:
  how every worker started before the worker server (the previous design), for comparison;
* its first aoffload worker start (the echo service): the worker server boots (a fresh
  interpreter, ``import torch``, ``import aoffload``), then forks the worker; the server's
  HELLO timestamps split it into those phases;
* later starts of the echo worker, of a ``CheckpointEngine`` and of a ``CPUAdam`` (torch
  backend): forks of the running server;
* two starts of a ``CPUAdam`` with DeepSpeed's op (already built), when DeepSpeed imports:
  each fork imports DeepSpeed and loads the op.

Right before each probe, ``import torch`` is timed in another fresh interpreter (the import
statement alone), so "first start beyond the torch import" pairs samples taken back to back;
"beyond its server's import torch" subtracts the import the start itself contained. Both
interpreters inherit this one's environment: with ``PYTHONDONTWRITEBYTECODE`` set, every
aoffload module is compiled at each import (an installed aoffload has its bytecode).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import multiprocessing
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ._common import Report, progress

SECTION = "bridge"
_ROOT = str(Path(__file__).resolve().parents[2])


def _spawned(conn: Connection, started: float) -> None:
    import aoffload._runtime.serve  # noqa: F401 - what a spawned worker imported before serving

    conn.send(time.monotonic() - started)
    conn.close()


def _spawn_start() -> float:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_spawned, args=(child, time.monotonic()), daemon=True)
    process.start()
    child.close()
    elapsed: float = parent.recv()
    parent.close()
    process.join(30)
    return elapsed


async def _timed_start(resource: Any) -> float:
    started = time.perf_counter()
    await resource.astart()
    elapsed = time.perf_counter() - started
    await resource.aclose()
    return elapsed


async def _aoffload_starts(later: int, directory: str) -> dict[str, Any]:
    import aoffload
    from aoffload._runtime import launcher
    from aoffload._runtime.bridge import Bridge

    from ._echo import TARGET, Echo

    started = time.perf_counter()
    async with Bridge(TARGET, name="bench-echo") as bridge:
        first = time.perf_counter() - started
        ready = time.monotonic()
        await bridge.request(Echo(0))
    [server] = launcher.servers()
    spawned, code, torch_done, aoffload_done, hello = server.boot
    echo = [await _timed_start(Bridge(TARGET, name="bench-echo")) for _ in range(later)]
    engine = [
        await _timed_start(aoffload.CheckpointEngine(directory, durable=False))
        for _ in range(later)
    ]
    adam = [
        await _timed_start(aoffload.CPUAdam([{"lr": 0.1}], backend="torch")) for _ in range(later)
    ]
    deepspeed = []
    if importlib.util.find_spec("deepspeed") is not None:
        deepspeed = [
            await _timed_start(aoffload.CPUAdam([{"lr": 0.1}], backend="deepspeed"))
            for _ in range(min(2, later))
        ]
    return {
        "first": first,
        "server interpreter": code - spawned,
        "server import torch": torch_done - code,
        "server import aoffload": aoffload_done - torch_done,
        "server ready": hello - aoffload_done,
        "fork to worker ready": ready - hello,
        "later echo": echo,
        "later engine": engine,
        "later adam": adam,
        "deepspeed adam": deepspeed,
    }


def probe(later: int) -> None:
    """A probe's body (a fresh interpreter): print its measurements as one JSON line."""
    import aoffload  # noqa: F401 - as a trainer would have, before its first start

    spawn = _spawn_start()
    with tempfile.TemporaryDirectory() as directory:
        measured = asyncio.run(_aoffload_starts(later, directory))
    print(json.dumps({"spawn": spawn, **measured}))


def _python(code: str) -> str:
    run = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {_ROOT!r})\n{code}"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if run.returncode != 0:
        raise RuntimeError(f"a start probe failed:\n{run.stderr[-3000:]}")
    return run.stdout.strip().splitlines()[-1]


def run(report: Report, *, quick: bool, smoke: bool = False) -> None:
    """Measure first and later worker starts, each beside ``import torch`` in this run."""
    probes, later = (1, 1) if smoke else (3, 5) if quick else (7, 10)
    torch_import: list[float] = []
    samples: list[dict[str, Any]] = []
    for i in range(probes):
        progress(f"bridge: worker starts, probe {i + 1} of {probes}")
        torch_import.append(
            float(
                _python(
                    "import time; t = time.perf_counter(); import torch; "
                    "print(time.perf_counter() - t)"
                )
            )
        )
        samples.append(
            json.loads(_python(f"from aoffload.bench._starts import probe; probe({later})"))
        )

    def add(system: str, metric: str, values: list[float]) -> None:
        report.add(SECTION, system, metric, "s", values)

    add("import torch (fresh interpreter)", "the import statement", torch_import)
    add("spawned child (the previous start)", "start to ready", [s["spawn"] for s in samples])
    add("aoffload worker", "first start in a process", [s["first"] for s in samples])
    add(
        "aoffload worker",
        "first start beyond import torch (paired)",
        [s["first"] - t for s, t in zip(samples, torch_import, strict=True)],
    )
    add(
        "aoffload worker",
        "first start beyond its server's import torch",
        [s["first"] - s["server import torch"] for s in samples],
    )
    for phase in (
        "server interpreter",
        "server import torch",
        "server import aoffload",
        "server ready",
        "fork to worker ready",
    ):
        add("aoffload worker, first start", phase, [s[phase] for s in samples])
    add("aoffload worker", "later start", [x for s in samples for x in s["later echo"]])
    add("aoffload CheckpointEngine", "later start", [x for s in samples for x in s["later engine"]])
    add("aoffload CPUAdam (torch)", "later start", [x for s in samples for x in s["later adam"]])
    deepspeed = [x for s in samples for x in s["deepspeed adam"]]
    if deepspeed:
        add("aoffload CPUAdam (DeepSpeed op, built)", "start", deepspeed)
        add(
            "aoffload CPUAdam (DeepSpeed op, built)",
            "start beyond a later engine start",
            [
                x - statistics.median(s["later engine"])
                for s in samples
                for x in s["deepspeed adam"]
            ],
        )
    later_median = statistics.median(x for s in samples for x in s["later echo"])
    progress(f"bridge: later worker start {later_median * 1e3:.0f} ms (median)")
