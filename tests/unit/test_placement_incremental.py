"""The incremental planner (shoal.scheduler.incremental): after any sequence of events its
decision equals the full ``plan()`` recomputed from scratch over the same state."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st

from shoal.scheduler.incremental import IncrementalPlanner
from shoal.scheduler.placement import (
    DeviceView,
    HostState,
    HostView,
    LearnerView,
    PlacementConfig,
    plan,
)
from shoal.scheduler.policy import JobDemand, Policy
from shoal.scheduler.simulator import Event, Finish, HostDown, HostUp, SetPriority, Submit, simulate

PRIORITIES = st.sampled_from([1, 3, 2500, 5000, 10000])
STATES = st.sampled_from([HostState.READY] * 4 + [HostState.CORDONED, HostState.LOST])
CONFIGS = st.builds(
    PlacementConfig,
    policy=st.sampled_from(list(Policy)),
    hold_time=st.sampled_from([0.0, 10.0, 1000.0]),
    sticky_rounding=st.booleans(),
)
OPS = [
    "submit",
    "update",
    "remove_job",
    "add_learner",
    "retire",
    "remove_learner",
    "put_host",
    "remove_host",
    "act",
    "act",
    "exits",
    "tick",
]


def full(planner: IncrementalPlanner, now: float):
    return plan(planner.jobs(), planner.hosts(), planner.learners(), planner.config, now=now)


def state(planner: IncrementalPlanner):
    return planner.jobs(), planner.hosts(), planner.learners()


@st.composite
def jobs(draw: st.DrawFn, job_id: str, seq: int) -> JobDemand:
    lo = draw(st.integers(1, 3))
    return JobDemand(
        job_id=job_id,
        priority=draw(PRIORITIES),
        submit_seq=seq,
        min_workers=lo,
        max_workers=draw(st.integers(lo, lo + 8)),
        last_shrunk_at=draw(st.none() | st.floats(0.0, 50.0)),
    )


@st.composite
def hosts(draw: st.DrawFn, host_id: str) -> HostView:
    count = draw(st.integers(0, 6))
    devices = tuple(
        DeviceView(str(d), "stranger" if draw(st.integers(0, 9)) == 0 else None)
        for d in range(count)
    )
    return HostView(host_id, devices, draw(STATES))


@settings(max_examples=150, deadline=None)
@given(CONFIGS, st.data())
def test_incremental_decision_equals_the_full_recompute_after_random_events(
    config: PlacementConfig, data: st.DataObject
) -> None:
    planner = IncrementalPlanner(config)
    now = 0.0
    seq = 0
    names = 0
    for h in range(data.draw(st.integers(0, 4))):
        planner.put_host(data.draw(hosts(f"h{h}")))
    last = planner.decide(now)
    assert last == full(planner, now)
    for _ in range(data.draw(st.integers(1, 25))):
        op = data.draw(st.sampled_from(OPS))
        known_jobs = [j.job_id for j in planner.jobs()]
        learners = planner.learners()
        before = state(planner)
        try:
            if op == "submit":
                seq += 1
                planner.submit(data.draw(jobs(f"j{seq}", seq)))
            elif op == "update" and known_jobs:
                chosen = data.draw(st.sampled_from(known_jobs))
                old = next(j for j in planner.jobs() if j.job_id == chosen)
                lo = data.draw(st.integers(1, 3))
                planner.update_job(
                    replace(
                        old,
                        priority=data.draw(PRIORITIES),
                        min_workers=lo,
                        max_workers=max(lo, old.max_workers),
                        previous_priority=old.priority,
                    )
                )
            elif op == "remove_job" and known_jobs:
                planner.remove_job(data.draw(st.sampled_from(known_jobs)))
            elif op == "add_learner":
                host_ids = [h.host_id for h in planner.hosts()] + ["nowhere"]
                names += 1
                planner.add_learner(
                    LearnerView(
                        f"x{names}",
                        data.draw(st.sampled_from([*known_jobs, "gone"])),
                        data.draw(st.sampled_from(host_ids)),
                        str(data.draw(st.integers(0, 6))),
                        retiring=data.draw(st.booleans()),
                    )
                )
            elif op == "retire" and learners:
                planner.retire_learner(data.draw(st.sampled_from(learners)).learner_id)
            elif op == "remove_learner" and learners:
                planner.remove_learner(data.draw(st.sampled_from(learners)).learner_id)
            elif op == "put_host":
                host_id = f"h{data.draw(st.integers(0, 5))}"
                planner.put_host(data.draw(hosts(host_id)))
            elif op == "remove_host" and planner.hosts():
                planner.remove_host(data.draw(st.sampled_from(planner.hosts())).host_id)
            elif op == "act":
                # Ideal actors: the last decision's starts run, its retires are marked.
                for r in last.retires:
                    planner.retire_learner(r.learner_id)
                    job = next((j for j in planner.jobs() if j.job_id == r.job_id), None)
                    if job is not None:
                        planner.update_job(replace(job, last_shrunk_at=now))
                for s in last.starts:
                    names += 1
                    planner.add_learner(LearnerView(f"s{names}", s.job_id, s.host_id, s.device_id))
            elif op == "exits":
                for x in learners:
                    if x.retiring or x.learner_id in last.lost:
                        planner.remove_learner(x.learner_id)
            elif op == "tick":
                now += data.draw(st.sampled_from([0.5, 5.0, 20.0]))
        except ValueError:
            # A rejected event (two learners on one device, an unknown id) changes nothing.
            assert state(planner) == before
        last = planner.decide(now)
        assert last == full(planner, now), op
        # Deciding again with nothing changed gives the same (cached) decision.
        assert planner.decide(now) == last


def test_reference_scenario_through_events() -> None:
    """The README scenario, 8 -> 4/4 -> 5/3 -> 8 devices, driven by events."""
    config = PlacementConfig(policy=Policy.PRIORITY)
    planner = IncrementalPlanner(config, inventory=[HostView.with_devices("h1", 8)])
    names = iter(range(1000))

    def settle() -> dict[str, int]:
        for _ in range(10):
            decided = planner.decide()
            assert decided == full(planner, 0.0)
            if not decided.decisions:
                break
            for r in decided.retires:
                planner.remove_learner(r.learner_id)  # exits at once
            for s in decided.starts:
                planner.add_learner(
                    LearnerView(f"l{next(names)}", s.job_id, s.host_id, s.device_id)
                )
        held: dict[str, int] = {}
        for x in planner.learners():
            held[x.job_id] = held.get(x.job_id, 0) + 1
        return held

    a = JobDemand(job_id="a", priority=5000, submit_seq=0, min_workers=1, max_workers=8)
    planner.submit(a)
    assert settle() == {"a": 8}
    b = JobDemand(job_id="b", priority=5000, submit_seq=1, min_workers=1, max_workers=8)
    planner.submit(b)
    assert settle() == {"a": 4, "b": 4}
    planner.update_job(replace(a, priority=7500, previous_priority=5000))
    assert settle() == {"a": 5, "b": 3}
    planner.remove_job("b")
    assert settle() == {"a": 8}


def test_bad_events_name_the_value_and_change_nothing() -> None:
    config = PlacementConfig(policy=Policy.FAIRSHARE)
    planner = IncrementalPlanner(
        config,
        jobs=[JobDemand(job_id="a", priority=1, submit_seq=0, max_workers=2)],
        inventory=[HostView.with_devices("h1", 2)],
        current=[LearnerView("l1", "a", "h1", "0")],
    )
    before = state(planner)
    with pytest.raises(ValueError, match=r"^learner_id \('l1'\) is given more than once$"):
        planner.add_learner(LearnerView("l1", "a", "h1", "1"))
    with pytest.raises(ValueError, match=r"^device \(h1, 0\) is held by two learners: l1 and l2$"):
        planner.add_learner(LearnerView("l2", "a", "h1", "0"))
    with pytest.raises(ValueError, match=r"^learner_id \('zz'\) is not known$"):
        planner.remove_learner("zz")
    with pytest.raises(ValueError, match=r"^job_id \('zz'\) is not known$"):
        planner.remove_job("zz")
    with pytest.raises(ValueError, match=r"^host_id \('zz'\) is not known$"):
        planner.remove_host("zz")
    with pytest.raises(ValueError, match=r"^device_id \('0'\) is given more than once on host h1$"):
        planner.put_host(HostView("h1", (DeviceView("0"), DeviceView("0"))))
    with pytest.raises(ValueError, match=r"^host_id \('h1'\) is given more than once$"):
        planner.resync([], [HostView.with_devices("h1", 1)] * 2, [])
    assert state(planner) == before
    assert planner.decide() == full(planner, 0.0)


def test_a_steady_decision_touches_only_the_jobs_an_event_changed() -> None:
    """Once every job holds its share, an exit makes one job a candidate: the decision
    starts exactly one learner for it, and the next decision after acting has none."""
    config = PlacementConfig(policy=Policy.PRIORITY)
    inventory = [HostView.with_devices(f"h{i}", 4) for i in range(4)]
    jobs_ = [
        JobDemand(job_id=f"j{i}", priority=5000, submit_seq=i, max_workers=4) for i in range(4)
    ]
    planner = IncrementalPlanner(config, jobs_, inventory)
    for i, s in enumerate(planner.decide().starts):
        planner.add_learner(LearnerView(f"l{i}", s.job_id, s.host_id, s.device_id))
    assert planner.decide().decisions == ()
    gone = planner.learners()[5]
    planner.remove_learner(gone.learner_id)
    decided = planner.decide()
    assert decided == full(planner, 0.0)
    assert [(s.job_id, s.host_id, s.device_id) for s in decided.starts] == [
        (gone.job_id, gone.host_id, gone.device_id)
    ]


@settings(max_examples=40, deadline=None)
@given(CONFIGS, st.data())
def test_an_incremental_replay_equals_the_full_cycle_replay(
    config: PlacementConfig, data: st.DataObject
) -> None:
    """``simulate(..., incremental=True)`` (events and acted-on decisions fed to the planner)
    gives the same timeline, rounds, starts and retires as the replay of full cycles."""
    inventory = [HostView.with_devices(f"h{i}", data.draw(st.integers(1, 4))) for i in range(3)]
    events: list[Event] = []
    submitted: list[str] = []
    for k in range(data.draw(st.integers(1, 12))):
        at = float(k * 10)
        kind = data.draw(st.sampled_from(["submit", "submit", "finish", "prio", "down", "up"]))
        if kind == "submit" or not submitted:
            job_id = f"j{k}"
            submitted.append(job_id)
            events.append(Submit(at, data.draw(jobs(job_id, k))))
        elif kind == "finish":
            events.append(Finish(at, data.draw(st.sampled_from(submitted))))
        elif kind == "prio":
            events.append(SetPriority(at, data.draw(st.sampled_from(submitted)), 7))
        else:
            host = data.draw(st.sampled_from(inventory)).host_id
            events.append(HostDown(at, host) if kind == "down" else HostUp(at, host))
    finished: set[str] = set()
    valid: list[Event] = []
    for event in events:  # no priority change of a finished job (the replay rejects it)
        if isinstance(event, Finish):
            finished.add(event.job_id)
        if isinstance(event, SetPriority) and event.job_id in finished:
            continue
        valid.append(event)
    full_replay = simulate(inventory, valid, config)
    assert simulate(inventory, valid, config, incremental=True) == full_replay
