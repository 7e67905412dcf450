"""The scheduler's data-plane health decisions (shoal.scheduler.health), pure: an injected
clock, no network."""

from __future__ import annotations

import pytest

from shoal.runtime.errors import InvalidField
from shoal.scheduler.health import HealthConfig, JobHealth, VerdictKind, assess
from shoal.v1 import job_pb2

RUNNING = job_pb2.JOB_STATE_RUNNING
RECOVERING = job_pb2.JOB_STATE_RECOVERING
# (the stall notice, a reason only, has tests of its own below)
CONFIG = HealthConfig(
    stall_timeout_s=60.0, max_recoveries=2, unreachable_grace_s=2.0, stall_notice_s=0.0
)
NOTICE = HealthConfig(
    stall_timeout_s=60.0, max_recoveries=2, unreachable_grace_s=2.0, stall_notice_s=20.0
)
COORD = "shard 1 (127.0.0.1:4001)"


def verdict(state: int, health: JobHealth, now: float, recoveries: int = 0):  # type: ignore[no-untyped-def]
    return assess(state, health, now=now, config=CONFIG, recoveries=recoveries, coordinator=COORD)


def test_a_running_job_that_commits_iterations_needs_nothing() -> None:
    health = JobHealth(iterations=0, progress_at=0.0)
    for t in range(1, 200):
        health.polled(t, float(t))
        assert verdict(RUNNING, health, float(t)) is None


def test_a_coordinator_unreachable_past_the_grace_makes_the_job_recovering_with_the_iteration() -> (
    None
):
    health = JobHealth(iterations=0, progress_at=0.0)
    health.polled(286, 10.0)
    health.unreachable("shard 1 (127.0.0.1:4001) unreachable: UNAVAILABLE", 11.0)
    assert verdict(RUNNING, health, 12.0) is None  # within the grace: maybe a blip
    assert health.down  # but no learner starts meanwhile
    got = verdict(RUNNING, health, 13.0)
    assert got is not None and got.kind is VerdictKind.RECOVERING
    assert "shard 1 (127.0.0.1:4001) lost after iteration 286" in got.reason
    assert "UNAVAILABLE" in got.reason


def test_an_unreachable_blip_shorter_than_the_grace_changes_nothing() -> None:
    health = JobHealth(iterations=5, progress_at=0.0)
    health.unreachable("UNAVAILABLE", 1.0)
    health.polled(6, 2.0)
    assert not health.down
    assert verdict(RUNNING, health, 10.0) is None


def test_a_recovering_job_is_running_again_only_after_an_iteration_commits_past_the_reopen() -> (
    None
):
    health = JobHealth(iterations=0, progress_at=0.0)
    health.polled(286, 10.0)
    health.unreachable("UNAVAILABLE", 11.0)
    health.entered_recovery()
    assert verdict(RECOVERING, health, 20.0) is None
    health.reopened(230)  # resumed from the checkpoint at 230
    health.polled(230, 25.0)
    assert verdict(RECOVERING, health, 25.0) is None
    health.polled(231, 26.0)
    got = verdict(RECOVERING, health, 26.0)
    assert got is not None and got.kind is VerdictKind.RECOVERED
    assert "lost after iteration 286" in got.reason and "resumed at iteration 230" in got.reason


def test_progress_from_before_the_loss_does_not_count_as_recovered() -> None:
    health = JobHealth(iterations=0, progress_at=0.0)
    health.polled(10, 1.0)
    health.polled(20, 2.0)
    health.entered_recovery()
    health.polled(20, 3.0)  # the first poll after: the baseline
    assert verdict(RECOVERING, health, 3.0) is None


