"""Tests of placement (shoal.scheduler.placement) and trace replay (shoal.scheduler.simulator)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest

from shoal.scheduler.placement import (
    DeviceView,
    HostState,
    HostView,
    LearnerView,
    PlacementConfig,
    Plan,
    Retire,
    Start,
    plan,
)
from shoal.scheduler.policy import JobDemand, Policy
from shoal.scheduler.simulator import (
    Finish,
    HostDown,
    HostUp,
    SetPriority,
    Submit,
    simulate,
)

FAIR = PlacementConfig(policy=Policy.FAIRSHARE)
PRIO = PlacementConfig(policy=Policy.PRIORITY)


def job(job_id: str, *, prio: int = 5000, seq: int = 0, lo: int = 1, hi: int = 8) -> JobDemand:
    return JobDemand(job_id=job_id, priority=prio, submit_seq=seq, min_workers=lo, max_workers=hi)


def hosts(*spec: int | tuple[int, HostState]) -> list[HostView]:
    """hosts(4, 4) -> h1, h2 with four devices each; (4, HostState.LOST) sets the state."""
    out = []
    for i, s in enumerate(spec, start=1):
        count, state = s if isinstance(s, tuple) else (s, HostState.READY)
        out.append(HostView.with_devices(f"h{i}", count, state))
    return out


def learners(job_id: str, *where: tuple[str, int], retiring: bool = False) -> list[LearnerView]:
    """learners("j1", ("h1", 0), ("h1", 1)) -> learners j1-h1-0, j1-h1-1."""
    return [
        LearnerView(f"{job_id}-{h}-{d}", job_id, h, str(d), retiring=retiring) for h, d in where
    ]


def on(host: str, *devices: int) -> list[tuple[str, int]]:
    return [(host, d) for d in devices]


def apply(result: Plan, current: Sequence[LearnerView]) -> list[LearnerView]:
    """What the reconcile loop observes once it has acted on ``result`` (nobody exited yet)."""
    retire = {r.learner_id for r in result.retires}
    after = [
        LearnerView(x.learner_id, x.job_id, x.host_id, x.device_id, True)
        if x.learner_id in retire
        else x
        for x in current
    ]
    after += [
        LearnerView(f"{s.job_id}-{s.host_id}-{s.device_id}", s.job_id, s.host_id, s.device_id)
        for s in result.starts
    ]
    return after


def exit_retired(current: Sequence[LearnerView]) -> list[LearnerView]:
    return [x for x in current if not x.retiring]


def hosts_used(starts: Sequence[Start]) -> Counter[str]:
    return Counter(s.host_id for s in starts)


# --- grow: packing -------------------------------------------------------------------------------


def test_a_job_of_four_is_packed_onto_one_host() -> None:
    result = plan([job("j1", hi=4)], hosts(4, 4, 4), [], FAIR)
    assert hosts_used(result.starts) == {"h1": 4}


def test_a_job_of_six_on_hosts_of_four_uses_two_hosts() -> None:
    result = plan([job("j1", hi=6)], hosts(4, 4, 4), [], FAIR)
    assert len(hosts_used(result.starts)) == 2
    assert sorted(hosts_used(result.starts).values()) == [2, 4]


def test_grow_best_fits_the_rest_to_keep_whole_hosts_free() -> None:
    current = learners("other", *on("h1", 0, 1))  # h1 has 2 free, h2 has 4 free
    result = plan([job("other", hi=2), job("j1", hi=2, seq=1)], hosts(4, 4), current, FAIR)
    assert result.starts == (Start("j1", "h1", "2"), Start("j1", "h1", "3"))


def test_grow_prefers_the_hosts_where_the_job_already_runs() -> None:
    current = learners("j1", ("h2", 0))
    result = plan([job("j1", hi=4)], hosts(4, 4), current, FAIR)
    assert hosts_used(result.starts) == {"h2": 3}


def test_grow_takes_the_host_with_the_most_free_devices_when_none_fits() -> None:
    current = learners("other", ("h1", 0), ("h2", 0), ("h2", 1))
    result = plan([job("other", hi=3), job("j1", hi=5, seq=1)], hosts(4, 4, 3), current, FAIR)
    # Free: h1 3, h2 2, h3 3. No host has 5 free: the most free first (h1, before h3 by id),
    # then the best fit for the remaining 2 (h2, keeping h3's 3 together).
    assert hosts_used(result.starts) == {"h1": 3, "h2": 2}


def test_devices_are_taken_in_natural_order() -> None:
    inventory = [HostView("h1", tuple(DeviceView(f"gpu{i}") for i in (10, 2, 1)))]
    result = plan([job("j1", hi=2)], inventory, [], FAIR)
    assert [s.device_id for s in result.starts] == ["gpu1", "gpu2"]


# --- shrink --------------------------------------------------------------------------------------


def test_shrink_retires_on_the_host_where_the_job_is_most_spread() -> None:
    current = learners("j1", *on("h1", 0, 1, 2), ("h2", 0))
    result = plan([job("j1", hi=3)], hosts(4, 4), current, FAIR)
    assert result.retires == (Retire("j1", "j1-h2-0"),)


def test_shrink_empties_the_hosts_with_the_fewest_learners_first() -> None:
    current = learners("j1", *on("h1", 0, 1, 2, 3), *on("h2", 0, 1), ("h3", 0))
    result = plan([job("j1", hi=4)], hosts(4, 4, 4), current, FAIR)
    assert {r.learner_id for r in result.retires} == {"j1-h3-0", "j1-h2-0", "j1-h2-1"}


def test_shrink_retires_learners_on_cordoned_hosts_first() -> None:
    current = learners("j1", *on("h1", 0, 1, 2), ("h2", 0))
    inventory = hosts(4, (4, HostState.CORDONED))
    inventory[0] = HostView.with_devices("h1", 3)
    result = plan([job("j1", hi=3)], inventory, current, FAIR)
    assert result.retires == (Retire("j1", "j1-h2-0"),)
    current = learners("j1", *on("h1", 0, 1), *on("h2", 0, 1))
    result = plan([job("j1", hi=2)], hosts(4, (4, HostState.CORDONED)), current, FAIR)
    assert {r.learner_id for r in result.retires} == {"j1-h2-0", "j1-h2-1"}


def test_learners_of_a_job_that_is_gone_are_retired() -> None:
    current = learners("ghost", ("h1", 0), ("h1", 1))
    result = plan([], hosts(4), current, FAIR)
    assert {r.learner_id for r in result.retires} == {"ghost-h1-0", "ghost-h1-1"}


# --- level-triggered: retiring learners, waiting grows --------------------------------------------


def test_reference_step2_job1_retires_four_and_job2_waits_for_the_devices() -> None:
    jobs = [job("j1", seq=1), job("j2", seq=2)]
    current = learners("j1", *on("h1", 0, 1, 2, 3), *on("h2", 0, 1, 2, 3))
    first = plan(jobs, hosts(4, 4), current, FAIR)
    assert dict(first.shares) == {"j1": 4, "j2": 4}
    # Equally spread: the tie goes to the smaller host id, which is emptied.
    assert {r.learner_id for r in first.retires} == {f"j1-h1-{d}" for d in range(4)}
    assert first.starts == ()  # no device is free until the retiring learners exit

    retiring = apply(first, current)
    again = plan(jobs, hosts(4, 4), retiring, FAIR)
    assert again.decisions == ()  # idempotent: j1 already retires enough

    exited = exit_retired(retiring)
    third = plan(jobs, hosts(4, 4), exited, FAIR)
    assert third.retires == ()
    assert hosts_used(third.starts) == {"h1": 4}
    assert {s.job_id for s in third.starts} == {"j2"}


def test_a_job_partly_retiring_is_asked_only_for_the_rest() -> None:
    # j1 holds 4 on h1 and has one more on h2 already retiring; its share drops to 2.
    current = learners("j1", *on("h1", 0, 1, 2, 3)) + learners("j1", ("h2", 0), retiring=True)
    result = plan([job("j1", hi=2)], hosts(4, 4), current, FAIR)
    assert {r.learner_id for r in result.retires} == {"j1-h1-3", "j1-h1-2"}
    assert result.starts == ()


def test_a_freed_device_goes_to_the_highest_priority_job_below_target() -> None:
    # 8 devices: j1 (prio 9000) and j2 (prio 3000) are both below target; one device is free.
    jobs = [job("j0", prio=1, hi=6), job("j1", prio=9000, seq=1), job("j2", prio=3000, seq=2)]
    current = learners("j0", *on("h1", 0, 1, 2, 3), *on("h2", 0, 1), retiring=True)
    current += learners("j0", ("h2", 2))
    result = plan(jobs, hosts(4, 4), current, PRIO)
    assert result.starts == (Start("j1", "h2", "3"),)


def test_recomputing_after_applying_a_plan_gives_no_decisions() -> None:
    jobs = [job("j1", seq=1), job("j2", prio=10000, seq=2, lo=2), job("j3", hi=2, seq=3)]
    current = learners("j1", *on("h1", 0, 1, 2, 3), ("h2", 0))
    first = plan(jobs, hosts(4, 4, 4), current, PRIO)
    assert first.decisions
    assert plan(jobs, hosts(4, 4, 4), apply(first, current), PRIO).decisions == ()


# --- inventory: lost, cordoned, allocated ---------------------------------------------------------


def test_reference_step5_a_lost_hosts_learners_are_reported_and_the_job_continues() -> None:
    current = learners("j2", *on("h1", 0, 1, 2, 3), *on("h2", 0, 1, 2, 3))
    result = plan([job("j2", prio=10000)], hosts(4, (4, HostState.LOST)), current, PRIO)
    assert result.capacity == 4
    assert dict(result.shares) == {"j2": 4}
    assert set(result.lost) == {f"j2-h2-{d}" for d in range(4)}
    assert result.decisions == ()


def test_nothing_is_placed_on_a_cordoned_or_lost_host() -> None:
    inventory = hosts((4, HostState.CORDONED), (4, HostState.LOST), 2)
    result = plan([job("j1")], inventory, [], FAIR)
    assert result.capacity == 2
    assert hosts_used(result.starts) == {"h3": 2}


def test_a_cordoned_host_keeps_its_learners_and_their_capacity() -> None:
    current = learners("j1", *on("h1", 0, 1))
    result = plan([job("j1", hi=4)], hosts((4, HostState.CORDONED), 2), current, FAIR)
    assert result.capacity == 4
    assert result.retires == ()
    assert hosts_used(result.starts) == {"h2": 2}


def test_a_device_allocated_to_an_unknown_learner_is_neither_free_nor_counted() -> None:
    inventory = [HostView("h1", (DeviceView("0", "stranger"), DeviceView("1")))]
    result = plan([job("j1")], inventory, [], FAIR)
    assert result.capacity == 1
    assert result.starts == (Start("j1", "h1", "1"),)


def test_learners_on_unknown_hosts_or_devices_are_lost() -> None:
    current = learners("j1", ("h9", 0), ("h1", 7))
    result = plan([job("j1", hi=1)], hosts(4), current, FAIR)
    assert set(result.lost) == {"j1-h9-0", "j1-h1-7"}
    assert len(result.starts) == 1


def test_queued_jobs_are_reported_and_preempted_jobs_retire_everything() -> None:
    jobs = [job("low", prio=1, lo=4), job("high", prio=9000, lo=4, seq=1)]
    current = learners("low", *on("h1", 0, 1, 2, 3))
    result = plan(jobs, hosts(4), current, PRIO)
    assert result.queue == ("low",)
    assert len(result.retires) == 4


# --- invalid input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("inventory", "current", "message"),
    [
        pytest.param(
            hosts(1) + hosts(2),
            [],
            r"^host_id \('h1'\) is given more than once$",
            id="duplicate_host_ids",
        ),
        pytest.param(
            [HostView("h1", (DeviceView("0"), DeviceView("0")))],
            [],
            r"^device_id \('0'\) is given more than once on host h1$",
            id="duplicate_device_ids_on_a_host",
        ),
        pytest.param(
            hosts(2),
            learners("j1", ("h1", 0)) + learners("j1", ("h1", 0)),
            r"^learner_id \('j1-h1-0'\) is given more than once$",
            id="duplicate_learner_ids",
        ),
        pytest.param(
            hosts(2),
            [LearnerView("a", "j1", "h1", "0"), LearnerView("b", "j1", "h1", "0")],
            r"^device \(h1, 0\) is held by two learners: a and b$",
            id="two_learners_on_one_device",
        ),
    ],
)
def test_inconsistent_observed_state_is_rejected_naming_the_value(
    inventory: list[HostView], current: list[LearnerView], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        plan([job("j1")], inventory, current, FAIR)


def test_negative_hold_time_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"^hold_time \(-2.0\) must be >= 0$"):
        PlacementConfig(hold_time=-2.0)


# --- the reference scenario, replayed ------------------------------------------------------------


def test_the_reference_scenario_replays_as_the_design_says() -> None:
    events = [
        Submit(0.0, job("j1", seq=1)),
        Submit(10.0, job("j2", seq=2)),
        SetPriority(20.0, "j2", 10000),
        Finish(30.0, "j1"),
        HostDown(40.0, "h1"),
        HostUp(50.0, "h1"),
    ]
    result = simulate(hosts(4, 4), events, PRIO)
    assert [dict(s.workers) for s in result.timeline] == [
        {"j1": 8},
        {"j1": 4, "j2": 4},
        {"j1": 3, "j2": 5},
        {"j2": 8},
        {"j2": 4},
        {"j2": 8},
    ]
    assert result.series("j1") == [(0.0, 8), (10.0, 4), (20.0, 3), (30.0, 0), (40.0, 0), (50.0, 0)]


def test_replay_with_a_hold_time_defers_an_equal_priority_shrink() -> None:
    events = [
        Submit(0.0, job("j1", seq=1)),
        Submit(1.0, job("j2", seq=2)),
        Submit(2.0, job("j3", seq=3)),
        Submit(100.0, job("j4", seq=4, hi=1)),
    ]
    config = PlacementConfig(policy=Policy.FAIRSHARE, hold_time=30.0)
    result = simulate(hosts(4, 4), events, config)
    # j1 shrinks to 4 at t=1. At t=2 the fair shares are 3 / 3 / 2, but j1 is held at 4: it
    # takes back its unit from the most over-served job that is not held, j2.
    assert [dict(s.workers) for s in result.timeline][:3] == [
        {"j1": 8},
        {"j1": 4, "j2": 4},
        {"j1": 4, "j2": 2, "j3": 2},
    ]
    # At t=100 the hold is over and j4 arrives: the fair shares 3 / 2 / 2 / 1 apply.
    assert dict(result.timeline[3].workers) == {"j1": 3, "j2": 2, "j3": 2, "j4": 1}
