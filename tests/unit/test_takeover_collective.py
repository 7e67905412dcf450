"""Coordinator failover in collective mode, the grpc-free part (issue 12): the successor's
decision from the re-joining learners' states (commit the voted iteration k or run k again,
``shoal.param_sync.takeover_collective``) and the coordinator it resumes with."""

from __future__ import annotations

import pytest

from shoal.param_sync.coordinator import Action, Coordinator, JobSettings, RewindTask
from shoal.param_sync.takeover_collective import (
    CollectiveTakeover,
    LearnerState,
    Resume,
    apply_resume,
    decide_resume,
)
from shoal.runtime.errors import InvalidField
from tests.unit.test_coordinator import LAYOUT, SGD, Clock

G = 7  # the old coordinator's generation


def voted(k: int, world: int = 2) -> LearnerState:
    """All-reduced iteration k and voted for it; no answer came."""
    return LearnerState(k, holds_pending=True, generation=G, world_size=world)


def at(k: int, world: int = 2) -> LearnerState:
    """Holds the state after k iterations, no update pending (waits for its assignment)."""
    return LearnerState(k, generation=G, world_size=world)


def test_a_learner_that_applied_k_means_k_was_committed_and_the_voters_apply_it() -> None:
    resume = decide_resume({"a": at(6), "b": voted(5)}, recorded=4)
    assert resume == Resume(6, committed=False, holders=frozenset({"a", "b"}))
    assert resume.holds(voted(5)) and resume.holds(at(6)) and not resume.holds(at(5))


def test_a_learner_that_did_not_vote_k_means_k_was_not_committed_and_runs_again() -> None:
    resume = decide_resume({"a": voted(5), "b": at(5)}, recorded=4)
    assert resume == Resume(5, committed=False, holders=frozenset({"a", "b"}))  # a drops it


def test_every_member_voted_k_so_the_successor_commits_k() -> None:
    # The old coordinator had every vote (it would have committed); all hold the same update.
    assert decide_resume({"a": voted(5), "b": voted(5)}, recorded=4) == Resume(
        6,
        committed=True,
        holders=frozenset({"a", "b"}),
        voters=frozenset({"a", "b"}),
        vote_generation=G,
    )


def test_k_recorded_in_the_metrics_was_committed_even_before_every_member_is_back() -> None:
    assert decide_resume({"a": voted(5, world=3)}, recorded=5) == Resume(
        6, committed=True, holders=frozenset({"a"}), voters=frozenset({"a"}), vote_generation=G
    )


def test_votes_of_only_some_members_wait_then_run_k_again_at_the_deadline() -> None:
    reports = {"a": voted(5, world=3), "b": voted(5, world=3)}
    assert decide_resume(reports, recorded=4) is None  # c may have been answered the commit
    assert decide_resume(reports, recorded=4, final=True) == Resume(
        5, committed=False, holders=frozenset({"a", "b"})
    )


def test_joiners_and_stale_learners_are_not_holders() -> None:
    reports = {
        "a": at(6),
        "b": voted(5),
        "joiner": LearnerState(-1),
        "stale": at(4),  # left behind: receives the state by broadcast
        "ahead-of-drop": voted(6),  # voted 6, which is dropped: it holds 6 still
    }
    resume = decide_resume(reports, recorded=4)
    assert resume is not None and resume.completed == 6 and not resume.committed
    assert resume.holders == {"a", "b", "ahead-of-drop"}


def test_nobody_holding_any_state_waits_then_leaves_it_to_the_rewind() -> None:
    reports = {"j": LearnerState(-1)}
    assert decide_resume(reports, recorded=9) is None
    assert decide_resume(reports, recorded=9, final=True) == Resume(10)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"state_step": -2}, "collective_state.state_step"),
        ({"state_step": -1, "holds_pending": True}, "collective_state.holds_pending"),
        ({"state_step": 1, "generation": -1}, "collective_state"),
    ],
)
def test_a_bad_learner_state_is_refused_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidField) as refused:
        LearnerState(**kwargs)
    assert refused.value.field_name == field


