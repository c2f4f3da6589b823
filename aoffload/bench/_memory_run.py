"""One system of the ``memory`` section, run in a spawned process (the trainer).

``main(kind, root, nbytes, options, out)`` makes the state, runs the system and writes
what it measured to ``out`` (JSON): the ``time.monotonic()`` windows of an idle moment
before the state exists and of each save (the section's own process samples this
process's tree PSS and finds the peaks inside them), and per save its times. Kinds:

* ``aoffload``: a :class:`~aoffload.CheckpointEngine` (``options["cap"]``: its
  ``staging_bytes``, ``None`` for the default), a synchronous trainer: ``stage()``, a
  blocking step, the fence, ``commit()``; saves whose PSS is sampled (``runs``), then timed
  saves with the sampling paused (``timed``), each commit followed by a raw ``O_DIRECT``
  write+fsync of as many bytes (paired, outside the timed spans); the last checkpoint
  loaded back and compared;
* ``long``: ``options["saves"]`` saves of the state, the PSS of this process and of its
  writer read after save ``options["early"]`` and after the last;
* ``dcp``: DCP's ``async_save`` (THREAD) with a ``DefaultStager`` (async staging, shared
  memory: its lowest stall on the CPU) and ``FileSystemWriter``; ``torch_checkpointing``:
  its ``CheckpointManager``. One warm-up save each (its staging buffers then exist), sampled
  saves, then timed ones.

The section's process samples PSS from outside, and a sample of a process with GiBs
resident costs it most of a core (:class:`._pss.PssSampler`): every figure of time here
comes from saves made while the sampling is paused (:func:`._pss.paused`), and every figure
of memory from saves made while it runs.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from ._pss import paused

__all__ = ["main"]

IDLE_SECONDS = 0.2
TENSOR_BYTES = 64 << 20


def _state(nbytes: int) -> dict[str, Any]:
    import torch

    size = min(TENSOR_BYTES, max(4, nbytes))
    generator = torch.Generator().manual_seed(0)
    return {
        f"layer{i}.weight": torch.rand(size // 4, generator=generator)
        for i in range(max(1, nbytes // size))
    }


def _idle() -> list[float]:
    start = time.monotonic()
    time.sleep(IDLE_SECONDS)
    return [start, time.monotonic()]


def _aoffload(
    root: Path, state: dict[str, Any], options: dict[str, Any], quiet: Any, resting: Any
) -> dict[str, Any]:
    import torch

    import aoffload

    from ._checkpoint import disk_seconds

    cap, steps, reps = options["cap"], options["steps"], options["reps"]
    runs: list[dict[str, Any]] = []
    timed: list[dict[str, Any]] = []
    directory = root / "ckpt"
    with aoffload.CheckpointEngine(directory, keep_last=1, staging_bytes=cap) as engine:
        number = 0

        def save(step: float, raw: bool = True) -> dict[str, Any]:
            nonlocal number
            number += 1
            tag = f"t{number}"
            start = time.monotonic()
            staged = engine.stage(state, "model.pt", tag=tag)
            called = time.monotonic()
            time.sleep(step)  # the step: blocks the trainer's thread, as a device wait does
            stepped = time.monotonic()
            staged.result()
            fenced = time.monotonic()
            result = engine.commit(tag).result()
            end = time.monotonic()
            return {
                "step": step,
                "stall": called - start + fenced - stepped,
                "call": called - start,
                "streaming": fenced - start,
                "durable": end - start,
                "start": start,
                "end": end,
                "raw": disk_seconds(root, result.bytes) if raw else None,
                "staging_bytes": result.staging_bytes,
                "staging_peak": result.staging_peak_bytes,
                "bytes": result.bytes,
            }

        warm = save(0.0)  # staging memory exists and is warm from here on
        long_step = max(0.05, 1.5 * warm["streaming"] + 0.05)
        for _ in range(options["sampled"]):
            runs.append(save(0.0, raw=False))
        with paused(quiet, resting):
            for _ in range(reps):
                for step in steps:
                    timed.append(save(long_step if step < 0 else step))
        if quiet is None:  # --smoke: one set of saves, sampled and timed at once
            runs = timed
        loaded = engine.load("model.pt").result()
        equal = loaded.keys() == state.keys() and all(
            torch.equal(loaded[key], value) for key, value in state.items()
        )
        writer = engine.pid
    return {
        "runs": runs,
        "timed": timed,
        "equal": equal,
        "writer": writer,
        "long_step": long_step,
    }


def _alternated(
    root: Path, state: dict[str, Any], options: dict[str, Any], quiet: Any, resting: Any
) -> dict[str, Any]:
    """The same state saved by an uncapped and a capped engine in turn, ``rounds`` times
    (after a warm-up save each), with the PSS sampling paused: each round's two times to
    durable were made within seconds of each other, on the same disk."""
    import aoffload

    cap = options["cap"]
    with (
        aoffload.CheckpointEngine(root / "uncapped", keep_last=1) as uncapped,
        aoffload.CheckpointEngine(root / "capped", keep_last=1, staging_bytes=cap) as capped,
    ):
        engines = {"uncapped": uncapped, "capped": capped}
        with paused(quiet, resting):
            rounds = _rounds(engines, state, options["rounds"])
    return {"rounds": rounds}


def _rounds(engines: dict[str, Any], state: dict[str, Any], count: int) -> list[dict[str, float]]:
    rounds: list[dict[str, float]] = []
    for number in range(count + 1):
        times = {}
        order = list(engines) if number % 2 == 0 else list(reversed(engines))
        for name in order:
            tag = f"t{number}"
            start = time.monotonic()
            engines[name].stage(state, "model.pt", tag=tag).result()
            engines[name].commit(tag).result()
            times[name] = time.monotonic() - start
        if number > 0:  # the first round warms each engine's staging memory
            rounds.append(times)
    return rounds


def _long(root: Path, state: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    import aoffload

    from ._pss import process_pss

    saves, early = options["saves"], options["early"]
    readings: dict[str, dict[str, int]] = {}
    with aoffload.CheckpointEngine(root / "ckpt", keep_last=1) as engine:
        for number in range(1, saves + 1):
            engine.save(state, "model.pt", tag=f"t{number}").result()
            engine.commit(f"t{number}").result()
            if number in (early, saves):
                writer = engine.pid
                readings[str(number)] = {
                    "trainer": process_pss(os.getpid()),
                    "writer": process_pss(writer) if writer is not None else 0,
                }
    return {"readings": readings, "early": early, "saves": saves}


def _saves(peer: Any, root: Path, kind: str, reps: int, first: int = 1) -> list[dict[str, Any]]:
    """``reps`` saves, each to durable, after ``first`` warm-up saves (excluded)."""
    runs: list[dict[str, Any]] = []
    for number in range(1 - first, reps + 1):
        path = root / f"{kind}-{number}"
        start = time.monotonic()
        save = peer.save(path)
        save.fence()
        save.durable()
        end = time.monotonic()
        if number > 0:
            runs.append({"start": start, "end": end, "durable": end - start})
        shutil.rmtree(path, ignore_errors=True)
    return runs


def _peer(
    root: Path, state: dict[str, Any], kind: str, options: dict[str, Any], quiet: Any, resting: Any
) -> dict[str, Any]:
    """The peer's sampled saves, then (unless ``options["timed"]`` is false: ``--smoke``,
    whose figures measure nothing) as many timed with the sampling paused."""
    reps = options["reps"]
    from ._checkpoint_systems import init_single_process_group
    from ._dcp_peers import DcpAsync, TorchCheckpointing

    init_single_process_group()
    makers: list[Any] = (
        [lambda: DcpAsync(state, process=False, shared=True)]
        if kind == "dcp"  # torch_checkpointing: O_DIRECT first, buffered where it fails
        else [lambda: TorchCheckpointing(state, True), lambda: TorchCheckpointing(state, False)]
    )
    for number, make in enumerate(makers):
        peer = make()
        try:
            runs = timed = _saves(peer, root, kind, reps)
            if options["timed"]:
                with paused(quiet, resting):
                    timed = _saves(peer, root, kind, reps, first=0)
        except Exception:
            if number == len(makers) - 1:
                raise
            logging.getLogger(__name__).warning("%s failed here; next mode", peer.name)
            continue
        finally:
            with contextlib.suppress(Exception):
                peer.close()
        return {"runs": runs, "timed": timed, "name": peer.name, "note": peer.note}
    raise RuntimeError("no mode of the peer ran")  # pragma: no cover - the loop returns


def main(
    kind: str,
    root: str,
    nbytes: int,
    options: dict[str, Any],
    out: str,
    quiet: Any,
    resting: Any,
) -> None:
    """The whole run of one system (the target of a spawned process); ``quiet`` and
    ``resting`` pause the section's PSS sampling (:func:`._pss.paused`)."""
    logging.basicConfig(level=logging.WARNING, format=f"[{kind}] %(name)s: %(message)s")
    # a run that hangs says where, on its stderr, before the section kills it
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    import torch  # noqa: F401 - imported before the idle window: the trainer has it

    base = Path(root)
    base.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"pid": os.getpid(), "idle": _idle()}
    state = _state(nbytes)
    record["with_state"] = _idle()
    if kind == "aoffload":
        record.update(_aoffload(base, state, options, quiet, resting))
    elif kind == "long":
        record.update(_long(base, state, options))
    elif kind == "alternated":
        record.update(_alternated(base, state, options, quiet, resting))
    else:
        record.update(_peer(base, state, kind, options, quiet, resting))
    Path(out).write_text(json.dumps(record))
