"""Property tests of the share policy and of placement (hypothesis)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

from hypothesis import given, settings, strategies as st

from shoal.scheduler.placement import (
    DeviceView,
    HostState,
    HostView,
    LearnerView,
    PlacementConfig,
    Plan,
    plan,
)
from shoal.scheduler.policy import JobDemand, Policy, admission_key, compute_shares

PRIORITIES = st.sampled_from([1, 2, 3, 100, 2500, 5000, 7500, 10000]) | st.integers(1, 10**6)
WEIGHTED = st.sampled_from([Policy.FAIRSHARE, Policy.PRIORITY])
ALL_POLICIES = st.sampled_from(list(Policy))


@st.composite
def job_lists(draw: st.DrawFn, max_jobs: int = 10) -> list[JobDemand]:
    count = draw(st.integers(0, max_jobs))
    jobs = []
    for i in range(count):
        lo = draw(st.integers(1, 4))
        hi = draw(st.integers(lo, lo + 10))
        jobs.append(
            JobDemand(
                job_id=f"j{i}",
                priority=draw(PRIORITIES),
                submit_seq=draw(st.integers(0, 20)),
                min_workers=lo,
                max_workers=hi,
                current=draw(st.integers(0, 14)),
                last_shrunk_at=draw(st.none() | st.floats(0.0, 100.0)),
            )
        )
    return jobs


CAPACITY = st.integers(0, 64)
NOW = st.floats(0.0, 120.0)
HOLD = st.sampled_from([0.0, 10.0, 50.0, 1000.0])


# --- compute_shares ------------------------------------------------------------------------------


@given(job_lists(), CAPACITY, ALL_POLICIES, NOW, HOLD)
def test_shares_respect_capacity_max_and_min(
    jobs: list[JobDemand], capacity: int, policy: Policy, now: float, hold: float
) -> None:
    alloc = compute_shares(jobs, capacity, policy, now=now, hold_time=hold)
    assert set(alloc.shares) == {j.job_id for j in jobs}
    assert sum(alloc.shares.values()) <= capacity
    queued = set(alloc.queue)
    for j in jobs:
        share = alloc.shares[j.job_id]
        if j.job_id in queued:
            assert share == 0
        else:
            assert j.min_workers <= share <= j.max_workers


@given(job_lists(), CAPACITY, ALL_POLICIES, NOW, HOLD)
def test_shares_are_work_conserving(
    jobs: list[JobDemand], capacity: int, policy: Policy, now: float, hold: float
) -> None:
    alloc = compute_shares(jobs, capacity, policy, now=now, hold_time=hold)
    admitted = [j for j in jobs if j.job_id not in alloc.queue]
    if any(alloc.shares[j.job_id] < j.max_workers for j in admitted):
        assert sum(alloc.shares.values()) == capacity


@given(job_lists(), CAPACITY, ALL_POLICIES)
def test_queue_is_the_tail_of_the_admission_order_and_its_head_does_not_fit(
    jobs: list[JobDemand], capacity: int, policy: Policy
) -> None:
    alloc = compute_shares(jobs, capacity, policy)
    order = [j.job_id for j in sorted(jobs, key=admission_key(policy))]
    assert list(alloc.queue) == order[len(order) - len(alloc.queue) :]
    if alloc.queue:
        by_id = {j.job_id: j for j in jobs}
        admitted_mins = sum(j.min_workers for j in jobs if j.job_id not in alloc.queue)
        assert admitted_mins + by_id[alloc.queue[0]].min_workers > capacity


@given(
    st.integers(2, 8),
    PRIORITIES,
    st.integers(1, 3),
    st.integers(0, 12),
    job_lists(max_jobs=4),
    CAPACITY,
    WEIGHTED,
)
def test_jobs_of_equal_priority_and_caps_differ_by_at_most_one(
    twins: int,
    priority: int,
    lo: int,
    extra: int,
    others: list[JobDemand],
    capacity: int,
    policy: Policy,
) -> None:
    same = [
        JobDemand(
            job_id=f"twin{i}",
            priority=priority,
            submit_seq=100 + i,
            min_workers=lo,
            max_workers=lo + extra,
        )
        for i in range(twins)
    ]
    alloc = compute_shares(others + same, capacity, policy)
    running = [alloc.shares[j.job_id] for j in same if j.job_id not in alloc.queue]
    if running:
        assert max(running) - min(running) <= 1


@given(job_lists(), CAPACITY, ALL_POLICIES, NOW, HOLD, st.randoms(use_true_random=False))
def test_shares_do_not_depend_on_the_input_order(
    jobs: list[JobDemand],
    capacity: int,
    policy: Policy,
    now: float,
    hold: float,
    rnd: random.Random,
) -> None:
    shuffled = list(jobs)
    rnd.shuffle(shuffled)
    a = compute_shares(jobs, capacity, policy, now=now, hold_time=hold)
    b = compute_shares(shuffled, capacity, policy, now=now, hold_time=hold)
    assert dict(a.shares) == dict(b.shares)
    assert a.queue == b.queue
    assert a.held == b.held


@settings(max_examples=300, deadline=None)
@given(job_lists(), st.integers(0, 40), ALL_POLICIES, NOW, st.sampled_from([50.0, 1000.0]))
def test_holds_only_move_devices_from_equal_or_lower_priority_jobs_to_held_ones(
    jobs: list[JobDemand], capacity: int, policy: Policy, now: float, hold: float
) -> None:
    alloc = compute_shares(jobs, capacity, policy, now=now, hold_time=hold)
    ideal = compute_shares(jobs, capacity, policy)
    assert alloc.queue == ideal.queue
    assert sum(alloc.shares.values()) == sum(ideal.shares.values())
    top_held = max((j.priority for j in jobs if j.job_id in alloc.held), default=None)
    for j in jobs:
        got, fair = alloc.shares[j.job_id], ideal.shares[j.job_id]
        if j.job_id in alloc.held:
            assert j.last_shrunk_at is not None and now - j.last_shrunk_at < hold
            assert fair < got <= min(j.current, j.max_workers)
        elif top_held is not None and j.priority > top_held:
            assert got == fair  # a strictly higher priority job keeps its share
        else:
            assert got <= fair  # donors only give


# --- placement -----------------------------------------------------------------------------------


@st.composite
def clusters(
    draw: st.DrawFn,
) -> tuple[list[JobDemand], list[HostView], list[LearnerView]]:
    """Jobs, an inventory and a consistent set of learners on it."""
    jobs = draw(job_lists(max_jobs=6))
    job_ids = [j.job_id for j in jobs] + ["gone"]  # "gone": a job no longer in the list
    inventory = []
    current = []
    for h in range(draw(st.integers(0, 6))):
        state = draw(st.sampled_from([HostState.READY] * 4 + [HostState.CORDONED, HostState.LOST]))
        devices = []
        for d in range(draw(st.integers(1, 8))):
            who = draw(st.integers(-2, len(job_ids) - 1))  # -2 free, -1 foreign allocation
            devices.append(DeviceView(str(d), "stranger" if who == -1 else None))
            if who >= 0:
                lid = f"l{h}.{d}"
                current.append(
                    LearnerView(lid, job_ids[who], f"h{h}", str(d), retiring=draw(st.booleans()))
                )
        inventory.append(HostView(f"h{h}", tuple(devices), state))
    return jobs, inventory, current


CONFIGS = st.builds(PlacementConfig, policy=ALL_POLICIES, hold_time=HOLD)


def apply(result: Plan, current: list[LearnerView], tag: str) -> list[LearnerView]:
    """The observed state once the plan's decisions are acted on (no learner exited yet)."""
    retire = {r.learner_id for r in result.retires}
    after = [x._replace(retiring=True) if x.learner_id in retire else x for x in current]
    after += [
        LearnerView(f"{tag}{i}", s.job_id, s.host_id, s.device_id)
        for i, s in enumerate(result.starts)
    ]
    return after