def test_a_job_without_progress_for_the_stall_timeout_is_retried_then_failed() -> None:
    health = JobHealth(iterations=40, progress_at=0.0)
    assert verdict(RUNNING, health, 59.0) is None
    got = verdict(RUNNING, health, 60.0)
    assert got is not None and got.kind is VerdictKind.RETRY
    assert "no iteration committed for 60 s (at iteration 40)" in got.reason
    assert "retry 1 of 2" in got.reason
    health.restarted(60.0)
    assert verdict(RECOVERING, health, 100.0, recoveries=1) is None
    got = verdict(RECOVERING, health, 120.0, recoveries=1)
    assert got is not None and got.kind is VerdictKind.RETRY and "retry 2 of 2" in got.reason
    health.restarted(120.0)
    got = verdict(RECOVERING, health, 180.0, recoveries=2)
    assert got is not None and got.kind is VerdictKind.FAIL
    assert "gave up after 2 automatic retries" in got.reason


def test_the_stall_reason_names_an_unreachable_coordinator() -> None:
    health = JobHealth(iterations=7, progress_at=0.0)
    health.unreachable("shard 0 (a:1) unreachable: UNAVAILABLE", 1.0)
    got = verdict(RECOVERING, health, 61.0, recoveries=2)
    assert got is not None and got.kind is VerdictKind.FAIL
    assert "shard 0 (a:1) unreachable" in got.reason


def test_a_stall_timeout_of_zero_never_retries() -> None:
    config = HealthConfig(stall_timeout_s=0.0)
    health = JobHealth(iterations=1, progress_at=0.0)
    got = assess(RUNNING, health, now=1e9, config=config, recoveries=0, coordinator=COORD)
    assert got is not None and got.kind is VerdictKind.STALLED  # said, never retried
    assert "--stall-timeout" not in got.reason


def test_only_running_and_recovering_jobs_are_assessed() -> None:
    health = JobHealth(iterations=1, progress_at=0.0)
    for state in (job_pb2.JOB_STATE_QUEUED, job_pb2.JOB_STATE_CANCELLING):
        assert verdict(state, health, 1e9) is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stall_timeout_s", -1.0),
        ("max_recoveries", -1),
        ("unreachable_grace_s", float("nan")),
        ("stall_notice_s", -1.0),
    ],
)
def test_bad_health_settings_are_refused_naming_the_field(field: str, value: float) -> None:
    with pytest.raises(InvalidField, match=field):
        HealthConfig(**{field: value})  # type: ignore[arg-type]


def test_a_coordinator_that_says_it_is_recovering_makes_the_job_recovering_until_it_commits() -> (
    None
):
    health = JobHealth(iterations=0, progress_at=0.0)
    health.polled(286, 1.0)
    health.polled(286, 2.0, recovering="shard 1 lost at iteration 286; rewinding to 230")
    got = verdict(RUNNING, health, 2.0)
    assert got is not None and got.kind is VerdictKind.RECOVERING
    assert "shard 1 lost at iteration 286; rewinding to 230" in got.reason
    health.entered_recovery()
    health.polled(230, 3.0, recovering="rewinding")  # rewound to the checkpoint
    assert verdict(RECOVERING, health, 3.0) is None
    health.polled(231, 4.0, recovering="rewinding")
    assert verdict(RECOVERING, health, 4.0) is None  # still says it recovers
    health.polled(231, 5.0)  # its recovery ended
    assert verdict(RECOVERING, health, 5.0) is None
    health.polled(232, 6.0)
    got = verdict(RECOVERING, health, 6.0)
    assert got is not None and got.kind is VerdictKind.RECOVERED
    assert "lost after iteration 286" in got.reason


