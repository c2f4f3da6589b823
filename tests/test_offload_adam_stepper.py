"""OffloadAdam's worker steps buckets side by side: one bucket's steps keep their order, all but
one thread step while the backward runs, every thread once the trainer waits (``hurry``)."""

from __future__ import annotations

import threading

from aoffload.optimizer.worker._stepper import Stepper

WAIT = 60.0  # seconds: only a hang reaches it


class Task:
    """A task that records its start and ends when released."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self) -> str:
        self.log.append(f"start {self.name}")
        self.started.set()
        assert self.release.wait(WAIT)
        self.log.append(f"end {self.name}")
        return self.name


def test_one_buckets_tasks_run_in_the_order_they_were_sent() -> None:
    stepper = Stepper(2)
    log: list[str] = []
    first, second, other = Task(log, "a1"), Task(log, "a2"), Task(log, "b")
    try:
        stepper.hurry()  # idle: no effect on the next backward
        done = [stepper.submit((0, 0), first), stepper.submit((0, 0), second)]
        stepper.hurry()  # every thread may step now
        done.append(stepper.submit((0, 1), other))
        assert first.started.wait(WAIT)
        assert other.started.wait(WAIT)  # another bucket runs beside it...
        assert not second.started.wait(0.2)  # ...but not the same bucket's next step
        first.release.set()
        assert second.started.wait(WAIT)
        second.release.set()
        other.release.set()
        assert [f.result(WAIT) for f in done] == ["a1", "a2", "b"]
        assert log.index("end a1") < log.index("start a2")
    finally:
        for task in (first, second, other):
            task.release.set()
        stepper.close()


def test_one_core_is_left_to_the_backward_until_the_trainer_waits() -> None:
    stepper = Stepper(2)
    log: list[str] = []
    a, b, c, d = Task(log, "a"), Task(log, "b"), Task(log, "c"), Task(log, "d")
    try:
        done = [stepper.submit((0, 0), a), stepper.submit((0, 1), b)]
        assert a.started.wait(WAIT)
        assert not b.started.wait(0.2)  # the backward runs: one thread steps
        stepper.hurry()
        assert b.started.wait(WAIT)  # the trainer waits: both do
        a.release.set()
        b.release.set()
        assert [f.result(WAIT) for f in done] == ["a", "b"]
        stepper.wait_idle()
        done = [stepper.submit((0, 0), c), stepper.submit((0, 1), d)]
        assert c.started.wait(WAIT)
        assert not d.started.wait(0.2)  # idle again: the next backward gets one thread
        c.release.set()
        assert d.started.wait(WAIT)
        d.release.set()
        assert [f.result(WAIT) for f in done] == ["c", "d"]
    finally:
        for task in (a, b, c, d):
            task.release.set()
        stepper.close()


def test_a_failed_task_fails_its_future_only() -> None:
    stepper = Stepper(2)

    def boom() -> None:
        raise ValueError("boom")

    try:
        failed = stepper.submit((0, 0), boom)
        after = stepper.submit((0, 0), lambda: "after")
        assert isinstance(failed.exception(WAIT), ValueError)
        assert after.result(WAIT) == "after"
    finally:
        stepper.close()
