"""The preemption notice on real ranks (spawned processes on gloo): one agreed step everywhere.

The scenarios share one start-up of two ranks (a module fixture); each rank's side is in
``_preemption_scenarios.py``. The whole job under real signals is in
``test_preemption_example.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ._preemption_scenarios import _state
from ._ranks import assert_saved, complete_tags, run_ranks

SCENARIOS = ["uneven_pace", "blocked_peer", "everyone_signalled", "silent_rank", "closed_rank"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    directory = tmp_path_factory.mktemp("preempt-ranks")
    outcomes = run_ranks(
        2, "tests._preemption_scenarios:session", directory, timeout=300, scenarios=SCENARIOS
    )
    return directory, [outcome.check() for outcome in outcomes]


def only_tag_holds_every_rank_state(directory: Path, step: int) -> None:
    """The one tag published is whole (xxhash, not aoffload's verifier) and each rank's file
    holds exactly the state that rank saved at the agreed step."""
    assert complete_tags(directory) == [f"step-{step}"]
    for rank in range(2):
        assert_saved(directory / f"step-{step}" / f"shard-{rank}.pt", _state(rank, step))


def scenario(two_ranks: tuple[Path, list[dict[str, Any]]], name: str) -> tuple[Path, list[Any]]:
    directory, sessions = two_ranks
    results = [session[name] for session in sessions]
    for rank, result in enumerate(results):
        assert "traceback" not in result, f"rank {rank}:\n{result['traceback']}"
    return directory / name, results


def test_a_slow_rank_giving_notice_catches_up_to_the_fast_one(two_ranks: Any) -> None:
    directory, (fast, slow) = scenario(two_ranks, "uneven_pace")
    # The slow rank gave notice after its step 5; rank 0 had raced ahead and froze where its
    # watcher heard of it. The agreed step is the first past both: the slow rank catches up.
    agreed = fast["agreed"]
    assert agreed > 5 + 5
    assert fast["step"] == slow["step"] == slow["agreed"] == agreed
    assert fast["last_false"] == slow["last_false"] == agreed - 1
    assert fast["tag"] == slow["tag"] == f"step-{agreed}"
    only_tag_holds_every_rank_state(directory, agreed)


def test_a_rank_blocked_in_its_step_does_not_hold_up_the_agreement(two_ranks: Any) -> None:
    directory, (signalled, blocked) = scenario(two_ranks, "blocked_peer")
    assert signalled["requested"]
    assert not blocked["requested"]  # it learned of the notice through the store
    assert blocked["blocked_until"] == str(signalled["step"])  # rank 0 answered first
    assert signalled["step"] == blocked["step"] == signalled["agreed"] == 3
    only_tag_holds_every_rank_state(directory, 3)


def test_every_rank_signalled_at_once_agrees_once(two_ranks: Any) -> None:
    directory, results = scenario(two_ranks, "everyone_signalled")
    assert all(result["requested"] for result in results)
    assert len({result["step"] for result in results}) == 1
    assert results[0]["step"] == results[0]["agreed"] >= 10
    assert results[0]["tag"] == f"step-{results[0]['step']}"
    only_tag_holds_every_rank_state(directory, results[0]["step"])


SILENT_TIMEOUT = 2.0
"""The silent_rank scenario's commit_timeout (tests/_preemption_scenarios.py)."""
SLACK = 3.0
"""What a loaded 2-core host may add to a deadline."""
AT_ONCE = 5.0
""""At once": no timeout waited out (the closed_rank scenario's is the default, 300 s)."""


def test_a_rank_without_a_notice_is_named_within_commit_timeout(two_ranks: Any) -> None:
    _, (waiting, silent) = scenario(two_ranks, "silent_rank")
    assert silent == {}
    assert "rank(s) [1] did not answer" in waiting["error"]
    assert "engine.preemption()" in waiting["error"]
    assert waiting["seconds"] >= SILENT_TIMEOUT  # it gave the rank its whole commit_timeout
    assert waiting["seconds"] < SILENT_TIMEOUT + SLACK


def test_a_rank_that_closed_its_engine_is_named_at_once(two_ranks: Any) -> None:
    _, (waiting, closed) = scenario(two_ranks, "closed_rank")
    assert closed == {}
    assert "rank 1 had closed its engine" in waiting["error"]
    assert waiting["seconds"] < AT_ONCE