def test_the_takeover_decides_once_and_at_the_deadline_at_the_latest() -> None:
    now = [100.0]
    takeover = CollectiveTakeover(
        lost=0,
        generation=1 << 32,
        last_checkpoint=-1,
        recorded=4,
        settle_s=10.0,
        clock=lambda: now[0],
    )
    assert takeover.deadline is None and takeover.poll() is None
    assert takeover.report("a", voted(5, world=3)) is None
    assert takeover.deadline == 110.0
    now[0] = 105.0
    assert takeover.report("b", voted(5, world=3)) is None
    now[0] = 110.0
    decided = takeover.poll()
    assert decided == Resume(5, committed=False, holders=frozenset({"a", "b"}))
    # c comes late, answered the commit of 5 by the old coordinator: not a holder, and the
    # decision does not change.
    assert takeover.report("c", at(6, world=3)) is decided
    assert not takeover.holds(at(6, world=3)) and takeover.holds(voted(5, world=3))
    with pytest.raises(InvalidField):
        takeover.report("", at(6))


def successor(
    resume_reports: dict[str, LearnerState], *, recorded: int, settle_s: float = 10.0
) -> Coordinator:
    settings = JobSettings(
        job_id="job-1",
        batch_size=4,
        epochs=2,
        seed=3,
        storage_uri="memory://x",
        shard_addresses=("s0:1", "s1:1"),
    )
    coord = Coordinator(settings, clock=Clock())
    takeover = CollectiveTakeover(
        lost=0,
        generation=1 << 32,
        last_checkpoint=2,
        recorded=recorded,
        settle_s=settle_s,
        clock=lambda: 0.0,
    )
    for name, state in resume_reports.items():
        takeover.report(name, state)
    resume = takeover.poll()
    assert resume is not None
    apply_resume(coord, takeover, layout=LAYOUT, optimizer=SGD, dataset_size=10)
    for name in resume_reports:
        coord.join(name)
        if name in resume.holders:
            coord.synced.add(name)
    return coord


def test_the_successor_commits_from_the_votes_and_records_the_re_sent_loss_once() -> None:
    coord = successor({"a": voted(3), "b": voted(3)}, recorded=2)
    assert coord.collective and coord.completed == 4 and coord.last_checkpoint == 2
    assert coord.samples_processed == 4 + 4 + 2 + 4  # N=10, B=4: iterations 0..3
    # The re-sent votes (old generation, iteration 3) are the loss reports of iteration 3.
    coord.report("a", G, 3, 1.0, 2)
    coord.report("b", G, 3, 3.0, 2)
    (record,) = coord.take_metrics()  # once both votes came, no commit needed (the last one)
    assert record["global_iteration"] == 3 and record["loss"] == pytest.approx(1.0)
    a, b = coord.decide("a"), coord.decide("b")  # the freeze, then the rendezvous barrier
    assert a.action is Action.WAIT and b.action is Action.RUN
    a = coord.decide("a")
    assert a.assignment.global_iteration == 4 and a.assignment.generation == (1 << 32) + 1
    assert a.restore is None  # the members hold the state: nobody loads a checkpoint
    coord.report("a", a.assignment.generation, 4, 0.5, 2)
    coord.report("b", a.assignment.generation, 4, 0.5, 2)
    assert coord.completed == 5
    assert [r["global_iteration"] for r in coord.take_metrics()] == [4]


def test_an_iteration_the_old_coordinator_recorded_is_not_recorded_again() -> None:
    coord = successor({"a": voted(3), "b": voted(3)}, recorded=3)
    assert coord.completed == 4
    coord.report("a", G, 3, 1.0, 2)
    coord.decide("a")
    coord.decide("b")
    a = coord.decide("a")
    coord.report("a", a.assignment.generation, 4, 0.5, 2)
    coord.report("b", a.assignment.generation, 4, 0.5, 2)
    assert [r["global_iteration"] for r in coord.take_metrics()] == [4]


def test_a_successor_with_no_holder_rewinds_to_the_latest_checkpoint() -> None:
    coord = successor({"j": LearnerState(-1)}, recorded=3, settle_s=0.0)  # decided at once
    assert coord.decide("j").action is Action.WAIT  # the metrics after 2 are dropped first
    (rewind,) = coord.holds
    assert isinstance(rewind, RewindTask) and rewind.iteration == 2
    coord.task_done(rewind)
    decision = coord.decide("j")
    assert decision.action is Action.RUN
    assert decision.assignment.global_iteration == 2 and decision.restore == 2
