"""Table tests of the reconcile cycle's pure observing and deciding
(shoal.scheduler.reconcile.decide): records in, decisions out, nothing changed."""

from __future__ import annotations

import copy

import pytest

from shoal.scheduler.jobs import JobRecord, LearnerPhase, LearnerRecord
from shoal.scheduler.placement import Plan, Retire, Start
from shoal.scheduler.reconcile import ReconcileConfig
from shoal.scheduler.reconcile.decide import (
    Observed,
    decide,
    demands,
    lost_reason,
    observe,
    starts_by_job,
    targets,
)
from shoal.scheduler.reconcile.work import JobWork
from shoal.v1 import job_pb2 as S, resources_pb2

P = LearnerPhase
NOW = 1000.0
CONFIG = ReconcileConfig(
    sync_shards=("shard-0:1",),
    finish_grace_s=30.0,
    retire_timeout_s=600.0,
    stop_grace_s=10.0,
    call_timeout_s=10.0,
)


def learner(lid: str, phase: LearnerPhase, *, host: str = "h1", since: float = NOW, inc: int = 1):
    return LearnerRecord(
        learner_id=lid,
        host_id=host,
        device_id=f"d-{lid}",
        host_incarnation=inc,
        phase=phase,
        phase_since=since,
    )


def job(
    job_id: str,
    state: int = S.JOB_STATE_RUNNING,
    *learners: LearnerRecord,
    seq: int = 1,
    opened: bool = False,
    closed: bool = False,
    target: int = 0,
    position: int = 0,
) -> JobRecord:
    record = JobRecord(
        job=S.Job(
            job_id=job_id,
            state=state,  # type: ignore[arg-type]
            spec=S.JobSpec(priority=5000, min_workers=1, max_workers=4),
            target_workers=target,
            queue_position=position,
        ),
        submit_seq=seq,
        opened=opened,
        closed=closed,
    )
    record.learners = {lr.learner_id: lr for lr in learners}
    return record


def host(host_id: str = "h1", *, inc: int = 1, lost: bool = False, draining: bool = False):
    return resources_pb2.Host(
        host_id=host_id,
        incarnation=inc,
        state=resources_pb2.HOST_STATE_LOST if lost else resources_pb2.HOST_STATE_READY,
        draining=draining,
    )


def records_of(*jobs: JobRecord) -> dict[str, JobRecord]:
    return {r.job_id: r for r in jobs}


# --- lost_reason ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("the_host", "incarnation", "expected"),
    [
        (None, 1, "host h1 is not in the inventory"),
        (host(lost=True), 1, "host h1 lost"),
        (host(inc=3), 2, "host h1 restarted (incarnation 2 -> 3)"),
        (host(inc=3), 0, ""),  # incarnation unknown (an old record): not lost
        (host(inc=2), 2, ""),
    ],
)
def test_lost_reason(the_host: resources_pb2.Host | None, incarnation: int, expected: str) -> None:
    assert lost_reason(learner("l1", P.RUNNING, inc=incarnation), the_host) == expected


