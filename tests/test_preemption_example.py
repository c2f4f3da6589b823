"""examples/preemptible_training.py as a job on preemptible capacity: real processes, real signals.

Each rank runs in a process group of its own (as torchrun starts them), with its writer and
worker server, and a signal goes to one rank's whole group at a random moment: every rank
must save the same step and exit 0, ``aoffload verify`` must pass, and the next start must
resume with bit-identical state (the digest each rank prints when it saves equals the one it
prints when it resumes). A run is a chain of rounds: each restart resumes the previous
round's checkpoint and is itself preempted, and the last round trains to the end, where its
state must equal that of a run never interrupted. Then a second signal and the grace
deadline's SIGKILL, which may kill the job anywhere: the previous checkpoint must stay whole.

The run never interrupted is the example's own training step replayed in this process, one
thread, without aoffload or a process group (:func:`unbroken`): an oracle that owes nothing
to the checkpoints it judges, and no third job to start.
"""

from __future__ import annotations

import importlib.util
import io
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import pytest
import torch

from aoffload._cli import EXIT_OK
from aoffload._cli import main as cli

from ._ranks import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "preemptible_training.py"
_LINE = re.compile(r"rank (\d+): (\w+)(?: \((\w+)\))?(?: at)?(?: step (\d+))?.*?(?:digest (\w+))?$")


@dataclass
class Rank:
    """One rank of the job: its process (a group of its own) and what it printed."""

    rank: int
    process: subprocess.Popen[str]
    lines: queue.SimpleQueue[str] = field(default_factory=queue.SimpleQueue)
    out: list[str] = field(default_factory=list)
    err: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for stream, into in ((self.process.stdout, self.out), (self.process.stderr, self.err)):
            threading.Thread(target=self._read, args=(stream, into), daemon=True).start()

    def _read(self, stream: IO[str], into: list[str]) -> None:
        with stream:
            for line in stream:
                into.append(line.rstrip("\n"))
                if into is self.out:
                    self.lines.put(into[-1])

    def wait_for(self, word: str, timeout: float = 180) -> str:
        deadline = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            if f": {word}" in line:
                return line

    def events(self, word: str) -> list[tuple[int, str]]:
        """(step, digest) of each line ``rank r: <word> ... step N ... digest D``."""
        found = []
        for line in self.out:
            match = _LINE.match(line)
            if match and match.group(2) == word:
                found.append((int(match.group(4)), match.group(5)))
        return found