def mark_shrunk(jobs: list[JobDemand], result: Plan, now: float) -> list[JobDemand]:
    shrunk = {r.job_id for r in result.retires}
    return [replace(j, last_shrunk_at=now) if j.job_id in shrunk else j for j in jobs]


@settings(max_examples=300, deadline=None)
@given(clusters(), CONFIGS, NOW)
def test_placement_never_assigns_a_device_twice_nor_an_unusable_one(
    cluster: tuple[list[JobDemand], list[HostView], list[LearnerView]],
    config: PlacementConfig,
    now: float,
) -> None:
    jobs, inventory, current = cluster
    result = plan(jobs, inventory, current, config, now=now)
    slots = [(s.host_id, s.device_id) for s in result.starts]
    assert len(slots) == len(set(slots))
    ready = {h.host_id for h in inventory if h.state is HostState.READY}
    taken = {(x.host_id, x.device_id) for x in current}
    allocated = {(h.host_id, d.device_id) for h in inventory for d in h.devices if d.allocated_to}
    for slot in slots:
        assert slot[0] in ready
        assert slot not in taken
        assert slot not in allocated
    # Retires name live learners that are not already retiring, once each.
    lost = set(result.lost)
    retirable = {x.learner_id: x for x in current if not x.retiring and x.learner_id not in lost}
    retired = [r.learner_id for r in result.retires]
    assert len(retired) == len(set(retired))
    for r in result.retires:
        assert retirable[r.learner_id].job_id == r.job_id
    # Nobody is started beyond its share.
    held = Counter(x.job_id for x in retirable.values())
    for job_id, n in Counter(s.job_id for s in result.starts).items():
        assert held[job_id] + n <= result.shares[job_id]