def test_an_iteration_re_issued_for_ever_is_a_stall_not_progress() -> None:
    """Issue 12's livelock as the scheduler sees it: the coordinator re-issues one iteration at
    every boundary (a shard refuses every SyncStep of it) and never commits. Attempts are not
    progress: the polled committed count stays, and the stall timeout retries the job."""
    from shoal.contract.wire import TensorMeta, pack_layout
    from shoal.param_sync.coordinator import Action, Coordinator, JobSettings, OptimizerConfig

    layout = pack_layout([TensorMeta("w", "float32", (4, 3), 0, 48)])[0]
    sgd = OptimizerConfig("SGD", '{"lr": 0.1}')
    settings = JobSettings(
        job_id="job-1",
        batch_size=4,
        epochs=2,
        seed=3,
        checkpoint_every=0,
        storage_uri="memory://x",
        shard_addresses=("s0:1", "s1:1"),
    )
    coord = Coordinator(settings)
    coord.shape.fix_layout(layout, sgd, 40, coord.shape.plan_sharding(layout, sgd, 40))
    for learner in ("l1", "l2"):
        coord.join(learner)
    health = JobHealth(iterations=0, progress_at=0.0)
    for second in range(61):
        for _ in range(50):  # ~50 aborted SyncSteps a second, each followed by a Boundary
            for learner in ("l1", "l2"):
                decision = coord.decide(learner)
                assert decision.action is Action.RUN and decision.assignment is not None
                assert decision.assignment.global_iteration == 0
        health.polled(coord.progress()["completed_iterations"], float(second))
        got = verdict(RUNNING, health, float(second))
        if second < 60:
            assert got is None
    assert got is not None and got.kind is VerdictKind.RETRY
    assert "no iteration committed for 60 s (at iteration 0)" in got.reason


def noticed(state: int, health: JobHealth, now: float):  # type: ignore[no-untyped-def]
    return assess(state, health, now=now, config=NOTICE, recoveries=0, coordinator=COORD)


def test_a_running_job_that_stops_committing_says_it_is_stalled_then_that_it_trains_again() -> None:
    """RUNNING never hides a job that does not train: after the notice the reason says it is
    stalled (once), and when an iteration commits again it says so; the stall timeout still
    retries it if it never does."""
    health = JobHealth(iterations=0, progress_at=0.0)
    health.polled(40, 5.0)
    health.polled(40, 24.0)  # the coordinator answers, nothing commits
    assert noticed(RUNNING, health, 24.0) is None
    got = noticed(RUNNING, health, 25.0)
    assert got is not None and got.kind is VerdictKind.STALLED
    assert "stalled: no iteration committed for 20 s (at iteration 40)" in got.reason
    assert COORD in got.reason and "after 60 s (--stall-timeout)" in got.reason
    health.stalled_since = health.progress_at  # what the scheduler does with the verdict
    assert noticed(RUNNING, health, 30.0) is None  # said once
    health.polled(41, 33.0)
    got = noticed(RUNNING, health, 33.0)
    assert got is not None and got.kind is VerdictKind.RESUMED
    assert got.reason == "training again (iteration 41) after 28 s without a committed iteration"
    health.stalled_since = None
    assert noticed(RUNNING, health, 34.0) is None


def test_a_stall_that_lasts_is_still_retried_at_the_stall_timeout() -> None:
    health = JobHealth(iterations=40, progress_at=0.0)
    health.stalled_since = 0.0  # said at 20 s
    got = noticed(RUNNING, health, 60.0)
    assert got is not None and got.kind is VerdictKind.RETRY


def test_no_stall_notice_for_an_unreachable_or_recovering_coordinator() -> None:
    """Those have their own, better reasons (RECOVERING, the coordinator's recovery)."""
    down = JobHealth(iterations=40, progress_at=0.0)
    down.unreachable("UNAVAILABLE", 0.5)
    got = noticed(RUNNING, down, 25.0)
    assert got is not None and got.kind is VerdictKind.RECOVERING
    recovering = JobHealth(iterations=40, progress_at=0.0)
    recovering.polled(40, 1.0, recovering="shard 0 lost; promoting its backup")
    got = noticed(RUNNING, recovering, 25.0)
    assert got is not None and got.kind is VerdictKind.RECOVERING
    assert noticed(RECOVERING, JobHealth(iterations=40, progress_at=0.0), 25.0) is None


def test_a_stall_notice_of_zero_says_nothing() -> None:
    health = JobHealth(iterations=40, progress_at=0.0)
    assert verdict(RUNNING, health, 59.0) is None