# --- observe ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("phase", "busy", "exited", "hosts", "counted", "work"),
    [
        pytest.param(P.PENDING, False, False, {"h1": host()}, [], {"drop_pending": ["l1"]},
                     id="a_pending_learner_of_an_idle_job_is_dropped"),
        pytest.param(P.PENDING, True, False, {"h1": host()}, [("l1", False)], {},
                     id="a_pending_learner_of_a_busy_job_holds_its_device"),
        pytest.param(P.RUNNING, False, True, {"h1": host()}, [("l1", True)], {"exits": ["l1"]},
                     id="an_exit_is_processed_and_counts_as_leaving"),
        pytest.param(P.RUNNING, False, False, {}, [], {"lost": ["l1"]},
                     id="a_learner_on_an_unknown_host_is_lost"),
        pytest.param(P.RUNNING, False, False, {"h1": host(inc=2)}, [], {"lost": ["l1"]},
                     id="a_learner_on_a_restarted_host_is_lost"),
        pytest.param(P.RUNNING, False, False, {"h1": host()}, [("l1", False)], {},
                     id="a_running_learner_counts"),
        pytest.param(P.RETIRING, False, False, {"h1": host()}, [("l1", True)], {},
                     id="a_retiring_learner_counts_as_leaving"),
        pytest.param(P.STOPPING, False, False, {"h1": host()}, [("l1", True)], {},
                     id="a_stopping_learner_counts_as_leaving"),
    ],
)  # fmt: skip
def test_observe(
    phase: LearnerPhase,
    busy: bool,
    exited: bool,
    hosts: dict[str, resources_pb2.Host],
    counted: list[tuple[str, bool]],
    work: dict[str, list[str]],
) -> None:
    records = records_of(job("j1", S.JOB_STATE_RUNNING, learner("l1", phase)))
    before = copy.deepcopy(records)
    exits = {"l1": resources_pb2.Learner(learner_id="l1", exit_code=0)} if exited else {}
    seen = observe(records, hosts, exits, busy={"j1"} if busy else set())
    assert [(v.learner_id, v.retiring) for v in seen.current] == counted
    assert all(v.job_id == "j1" for v in seen.current)
    got = seen.work.get("j1", JobWork())
    assert got.drop_pending == work.get("drop_pending", [])
    assert [e.learner_id for e in got.exits] == work.get("exits", [])
    assert [lid for lid, _ in got.lost] == work.get("lost", [])
    assert records == before  # nothing changed


# --- demands and targets ----------------------------------------------------------------------


def test_demands_are_the_active_jobs() -> None:
    records = records_of(
        job("j1", S.JOB_STATE_RUNNING, seq=1),
        job("j2", S.JOB_STATE_QUEUED, seq=2),
        job("j3", S.JOB_STATE_COMPLETED, seq=3),
        job("j4", S.JOB_STATE_CANCELLING, seq=4),
    )
    got = demands(records)
    assert [(d.job_id, d.submit_seq, d.min_workers, d.max_workers) for d in got] == [
        ("j1", 1, 1, 4),
        ("j2", 2, 1, 4),
    ]


@pytest.mark.parametrize(
    ("state", "share", "queue", "expected"),
    [
        (S.JOB_STATE_RUNNING, 3, (), (3, 0)),
        (S.JOB_STATE_QUEUED, 0, ("j0", "j1"), (0, 2)),
        (S.JOB_STATE_RUNNING, 0, ("j1",), (0, 0)),  # a position only while QUEUED
        (S.JOB_STATE_QUEUED, None, (), (0, 0)),  # no share: 0
    ],
)
def test_targets(
    state: int, share: int | None, queue: tuple[str, ...], expected: tuple[int, int]
) -> None:
    records = records_of(job("j1", state), job("done", S.JOB_STATE_COMPLETED))
    shares = {} if share is None else {"j1": share}
    assert targets(records, Plan(shares=shares, queue=queue)) == {"j1": expected}


def test_starts_are_grouped_by_job_in_plan_order() -> None:
    starts = (Start("j2", "h1", "0"), Start("j1", "h1", "1"), Start("j2", "h2", "0"))
    grouped = starts_by_job(Plan(shares={}, starts=starts))
    assert list(grouped) == ["j2", "j1"]
    assert grouped["j2"] == [starts[0], starts[2]]


# --- decide: housekeeping of each learner -----------------------------------------------------

LONG_AGO = NOW - 10_000.0