@settings(max_examples=300, deadline=None)
@given(clusters(), CONFIGS, NOW)
def test_applying_a_plan_and_recomputing_gives_no_further_decisions(
    cluster: tuple[list[JobDemand], list[HostView], list[LearnerView]],
    config: PlacementConfig,
    now: float,
) -> None:
    jobs, inventory, current = cluster
    first = plan(jobs, inventory, current, config, now=now)
    after = apply(first, current, "new")
    again = plan(mark_shrunk(jobs, first, now), inventory, after, config, now=now)
    assert again.decisions == ()
    assert dict(again.shares) == dict(first.shares)


@settings(max_examples=200, deadline=None)
@given(clusters(), CONFIGS, NOW)
def test_once_retired_learners_exit_every_job_converges_to_its_share(
    cluster: tuple[list[JobDemand], list[HostView], list[LearnerView]],
    config: PlacementConfig,
    now: float,
) -> None:
    jobs, inventory, current = cluster
    for round_ in range(20):
        result = plan(jobs, inventory, current, config, now=now)
        if not result.decisions and not any(x.retiring for x in current):
            break
        jobs = mark_shrunk(jobs, result, now)
        current = [x for x in apply(result, current, f"r{round_}.") if not x.retiring]
        current = [x for x in current if x.learner_id not in set(result.lost)]
    else:
        raise AssertionError("no fixed point after 20 rounds")
    held = Counter(x.job_id for x in current if x.learner_id not in set(result.lost))
    assert {j: n for j, n in held.items() if n} == {j: n for j, n in result.shares.items() if n}


def test_fifo_holds_settle_in_one_cycle_when_a_held_job_reaches_its_share() -> None:
    """Found by the property above (2026-11-26). 18 devices all held by j0 (16 learners, max
    6, shrunk at 0) and j4 (2, max 2, shrunk at 0); four earlier FIFO jobs hold nothing.
    Cycle 1: j0 is held (share 5 < 6) so j4, also held, takes its unit from j1; j0 retires 11.
    Cycle 2: j0 holds 5 = its share and is no longer held; it was the donor j4 took from (as
    the latest submitted), one more retire within j0's hold time, until a job shrunk within
    its hold time stopped giving to another held job even when it is not held itself."""
    config = PlacementConfig(policy=Policy.FIFO, hold_time=10.0)
    jobs = [
        JobDemand(job_id="j0", priority=1, submit_seq=1, max_workers=6, last_shrunk_at=0.0),
        JobDemand(job_id="j1", priority=2, submit_seq=0, max_workers=9),
        JobDemand(job_id="j2", priority=1, submit_seq=0, max_workers=1),
        JobDemand(job_id="j3", priority=1, submit_seq=0, max_workers=1),
        JobDemand(job_id="j4", priority=2, submit_seq=1, max_workers=2, last_shrunk_at=0.0),
        JobDemand(job_id="j5", priority=1, submit_seq=0, max_workers=1),
    ]
    sizes = {"h0": 1, "h1": 6, "h2": 6, "h3": 1, "h4": 4}
    inventory = [HostView.with_devices(h, n) for h, n in sizes.items()]
    current = [
        LearnerView(f"l{h[1]}.{d}", "j4" if (h, d) in {("h4", 0), ("h4", 1)} else "j0", h, str(d))
        for h, n in sizes.items()
        for d in range(n)
    ]
    first = plan(jobs, inventory, current, config, now=0.0)
    after = apply(first, current, "new")
    again = plan(mark_shrunk(jobs, first, 0.0), inventory, after, config, now=0.0)
    assert again.decisions == ()