_JOB_VARIABLES = frozenset(
    {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    | {"CROSS_RANK", "CROSS_SIZE", "GROUP_RANK"}
)


def start(directory: Path, world: int, *extra: str) -> list[Rank]:
    """Start the job: ``world`` ranks as torchrun would (env, one process group each)."""
    port = free_port()
    ranks = []
    for rank in range(world):
        # Not this process's own rank variables (another test may have set them): a job of
        # one must not believe it is rank 0 of a stale process group.
        env = {k: v for k, v in os.environ.items() if k not in _JOB_VARIABLES}
        env["PYTHONPATH"] = str(ROOT)
        if world > 1:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        command = [sys.executable, str(SCRIPT), "--dir", str(directory), "--save-every", "40"]
        process = subprocess.Popen(
            [*command, *extra],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        ranks.append(Rank(rank, process))
    return ranks


def finish(ranks: list[Rank], timeout: float = 180) -> list[int]:
    """Wait for every rank; their exit codes. Then no process of their groups is left."""
    deadline = time.monotonic() + timeout
    codes = [r.process.wait(max(1.0, deadline - time.monotonic())) for r in ranks]
    for r in ranks:  # writers and worker servers leave once their trainer is gone
        while time.monotonic() < deadline:
            try:
                os.killpg(r.process.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"rank {r.rank}'s process group outlived it")
    return codes


@pytest.fixture
def jobs() -> Iterator[list[list[Rank]]]:
    """Every job a test starts; whatever is left of them is killed at the end."""
    started: list[list[Rank]] = []
    yield started
    for ranks in started:
        for r in ranks:
            if r.process.poll() is None:
                os.killpg(r.process.pid, signal.SIGKILL)
            r.process.wait(30)


def unbroken(world: int, steps: int) -> list[list[tuple[int, str]]]:
    """Each rank's ``finished`` event, ``(steps, digest)``, of a run of the example never
    interrupted: its ``build``, ``train_step`` and ``digest`` on one thread, as each rank
    trains (``torch.set_num_threads(1)``; the ranks' ``all_reduce`` of the loss changes no
    state)."""
    spec = importlib.util.spec_from_file_location("preemptible_training", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        events = []
        for rank in range(world):
            model, optimizer = example.build(rank)
            for step in range(1, steps + 1):
                example.train_step(model, optimizer, step, rank)
            events.append([(steps, example.digest(model, optimizer))])
        return events
    finally:
        torch.set_num_threads(threads)


def verify(directory: Path) -> str:
    """``aoffload verify DIR`` passes; what ``latest`` names."""
    out = io.StringIO()
    assert cli(["verify", str(directory)], out) == EXIT_OK, out.getvalue()
    return (directory / "latest").read_text().strip()


def no_tracebacks(ranks: list[Rank]) -> None:
    for r in ranks:
        err = "\n".join(r.err)
        assert "Traceback" not in err, f"rank {r.rank}:\n{err}"


@pytest.mark.parametrize(
    ("world", "rounds", "seed"),
    [(2, ["TERM", "USR1", "TERM"], 0), (2, ["TERM", "TERM"], 4), (1, ["TERM", "USR1"], 1)],
)
def test_a_signal_at_a_random_moment_saves_one_step_everywhere_and_resumes_exactly(
    tmp_path: Path, jobs: list[list[Rank]], world: int, rounds: list[str], seed: int
) -> None:
    rng = random.Random(seed)
    directory = tmp_path / "ckpt"
    saved: list[str] | None = None  # each rank's digest of the last preempted step
    step = 0
    for sig in rounds:
        ranks = start(directory, world, "--signal", sig, "--steps", "1000000")
        jobs.append(ranks)
        for r in ranks:
            r.wait_for("ready")  # after its "resumed" line, if it resumed
        if saved is not None:
            assert [r.events("resumed") for r in ranks] == [[(step, d)] for d in saved]
        time.sleep(rng.uniform(0.0, 1.5))  # at a random moment: in a step, a save, a commit
        victim = ranks[rng.randrange(world)]
        os.killpg(victim.process.pid, signal.Signals[f"SIG{sig}"])
        assert finish(ranks) == [0] * world, [r.err for r in ranks]
        no_tracebacks(ranks)
        preempted = [r.events("preempted") for r in ranks]
        assert all(len(events) == 1 for events in preempted), preempted
        steps = {events[0][0] for events in preempted}
        assert len(steps) == 1, f"the ranks saved different steps: {preempted}"
        (step,) = steps
        saved = [events[0][1] for events in preempted]
        assert verify(directory) == f"step-{step}"

    last = start(directory, world, "--steps", str(step + 15))
    jobs.append(last)
    expected = unbroken(world, step + 15)  # while the last round starts
    assert finish(last) == [0] * world
    assert [r.events("resumed") for r in last] == [[(step, d)] for d in saved or []]
    assert [r.events("finished") for r in last] == expected


@pytest.mark.parametrize(("then", "seed"), [("TERM", 2), ("KILL", 3)])
def test_a_second_signal_or_the_grace_deadline_leaves_the_last_checkpoint_whole(
    tmp_path: Path, jobs: list[list[Rank]], then: str, seed: int
) -> None:
    """After the notice, a second SIGTERM to the victim's group (its trainer dies of it) or
    SIGKILL to every group (torchrun's end of the grace period) at a random moment; the
    survivors are killed 20 s later. What ``latest`` names is whole and resumes exactly."""
    rng = random.Random(seed)
    directory = tmp_path / "ckpt"
    ranks = start(directory, 2, "--steps", "1000000", "--save-every", "20")
    jobs.append(ranks)
    for r in ranks:
        r.wait_for("ready")
    time.sleep(rng.uniform(0.5, 2.0))  # some periodic checkpoints first
    victim = ranks[rng.randrange(2)]
    os.killpg(victim.process.pid, signal.SIGTERM)
    time.sleep(rng.uniform(0.0, 0.15))  # anywhere in the agreement, the final save, the commit
    for r in [victim] if then == "TERM" else ranks:
        os.killpg(r.process.pid, signal.Signals[f"SIG{then}"])
    try:
        finish(ranks, timeout=20)
    except subprocess.TimeoutExpired:
        for r in ranks:  # the deadline: what is left is killed
            os.killpg(r.process.pid, signal.SIGKILL)
        finish(ranks)
    step = int(verify(directory).removeprefix("step-"))
    again = start(directory, 2, "--steps", str(step + 3))
    jobs.append(again)
    expected = unbroken(2, step)  # the state at that step, while the job starts
    assert finish(again) == [0, 0]
    assert [r.events("resumed") for r in again] == expected