@pytest.mark.parametrize(
    ("state", "phase", "since", "draining", "kind"),
    [
        pytest.param(S.JOB_STATE_CANCELLING, P.RUNNING, NOW, False, "stops",
                     id="a_cancelling_job_stops_its_learners"),
        pytest.param(S.JOB_STATE_FAILED, P.RETIRING, NOW, False, "stops",
                     id="a_failed_job_stops_its_learners"),
        pytest.param(S.JOB_STATE_CANCELLED, P.STOPPING, NOW, False, None,
                     id="a_stopping_learner_is_not_stopped_twice_at_once"),
        pytest.param(S.JOB_STATE_COMPLETED, P.RUNNING, NOW - 29, False, None,
                     id="a_completed_jobs_learner_has_its_grace"),
        pytest.param(S.JOB_STATE_COMPLETED, P.RUNNING, NOW - 30, False, "stops",
                     id="a_completed_jobs_learner_is_stopped_after_its_grace"),
        pytest.param(S.JOB_STATE_RUNNING, P.RETIRING, NOW - 599, False, None,
                     id="a_retiring_learner_has_its_time"),
        pytest.param(S.JOB_STATE_RUNNING, P.RETIRING, NOW - 600, False, "stops",
                     id="a_retire_that_takes_too_long_becomes_a_stop"),
        pytest.param(S.JOB_STATE_RUNNING, P.STOPPING, NOW - 29, False, None,
                     id="a_stop_has_two_graces_and_a_call"),
        pytest.param(S.JOB_STATE_RUNNING, P.STOPPING, NOW - 30, False, "stops",
                     id="a_stop_that_takes_too_long_is_sent_again"),
        pytest.param(S.JOB_STATE_RUNNING, P.STARTING, NOW, False, "restarts",
                     id="a_starting_learner_is_started_again"),
        pytest.param(S.JOB_STATE_RUNNING, P.RUNNING, LONG_AGO, False, None,
                     id="a_running_learner_is_left_alone"),
        pytest.param(S.JOB_STATE_RUNNING, P.RUNNING, NOW, True, "retires",
                     id="a_learner_on_a_draining_host_retires"),
        pytest.param(S.JOB_STATE_RECOVERING, P.STARTING, NOW, True, "restarts",
                     id="a_starting_learner_is_started_even_on_a_draining_host"),
    ],
)  # fmt: skip
def test_decide_housekeeping(
    state: int, phase: LearnerPhase, since: float, draining: bool, kind: str | None
) -> None:
    records = records_of(job("j1", state, learner("l1", phase, since=since)))
    before = copy.deepcopy(records)
    hosts = {"h1": host(draining=draining)}
    work = decide(records, hosts, Observed(), Plan(shares={}), CONFIG, now=NOW)
    got = work.get("j1", JobWork())
    lists = {"stops": got.stops, "restarts": got.restarts, "retires": got.retires}
    assert {k: v for k, v in lists.items() if v} == ({kind: ["l1"]} if kind else {})
    assert records == before


# --- decide: the plan, saves, finish and requeue ----------------------------------------------


def test_the_plans_lost_learners_and_retires_go_to_their_jobs() -> None:
    records = records_of(
        job("j1", S.JOB_STATE_RUNNING, learner("a", P.RUNNING), learner("b", P.RUNNING)),
        job("j2", S.JOB_STATE_RUNNING, learner("c", P.RETIRING)),
        job("j3", S.JOB_STATE_CANCELLING, learner("d", P.STOPPING)),
    )
    decided = Plan(
        shares={"j1": 1, "j2": 1},
        retires=(Retire("j1", "b"), Retire("j2", "c"), Retire("j3", "d"), Retire("j9", "x")),
        lost=("a", "unknown-learner"),
    )
    work = decide(records, {"h1": host()}, Observed(), decided, CONFIG, now=NOW)
    assert work["j1"].lost == [("a", "its device is no longer in the inventory")]
    assert work["j1"].retires == ["b"]  # c is retiring already, d's job is not active
    assert "j2" not in work and "j3" not in work
    assert list(work) == ["j1"]


def test_the_observed_work_comes_first_and_is_not_changed() -> None:
    records = records_of(
        job("j1", S.JOB_STATE_RUNNING, learner("a", P.RUNNING)),
        job("j2", S.JOB_STATE_RUNNING, learner("b", P.RUNNING)),
    )
    observed = Observed(work={"j2": JobWork(lost=[("b", "host h1 lost")])})
    work = decide(
        records, {"h1": host()}, observed, Plan(shares={}), CONFIG, changed=["j1"], now=NOW
    )
    assert list(work) == ["j2", "j1"]
    assert work["j1"].save and not work["j2"].save
    assert work["j2"] is not observed.work["j2"]
    assert observed.work["j2"] == JobWork(lost=[("b", "host h1 lost")])
    # a lost learner needs no housekeeping; with none left the job goes back to the queue
    assert work["j2"].requeue and not work["j1"].requeue


