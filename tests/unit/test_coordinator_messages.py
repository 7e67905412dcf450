"""The messages a learner exchanges with its coordinator (``shoal.learner.coordinator_messages``),
pure functions both backends on the shards use: the Boundary a learner reports with, and the
trainer's assignment read from the coordinator's answer."""

from __future__ import annotations

import pytest

from shoal.learner.coordinator_messages import adopted_plan, assignment_of, boundary_request
from shoal.learner.sync_types import Assignment, TrainingPlan
from shoal.v1 import parameter_sync_service_pb2 as ps_pb2

PLAN = TrainingPlan(epochs=2, batch_size=8, num_samples=32)


def _run(rank: int = 1, world: int = 2, **fields: int) -> ps_pb2.BoundaryResponse:
    a = ps_pb2.Assignment(
        generation=3,
        epoch=1,
        iteration=2,
        global_iteration=6,
        rank=rank,
        world_size=world,
        batch_samples=8,
        sample_start=16 + rank * 8 // world,
        sample_end=16 + (rank + 1) * 8 // world,
    )
    for name, value in fields.items():
        setattr(a, name, value)
    return ps_pb2.BoundaryResponse(action=ps_pb2.BOUNDARY_ACTION_RUN, assignment=a)


def test_a_run_answer_becomes_the_assignment_of_this_learners_share() -> None:
    got = assignment_of(_run(), PLAN, (2, 5))
    assert got == Assignment(
        generation=3,
        epoch=1,
        iteration=2,
        step=6,
        rank=1,
        world_size=2,
        batch_start=16,
        batch_stop=24,
    )
    assert got.share == (20, 24)


def test_a_retire_answer_retires_after_the_last_reported_iteration() -> None:
    reply = ps_pb2.BoundaryResponse(action=ps_pb2.BOUNDARY_ACTION_RETIRE)
    assert assignment_of(reply, PLAN, (4, 9)) == Assignment.retirement(4, 10)


def test_a_done_answer_is_none() -> None:
    reply = ps_pb2.BoundaryResponse(action=ps_pb2.BOUNDARY_ACTION_DONE)
    assert assignment_of(reply, PLAN, (0, -1)) is None


@pytest.mark.parametrize(
    ("reply", "match"),
    [
        (ps_pb2.BoundaryResponse(action=ps_pb2.BOUNDARY_ACTION_CHECKPOINT), "unknown boundary"),
        (_run(sample_start=17), r"sample range \[17, 24\) differs from the partition's"),
    ],
)
def test_an_answer_the_trainer_cannot_run_is_refused_with_what_is_wrong(
    reply: ps_pb2.BoundaryResponse, match: str
) -> None:
    with pytest.raises(RuntimeError, match=match):
        assignment_of(reply, PLAN, (0, -1))


def test_the_boundary_carries_what_the_script_logged_for_the_reported_iteration_only() -> None:
    user = (7, {"acc": (6.0, 8)})
    reported = boundary_request("j", "l0", user, 3, 7, 1.5, 8)
    assert (reported.completed_iteration, reported.loss_sum, reported.num_samples) == (7, 1.5, 8)
    assert dict(reported.metric_sums) == {"acc": 6.0}
    assert dict(reported.metric_samples) == {"acc": 8}
    for other in (boundary_request("j", "l0", user, 3, 6), boundary_request("j", "l0", user, 3)):
        assert not other.metric_sums and not other.metric_samples


def test_the_jobs_settings_from_the_join_reply_win_over_the_scripts() -> None:
    reply = ps_pb2.JoinResponse(epochs=5, batch_size=64, seed=11)
    plan = TrainingPlan(epochs=1, batch_size=8, num_samples=32, seed=0, checkpoint_every=4)
    assert adopted_plan(reply, plan) == TrainingPlan(
        epochs=5, batch_size=64, num_samples=32, seed=11, checkpoint_every=4
    )
