"""Table and property tests of the GOODPUT policy and of the attained-service classes
(shoal.scheduler.policy)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from shoal.scheduler.policy import JobDemand, Policy, compute_shares, service_class
from shoal.scheduler.throughput import ThroughputCurve

FAIR, PRIO, FIFO, GOOD = Policy.FAIRSHARE, Policy.PRIORITY, Policy.FIFO, Policy.GOODPUT

# Iteration-time curves (see test_throughput.py): scales well, stops near 4, does not scale.
SCALES = ThroughputCurve(overhead=0.01, compute=2.0, sync=0.02, sync_per_worker=0.001)
STOPS = ThroughputCurve(overhead=0.01, compute=1.0, sync=0.1, sync_per_worker=0.05)
FLAT = ThroughputCurve(overhead=0.01, compute=0.02, sync=0.3, sync_per_worker=0.01)
# A sync cost paid once from 2 learners on: 2 learners are slower than 1, 4 are faster.
STEP = ThroughputCurve(overhead=0.0, compute=1.0, sync=0.6, sync_per_worker=0.0)


def job(
    job_id: str,
    *,
    prio: int = 5000,
    lo: int = 1,
    hi: int = 8,
    cur: int = 0,
    curve: ThroughputCurve | None = None,
    served: float = 0.0,
) -> JobDemand:
    seq = int("".join(c for c in job_id if c.isdigit()) or 0)
    return JobDemand(
        job_id=job_id,
        priority=prio,
        submit_seq=seq,
        min_workers=lo,
        max_workers=hi,
        current=cur,
        throughput=curve,
        attained_service=served,
    )


@pytest.mark.parametrize(
    ("jobs", "capacity", "kwargs", "expected"),
    [
        pytest.param(
            [job("j1"), job("j2")], 8, {}, {"j1": 4, "j2": 4}, id="no_curves_equal_jobs_split"
        ),
        pytest.param(
            [job("j1", curve=SCALES), job("j2", curve=SCALES)],
            8,
            {},
            {"j1": 4, "j2": 4},
            id="equal_curves_split_evenly",
        ),
        pytest.param(
            [job("j1", prio=10000), job("j2")],
            9,
            {},
            {"j1": 6, "j2": 3},
            id="linear_speedups_follow_the_priorities",
        ),
        pytest.param(
            [job("j1", curve=FLAT), job("j2", curve=SCALES)],
            8,
            {},
            {"j1": 1, "j2": 7},
            id="flat_job_gets_the_fastest_size_within_its_floor",
        ),
        pytest.param(
            [job("j1", curve=FLAT), job("j2", curve=SCALES)],
            8,
            {"fair_fraction": 0.0},
            {"j1": 1, "j2": 7},
            id="without_a_floor_the_flat_job_gets_its_min",
        ),
        pytest.param(
            [job("j1", curve=FLAT), job("j2", curve=SCALES)],
            8,
            {"fair_fraction": 1.0},
            {"j1": 1, "j2": 7},
            id="even_a_full_floor_gives_no_device_that_slows_a_job",
        ),
        pytest.param(
            [job("j1", curve=STOPS, hi=16), job("j2", curve=SCALES, hi=16)],
            16,
            {},
            {"j1": 4, "j2": 12},
            id="a_job_that_stops_scaling_stops_growing",
        ),
        pytest.param(
            [job("j1", curve=FLAT, hi=16)],
            16,
            {},
            {"j1": 1},
            id="alone_a_flat_job_keeps_its_fastest_size_the_rest_stays_free",
        ),
        pytest.param(
            [job("j1", curve=STOPS, hi=16), job("j2", curve=STOPS, hi=16)],
            16,
            {"fair_fraction": 1.0},
            {"j1": 4, "j2": 4},
            id="a_full_floor_stops_at_the_best_size_too",
        ),
        pytest.param(
            [job("j1", curve=STEP, hi=4), job("j2", curve=FLAT, hi=4)],
            5,
            {"fair_fraction": 0.0},
            {"j1": 4, "j2": 1},
            id="a_sync_step_is_priced_over_the_steps_it_pays_for",
        ),
        pytest.param(
            [job("j1", lo=3, curve=FLAT), job("j2", curve=SCALES)],
            8,
            {"fair_fraction": 0.0},
            {"j1": 3, "j2": 5},
            id="min_workers_always_kept",
        ),
        pytest.param(
            [job("j1", hi=2, curve=SCALES), job("j2", curve=STOPS)],
            8,
            {},
            {"j1": 2, "j2": 4},
            id="max_workers_always_kept_and_stops_at_its_best",
        ),
    ],
)
def test_goodput_shares(
    jobs: list[JobDemand], capacity: int, kwargs: dict, expected: dict[str, int]
) -> None:
    assert dict(compute_shares(jobs, capacity, GOOD, **kwargs).shares) == expected


def test_goodput_admission_is_priority_admission() -> None:
    jobs = [job("j1", lo=4), job("j2", lo=4, prio=10000), job("j3", lo=2)]
    queue = compute_shares(jobs, 6, GOOD).queue
    assert queue == compute_shares(jobs, 6, PRIO).queue == ("j1", "j3")


def test_goodput_holds_apply() -> None:
    jobs = [
        JobDemand(
            job_id="j1",
            priority=5000,
            submit_seq=1,
            max_workers=8,
            current=6,
            last_shrunk_at=95.0,
            throughput=FLAT,
        ),
        job("j2", curve=SCALES, cur=2),
    ]
    alloc = compute_shares(jobs, 8, GOOD, now=100.0, hold_time=30.0)
    assert alloc.shares == {"j1": 6, "j2": 2} and alloc.held == frozenset({"j1"})


# --- attained service ------------------------------------------------------------------------


def test_service_class() -> None:
    assert [service_class(s, (100.0, 1000.0)) for s in (0, 99.9, 100, 999, 1000, 1e9)] == [
        0,
        0,
        1,
        1,
        2,
        2,
    ]


@pytest.mark.parametrize(
    ("jobs", "policy", "capacity", "expected"),
    [
        pytest.param(
            [job("j1", served=50.0), job("j2")], FAIR, 9, {"j1": 5, "j2": 4}, id="same_class_even"
        ),
        pytest.param(
            [job("j1", served=500.0), job("j2")], FAIR, 9, {"j1": 3, "j2": 6}, id="one_class_up"
        ),
        pytest.param(
            [job("j1", served=5000.0), job("j2")],
            FAIR,
            10,
            {"j1": 2, "j2": 8},
            id="two_classes_up_bounded_at_a_quarter",
        ),
        pytest.param(
            [job("j1", served=5000.0, prio=10000), job("j2")],
            PRIO,
            9,
            {"j1": 3, "j2": 6},
            id="priority_times_the_class_weight",
        ),
        pytest.param(
            [job("j1", served=500.0), job("j2")],
            GOOD,
            9,
            {"j1": 3, "j2": 6},
            id="goodput_reads_the_same_weights",
        ),
        pytest.param(
            [job("j1", served=5000.0), job("j2")],
            FIFO,
            8,
            {"j1": 7, "j2": 1},
            id="fifo_ignores_service",
        ),
    ],
)
def test_attained_service_weights(
    jobs: list[JobDemand], policy: Policy, capacity: int, expected: dict[str, int]
) -> None:
    alloc = compute_shares(jobs, capacity, policy, service_thresholds=(100.0, 1000.0))
    assert dict(alloc.shares) == expected


def test_without_thresholds_service_changes_nothing() -> None:
    jobs = [job("j1", served=1e9), job("j2")]
    for policy in (FAIR, PRIO, FIFO):
        assert (
            compute_shares(jobs, 8, policy).shares
            == compute_shares([job("j1"), job("j2")], 8, policy).shares
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"fair_fraction": -0.1}, r"fair_fraction \(-0.1\) must be in \[0, 1\]"),
        ({"fair_fraction": 1.5}, r"fair_fraction \(1.5\) must be in \[0, 1\]"),
        ({"service_thresholds": (0.0,)}, r"service_thresholds\[0\] \(0.0\) must be"),
        ({"service_thresholds": (10.0, 5.0)}, r"service_thresholds\[1\] \(5.0\) must be"),
        ({"service_thresholds": (float("nan"),)}, r"service_thresholds\[0\] \(nan\)"),
        ({"service_decay": 0}, r"service_decay \(0\) must be an integer >= 1"),
        ({"service_decay": 1.5}, r"service_decay \(1.5\) must be an integer >= 1"),
    ],
)
def test_invalid_options_name_the_field_and_value(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        compute_shares([job("j1")], 4, GOOD, **kwargs)


def test_invalid_attained_service() -> None:
    with pytest.raises(ValueError, match=r"attained_service \(-1.0\) must be >= 0 for job j1"):
        job("j1", served=-1.0)


# --- properties ------------------------------------------------------------------------------

CURVES = st.sampled_from([None, SCALES, STOPS, FLAT, STEP]) | st.builds(
    ThroughputCurve,
    overhead=st.floats(0.0, 1.0),
    compute=st.floats(0.01, 10.0),
    sync=st.floats(0.0, 1.0),
    sync_per_worker=st.floats(0.0, 0.5),
)


@st.composite
def goodput_jobs(draw: st.DrawFn, max_jobs: int = 8) -> list[JobDemand]:
    jobs = []
    for i in range(draw(st.integers(0, max_jobs))):
        lo = draw(st.integers(1, 3))
        jobs.append(
            JobDemand(
                job_id=f"j{i}",
                priority=draw(st.sampled_from([1000, 5000, 10000])),
                submit_seq=draw(st.integers(0, 20)),
                min_workers=lo,
                max_workers=draw(st.integers(lo, lo + 12)),
                current=draw(st.integers(0, 12)),
                throughput=draw(CURVES),
                attained_service=draw(st.sampled_from([0.0, 50.0, 500.0, 5000.0])),
            )
        )
    return jobs


FRACTION = st.sampled_from([0.0, 0.25, 0.5, 1.0])
THRESHOLDS = st.sampled_from([(), (100.0,), (100.0, 1000.0)])


@settings(max_examples=150, deadline=None)
@given(goodput_jobs(), st.integers(0, 48), FRACTION, THRESHOLDS)
def test_goodput_shares_respect_capacity_min_max_and_the_floor(
    jobs: list[JobDemand], capacity: int, fraction: float, thresholds: tuple[float, ...]
) -> None:
    kw = {"fair_fraction": fraction, "service_thresholds": thresholds}
    alloc = compute_shares(jobs, capacity, GOOD, **kw)
    fair = compute_shares(jobs, capacity, PRIO, sticky_rounding=False, **kw)
    assert alloc.queue == fair.queue
    assert sum(alloc.shares.values()) <= capacity  # no device given twice
    for j in jobs:
        share = alloc.shares[j.job_id]
        if j.job_id in alloc.queue:
            assert share == 0
            continue
        assert j.min_workers <= share <= j.max_workers
        # The fairness floor, in throughput: at least as fast as on any size from min to
        # fraction * its PRIORITY share (linear speedup without a curve: that many devices).
        bound = min(j.max_workers, max(j.min_workers, int(fraction * fair.shares[j.job_id])))
        if j.throughput is None:
            assert share >= bound
        else:
            best = min(j.throughput.iteration_time(k) for k in range(j.min_workers, bound + 1))
            assert j.throughput.iteration_time(share) <= best * (1 + 1e-9)


@settings(max_examples=150, deadline=None)
@given(goodput_jobs(), st.integers(0, 48))
def test_goodput_never_gives_a_job_a_device_that_slows_it(
    jobs: list[JobDemand], capacity: int
) -> None:
    """Above its floor, a job grows only while its hull says growing pays: it never ends at a
    size where every larger size it could reach is slower and a smaller one above its floor
    is faster."""
    alloc = compute_shares(jobs, capacity, GOOD, fair_fraction=0.0)
    for j in jobs:
        share = alloc.shares[j.job_id]
        if j.job_id in alloc.queue or j.throughput is None or share <= j.min_workers:
            continue
        best = j.throughput.best_world_size(share)
        assert j.throughput.iteration_time(best) <= j.throughput.iteration_time(j.min_workers)
        assert j.throughput.iteration_time(share) < j.throughput.iteration_time(j.min_workers)


@settings(max_examples=150, deadline=None)
@given(goodput_jobs(), st.integers(0, 48), FRACTION)
def test_goodput_orders_priorities_of_equal_curves(
    jobs: list[JobDemand], capacity: int, fraction: float
) -> None:
    """Of two admitted jobs with the same curve, the same bounds and the same service, the one
    of higher priority never gets fewer devices."""
    alloc = compute_shares(jobs, capacity, GOOD, fair_fraction=fraction)
    admitted = [j for j in jobs if j.job_id not in alloc.queue]
    for a in admitted:
        for b in admitted:
            same = (a.throughput, a.min_workers, a.max_workers) == (
                b.throughput,
                b.min_workers,
                b.max_workers,
            )
            if same and a.priority > b.priority:
                assert alloc.shares[a.job_id] >= alloc.shares[b.job_id]


@settings(max_examples=100, deadline=None)
@given(goodput_jobs(), st.integers(0, 48))
def test_goodput_is_deterministic_whatever_the_input_order(
    jobs: list[JobDemand], capacity: int
) -> None:
    one = compute_shares(jobs, capacity, GOOD)
    two = compute_shares(list(reversed(jobs)), capacity, GOOD)
    assert one == two


@settings(max_examples=100, deadline=None)
@given(goodput_jobs(), st.integers(0, 48), st.sampled_from([FAIR, PRIO, GOOD]))
def test_attained_service_orders_equal_jobs(
    jobs: list[JobDemand], capacity: int, policy: Policy
) -> None:
    """Of two admitted jobs alike but for their service, the less served never gets fewer."""
    alloc = compute_shares(jobs, capacity, policy, service_thresholds=(100.0, 1000.0))
    admitted = [j for j in jobs if j.job_id not in alloc.queue]
    for a in admitted:
        for b in admitted:
            same = (a.throughput, a.min_workers, a.max_workers, a.priority) == (
                b.throughput,
                b.min_workers,
                b.max_workers,
                b.priority,
            )
            if same and a.attained_service < b.attained_service:
                assert alloc.shares[a.job_id] >= alloc.shares[b.job_id] - (policy is not GOOD)


# --- the scheduler's flags -------------------------------------------------------------------


def _scheduler_config(*flags: str):  # type: ignore[no-untyped-def]
    from shoal.scheduler.main import build_parser, config_from_args

    base = ["--insecure-no-auth", "--resource-managers", "rm:1", "--sync-shards", "ps:1"]
    return config_from_args(build_parser({}).parse_args([*base, *flags]))


def test_scheduler_flags_select_goodput_and_service_classes() -> None:
    config = _scheduler_config(
        "--policy",
        "goodput",
        "--fair-fraction",
        "0.25",
        "--service-thresholds",
        "3600, 36000",
        "--rescale-horizon",
        "900",
    )
    assert config.rescale_horizon_s == 900.0
    assert config.policy is GOOD
    assert config.fair_fraction == 0.25
    assert config.service_thresholds == (3600.0, 36000.0)
    assert config.service_decay == 2
    default = _scheduler_config()
    assert default.policy is PRIO and default.service_thresholds == ()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--policy", "fastest"], "policy"),
        (["--fair-fraction", "2"], r"fair_fraction \(2.0\)"),
        (["--fair-fraction", "half"], r"fair_fraction \('half'\)"),
        (["--service-thresholds", "100,50"], r"service_thresholds \('100,50'\)"),
        (["--service-thresholds", "100,x"], r"service_thresholds \('x'\)"),
        (["--service-decay", "0"], r"service_decay \(0\)"),
        (["--rescale-horizon", "-5"], r"rescale_horizon_s \(-5.0\)"),
    ],
)
def test_scheduler_flags_refuse_bad_values(flags: list[str], message: str) -> None:
    from shoal.runtime.errors import InvalidField

    with pytest.raises(InvalidField, match=message):
        _scheduler_config(*flags)


# --- rescale cost ------------------------------------------------------------------------------


def running(job_id: str, cur: int, pause: float, curve: ThroughputCurve | None = SCALES, **kw):  # type: ignore[no-untyped-def]
    seq = int("".join(c for c in job_id if c.isdigit()) or 0)
    return JobDemand(
        job_id=job_id,
        priority=kw.get("prio", 5000),
        submit_seq=seq,
        max_workers=kw.get("hi", 8),
        current=cur,
        throughput=curve,
        rescale_pause_s=pause,
    )


@pytest.mark.parametrize(
    ("jobs", "horizon", "expected"),
    [
        pytest.param(
            [running("j1", 6, 30.0), running("j2", 2, 30.0)],
            0.0,
            {"j1": 4, "j2": 4},
            id="without_a_horizon_the_shares_are_rebalanced",
        ),
        pytest.param(
            [running("j1", 6, 30.0), running("j2", 2, 30.0)],
            600.0,
            {"j1": 4, "j2": 4},
            id="a_long_horizon_pays_for_the_pause",
        ),
        pytest.param(
            [running("j1", 6, 30.0), running("j2", 2, 30.0)],
            60.0,
            {"j1": 6, "j2": 2},
            id="a_short_horizon_does_not_pay_for_a_30_s_pause",
        ),
        pytest.param(
            [running("j1", 5, 1.0), running("j2", 3, 1.0)],
            60.0,
            {"j1": 4, "j2": 4},
            id="a_cheap_pause_is_paid",
        ),
        pytest.param(
            [running("j1", 6, 30.0), running("j2", 2, 30.0), job("j3", curve=SCALES)],
            60.0,
            {"j1": 3, "j2": 2, "j3": 3},
            id="a_job_that_must_change_anyway_is_shared_as_if_new",
        ),
        pytest.param(
            [running("j1", 6, 30.0, hi=4), running("j2", 2, 30.0)],
            60.0,
            {"j1": 4, "j2": 4},
            id="a_lowered_max_is_obeyed_whatever_the_pause",
        ),
    ],
)
def test_rescale_cost(jobs: list[JobDemand], horizon: float, expected: dict[str, int]) -> None:
    alloc = compute_shares(jobs, 8, GOOD, rescale_horizon=horizon, fair_fraction=0.0)
    assert dict(alloc.shares) == expected


def test_invalid_rescale_settings() -> None:
    with pytest.raises(ValueError, match=r"rescale_horizon \(-1.0\) must be >= 0"):
        compute_shares([job("j1")], 4, GOOD, rescale_horizon=-1.0)
    with pytest.raises(ValueError, match=r"rescale_pause_s \(-1.0\) must be >= 0 for job j1"):
        running("j1", 1, -1.0)


@settings(max_examples=100, deadline=None)
@given(goodput_jobs(), st.integers(0, 48), st.sampled_from([0.0, 60.0, 600.0]))
def test_rescale_cost_keeps_the_bounds(
    jobs: list[JobDemand], capacity: int, horizon: float
) -> None:
    jobs = [
        JobDemand(**{**{f: getattr(j, f) for f in j.__dataclass_fields__}, "rescale_pause_s": 20.0})
        for j in jobs
    ]
    alloc = compute_shares(jobs, capacity, GOOD, rescale_horizon=horizon)
    assert sum(alloc.shares.values()) <= capacity
    for j in jobs:
        if j.job_id not in alloc.queue:
            assert j.min_workers <= alloc.shares[j.job_id] <= j.max_workers