@pytest.mark.parametrize(
    ("state", "opened", "closed", "learners", "finish"),
    [
        (S.JOB_STATE_CANCELLING, False, False, (), True),
        (S.JOB_STATE_COMPLETED, True, False, (), True),  # close the data plane
        (S.JOB_STATE_COMPLETED, True, True, (), False),  # closed already
        (S.JOB_STATE_FAILED, False, False, (), False),  # never opened
        (S.JOB_STATE_CANCELLING, False, False, ("l1",), False),  # its learners first
        (S.JOB_STATE_RUNNING, True, False, (), False),  # active
    ],
)
def test_decide_finishes_a_job_without_learners(
    state: int, opened: bool, closed: bool, learners: tuple[str, ...], finish: bool
) -> None:
    held = [learner(lid, P.STOPPING) for lid in learners]
    records = records_of(job("j1", state, *held, opened=opened, closed=closed))
    work = decide(records, {"h1": host()}, Observed(), Plan(shares={}), CONFIG, now=NOW)
    assert work.get("j1", JobWork()).finish is finish


@pytest.mark.parametrize(
    ("state", "learners", "starts", "held", "requeue"),
    [
        pytest.param(S.JOB_STATE_RUNNING, (), False, False, True,
                     id="a_running_job_without_learners_goes_back_to_the_queue"),
        pytest.param(S.JOB_STATE_RECOVERING, (), False, False, True,
                     id="so_does_a_recovering_one"),
        pytest.param(S.JOB_STATE_RUNNING, (), True, False, False,
                     id="not_when_learners_start_this_cycle"),
        pytest.param(S.JOB_STATE_RUNNING, (), False, True, False,
                     id="not_while_its_coordinator_is_unreachable"),
        pytest.param(S.JOB_STATE_RUNNING, (P.PENDING,), False, False, False,
                     id="not_while_a_learner_is_pending"),
        pytest.param(S.JOB_STATE_QUEUED, (), False, False, False,
                     id="a_queued_job_is_queued_already"),
    ],
)  # fmt: skip
def test_decide_requeues_a_started_job_that_lost_every_learner(
    state: int, learners: tuple[LearnerPhase, ...], starts: bool, held: bool, requeue: bool
) -> None:
    records = records_of(job("j1", state, *(learner(f"l{i}", p) for i, p in enumerate(learners))))
    decided = Plan(shares={"j1": 1}, starts=(Start("j1", "h1", "0"),) if starts else ())
    work = decide(
        records,
        {"h1": host()},
        Observed(),
        decided,
        CONFIG,
        held={"j1"} if held else (),
        now=NOW,
    )
    assert work.get("j1", JobWork()).requeue is requeue


def test_a_moved_coordinator_is_saved() -> None:
    records = records_of(job("j1", S.JOB_STATE_RUNNING, learner("l1", P.RUNNING)))
    work = decide(
        records, {"h1": host()}, Observed(), Plan(shares={}), CONFIG, moved={"j1"}, now=NOW
    )
    assert work["j1"] == JobWork(save=True)


def test_a_moved_coordinator_is_told_the_retires_the_old_one_may_have_taken_with_it() -> None:
    records = records_of(
        job("j1", S.JOB_STATE_RUNNING, learner("l1", P.RUNNING), learner("l2", P.RETIRING))
    )
    work = decide(
        records, {"h1": host()}, Observed(), Plan(shares={}), CONFIG, moved={"j1"}, now=NOW
    )
    assert work["j1"] == JobWork(save=True, retires=["l2"])
    stay = decide(records, {"h1": host()}, Observed(), Plan(shares={}), CONFIG, now=NOW)
    assert "j1" not in stay  # no move: the retire was told once, as before
