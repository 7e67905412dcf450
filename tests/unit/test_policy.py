"""Table tests of the share policy (shoal.scheduler.policy)."""

from __future__ import annotations

import pytest

from shoal.scheduler.policy import Allocation, JobDemand, Policy, compute_shares

FAIR, PRIO, FIFO = Policy.FAIRSHARE, Policy.PRIORITY, Policy.FIFO


def job(
    job_id: str,
    *,
    prio: int = 5000,
    seq: int | None = None,
    lo: int = 1,
    hi: int = 8,
    cur: int = 0,
    shrunk: float | None = None,
    was: int | None = None,
) -> JobDemand:
    """A job; its submit order defaults to the digits of its id (j1 -> 1)."""
    if seq is None:
        seq = int("".join(c for c in job_id if c.isdigit()) or 0)
    return JobDemand(
        job_id=job_id,
        priority=prio,
        submit_seq=seq,
        min_workers=lo,
        max_workers=hi,
        current=cur,
        last_shrunk_at=shrunk,
        previous_priority=was,
    )


def shares_of(alloc: Allocation) -> dict[str, int]:
    return dict(sorted(alloc.shares.items()))


# --- the reference scenario (8 GPUs on two hosts of four) -------------------------------------


@pytest.mark.parametrize(
    ("jobs", "policy", "expected"),
    [
        pytest.param([job("j1")], FAIR, {"j1": 8}, id="step1_one_job_with_max_8_gets_all_8"),
        pytest.param([job("j1")], PRIO, {"j1": 8}, id="step1_same_under_priority"),
        pytest.param([job("j1")], FIFO, {"j1": 8}, id="step1_same_under_fifo"),
        pytest.param(
            [job("j1"), job("j2")], FAIR, {"j1": 4, "j2": 4}, id="step2_fairshare_splits_4_and_4"
        ),
        pytest.param(
            [job("j1"), job("j2")],
            PRIO,
            {"j1": 4, "j2": 4},
            id="step2_equal_priorities_split_4_and_4",
        ),
        pytest.param(
            [job("j1"), job("j2", prio=10000)],
            PRIO,
            {"j1": 3, "j2": 5},
            id="step3_priority_10000_vs_5000_gives_5_and_3_by_largest_remainder",
        ),
        pytest.param(
            [job("j1", cur=3), job("j2", prio=10000, cur=5)],
            PRIO,
            {"j1": 3, "j2": 5},
            id="step3_holds_when_recomputed_with_the_current_counts",
        ),
        pytest.param(
            [job("j2", prio=10000, cur=5)],
            PRIO,
            {"j2": 8},
            id="step4_when_the_3_gpu_job_finishes_the_other_gets_8",
        ),
        pytest.param(
            [job("j1"), job("j2", prio=10000)],
            FAIR,
            {"j1": 4, "j2": 4},
            id="fairshare_ignores_priority_in_the_weights",
        ),
    ],
)
def test_reference_scenario_shares(
    jobs: list[JobDemand], policy: Policy, expected: dict[str, int]
) -> None:
    alloc = compute_shares(jobs, 8, policy)
    assert shares_of(alloc) == expected
    assert alloc.queue == ()


def test_reference_scenario_step5_host_loss_halves_the_capacity() -> None:
    alloc = compute_shares([job("j2", prio=10000, cur=8)], 4, PRIO)
    assert shares_of(alloc) == {"j2": 4}


# --- FIFO ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("jobs", "capacity", "expected", "queue"),
    [
        pytest.param(
            [job("j1", hi=5), job("j2")], 8, {"j1": 5, "j2": 3}, (), id="first_job_fills_to_max"
        ),
        pytest.param(
            [job("j1"), job("j2")],
            8,
            {"j1": 7, "j2": 1},
            (),
            id="later_job_gets_only_its_min_while_the_first_wants_more",
        ),
        pytest.param(
            [job("j2", lo=2), job("j1")],
            8,
            {"j1": 6, "j2": 2},
            (),
            id="submit_order_not_input_order_decides",
        ),
        pytest.param(
            [job("j1", prio=1, lo=8), job("j2", prio=10000)],
            8,
            {"j1": 8, "j2": 0},
            ("j2",),
            id="admission_is_in_submit_order_whatever_the_priority",
        ),
        pytest.param(
            [job("j1", lo=6), job("j2", lo=4, prio=9000), job("j3", prio=1)],
            8,
            {"j1": 8, "j2": 0, "j3": 0},
            ("j2", "j3"),
            id="queue_is_in_submit_order",
        ),
        pytest.param(
            [job("j1", hi=2), job("j2", hi=2), job("j3", hi=2)],
            8,
            {"j1": 2, "j2": 2, "j3": 2},
            (),
            id="capacity_left_over_when_every_job_is_at_max",
        ),
    ],
)
def test_fifo_gives_jobs_in_submit_order_all_they_want(
    jobs: list[JobDemand], capacity: int, expected: dict[str, int], queue: tuple[str, ...]
) -> None:
    alloc = compute_shares(jobs, capacity, FIFO)
    assert shares_of(alloc) == expected
    assert alloc.queue == queue


# --- water-filling: caps, mins, weights, rounding -------------------------------------------------


@pytest.mark.parametrize(
    ("jobs", "policy", "capacity", "expected"),
    [
        pytest.param(
            [job("j1", hi=2), job("j2"), job("j3")],
            FAIR,
            8,
            {"j1": 2, "j2": 3, "j3": 3},
            id="a_job_capped_at_2_among_three_leaves_the_rest_to_the_others",
        ),
        pytest.param(
            [job("j1", hi=2, prio=10000), job("j2"), job("j3")],
            PRIO,
            8,
            {"j1": 2, "j2": 3, "j3": 3},
            id="a_capped_high_priority_job_leaves_the_rest_to_the_others",
        ),
        pytest.param(
            [job("j1", hi=1), job("j2", prio=10000), job("j3")],
            PRIO,
            8,
            {"j1": 1, "j2": 5, "j3": 2},
            id="what_a_capped_job_leaves_is_split_by_weight",
        ),
        pytest.param(
            [job("j1", hi=3), job("j2", hi=3)],
            FAIR,
            8,
            {"j1": 3, "j2": 3},
            id="capacity_stays_idle_when_every_job_is_at_max",
        ),
        pytest.param(
            [job("j1", prio=10000), job("j2", prio=1, lo=3)],
            PRIO,
            8,
            {"j1": 5, "j2": 3},
            id="a_low_priority_job_still_gets_its_min",
        ),
        pytest.param(
            [job("j1", lo=6), job("j2")],
            FAIR,
            8,
            {"j1": 6, "j2": 2},
            id="a_min_above_the_fair_share_is_honoured",
        ),
        pytest.param(
            [job("j1", lo=4, hi=4), job("j2", lo=4, hi=4)],
            FAIR,
            8,
            {"j1": 4, "j2": 4},
            id="mins_that_fill_the_capacity_exactly",
        ),
        pytest.param(
            [job("j1", prio=1), job("j2", prio=2), job("j3", prio=3)],
            FAIR,
            8,
            {"j1": 2, "j2": 3, "j3": 3},
            id="equal_remainders_go_to_the_higher_priority_first",
        ),
        pytest.param(
            [job("j1"), job("j2"), job("j3")],
            FAIR,
            8,
            {"j1": 3, "j2": 3, "j3": 2},
            id="equal_remainders_and_priorities_go_to_the_earlier_submit",
        ),
        pytest.param(
            [job("j1", prio=3), job("j2", prio=3), job("j3", prio=2)],
            PRIO,
            10,
            {"j1": 4, "j2": 4, "j3": 2},
            id="largest_remainder_gives_the_spare_unit_to_the_largest_fraction",
        ),
        pytest.param(
            [job("j1", hi=80)],
            PRIO,
            80_000,
            {"j1": 80},
            id="a_huge_capacity_is_capped_by_max",
        ),
    ],
)
def test_water_filling(
    jobs: list[JobDemand], policy: Policy, capacity: int, expected: dict[str, int]
) -> None:
    assert shares_of(compute_shares(jobs, capacity, policy)) == expected


# --- admission and the queue ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("jobs", "capacity", "expected", "queue"),
    [
        pytest.param(
            [job("j1", lo=3), job("j2", lo=2, prio=10000), job("j3", lo=2), job("j4")],
            4,
            {"j1": 0, "j2": 4, "j3": 0, "j4": 0},
            ("j1", "j3", "j4"),
            id="jobs_beyond_capacity_queue_in_priority_then_submit_order_without_backfill",
        ),
        pytest.param(
            [job("j1", lo=5), job("j2", lo=5), job("j3", lo=5)],
            8,
            {"j1": 8, "j2": 0, "j3": 0},
            ("j2", "j3"),
            id="equal_priorities_queue_in_submit_order",
        ),
        pytest.param(
            [job("j1", lo=6, cur=8), job("j2", lo=4, prio=10000)],
            8,
            {"j1": 0, "j2": 8},
            ("j1",),
            id="a_running_job_is_preempted_when_a_higher_priority_min_needs_its_devices",
        ),
        pytest.param(
            [job("j1"), job("j2")],
            0,
            {"j1": 0, "j2": 0},
            ("j1", "j2"),
            id="zero_capacity_queues_everything",
        ),
        pytest.param([], 8, {}, (), id="no_jobs_no_shares"),
    ],
)
def test_admission_and_queue(
    jobs: list[JobDemand], capacity: int, expected: dict[str, int], queue: tuple[str, ...]
) -> None:
    alloc = compute_shares(jobs, capacity, PRIO)
    assert shares_of(alloc) == expected
    assert alloc.queue == queue


# --- the hold-time rule -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("jobs", "policy", "now", "hold_time", "expected", "held"),
    [
        pytest.param(
            [job("j1", cur=8, shrunk=10.0), job("j2")],
            FAIR,
            15.0,
            30.0,
            {"j1": 7, "j2": 1},
            {"j1"},
            id="a_job_shrunk_within_the_hold_time_is_not_shrunk_by_an_equal_priority_job",
        ),
        pytest.param(
            [job("j1", cur=8, shrunk=10.0), job("j2", prio=2500)],
            PRIO,
            15.0,
            30.0,
            {"j1": 7, "j2": 1},
            {"j1"},
            id="nor_by_a_lower_priority_job",
        ),
        pytest.param(
            [job("j1", cur=8, shrunk=10.0), job("j2", prio=10000)],
            PRIO,
            15.0,
            30.0,
            {"j1": 3, "j2": 5},
            set(),
            id="but_is_shrunk_when_a_strictly_higher_priority_job_needs_the_gpus",
        ),
        pytest.param(
            [job("j1", cur=8, shrunk=10.0), job("j2")],
            FAIR,
            40.0,
            30.0,
            {"j1": 4, "j2": 4},
            set(),
            id="the_hold_ends_once_hold_time_has_passed",
        ),
        pytest.param(
            [job("j1", cur=8, shrunk=10.0), job("j2")],
            FAIR,
            15.0,
            5.0,
            {"j1": 4, "j2": 4},
            set(),
            id="the_hold_ends_exactly_at_hold_time",
        ),
        pytest.param(
            [job("j1", cur=8, shrunk=10.0), job("j2")],
            FAIR,
            15.0,
            0.0,
            {"j1": 4, "j2": 4},
            set(),
            id="hold_time_zero_disables_the_rule",
        ),
        pytest.param(
            [job("j1", cur=8), job("j2")],
            FAIR,
            15.0,
            30.0,
            {"j1": 4, "j2": 4},
            set(),
            id="a_job_never_shrunk_is_not_held",
        ),
        pytest.param(
            [job("j1", cur=8, shrunk=10.0), job("j2", lo=3)],
            FAIR,
            15.0,
            30.0,
            {"j1": 5, "j2": 3},
            {"j1"},
            id="a_hold_never_blocks_another_jobs_min",
        ),
        pytest.param(
            [job("j1", cur=6, shrunk=10.0), job("j2", prio=10000), job("j3")],
            PRIO,
            15.0,
            30.0,
            {"j1": 3, "j2": 4, "j3": 1},
            {"j1"},
            id="a_held_job_takes_back_only_from_equal_or_lower_priority_jobs",
        ),
        pytest.param(
            [job("j1", cur=3, shrunk=10.0), job("j2")],
            FAIR,
            15.0,
            30.0,
            {"j1": 4, "j2": 4},
            set(),
            id="a_held_job_still_grows",
        ),
        pytest.param(
            [job("j1", cur=8, hi=6, shrunk=10.0), job("j2", hi=2)],
            FAIR,
            15.0,
            30.0,
            {"j1": 6, "j2": 2},
            set(),
            id="a_held_job_still_shrinks_to_a_lowered_max",
        ),
        pytest.param(
            [job("j1", cur=4, shrunk=10.0), job("j2", cur=4, shrunk=10.0), job("j3")],
            FAIR,
            15.0,
            30.0,
            {"j1": 4, "j2": 3, "j3": 1},
            {"j1"},
            id="held_jobs_take_back_in_rank_order_and_never_from_each_other",
        ),
        pytest.param(
            [job("j1", cur=3, shrunk=10.0), job("j2", cur=5, shrunk=10.0), job("j3")],
            FAIR,
            15.0,
            30.0,
            {"j1": 3, "j2": 4, "j3": 1},
            {"j2"},
            id="a_job_shrunk_to_its_share_within_the_hold_time_gives_nothing_to_a_held_one",
        ),
    ],
)
def test_hold_time_rule(
    jobs: list[JobDemand],
    policy: Policy,
    now: float,
    hold_time: float,
    expected: dict[str, int],
    held: set[str],
) -> None:
    alloc = compute_shares(jobs, 8, policy, now=now, hold_time=hold_time)
    assert shares_of(alloc) == expected
    assert alloc.held == held


# --- invalid input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "message"),
    [
        pytest.param(
            lambda: compute_shares([job("j1")], -1, FAIR),
            r"^capacity \(-1\) must be >= 0$",
            id="negative_capacity_is_rejected",
        ),
        pytest.param(
            lambda: compute_shares([job("j1", lo=1, hi=0)], 8, FAIR),
            r"^max_workers \(0\) must be >= min_workers \(1\) for job j1$",
            id="max_below_min_is_rejected",
        ),
        pytest.param(
            lambda: job("j1", lo=0),
            r"^min_workers \(0\) must be >= 1 for job j1$",
            id="min_below_one_is_rejected",
        ),
        pytest.param(
            lambda: job("j1", prio=0),
            r"^priority \(0\) must be > 0 for job j1$",
            id="zero_priority_is_rejected",
        ),
        pytest.param(
            lambda: job("j7", prio=-5),
            r"^priority \(-5\) must be > 0 for job j7$",
            id="negative_priority_is_rejected",
        ),
        pytest.param(
            lambda: job("j1", cur=-1),
            r"^current \(-1\) must be >= 0 for job j1$",
            id="negative_current_is_rejected",
        ),
        pytest.param(
            lambda: job(""),
            r"^job_id \(''\) must be non-empty$",
            id="empty_job_id_is_rejected",
        ),
        pytest.param(
            lambda: compute_shares([job("j1"), job("j1", seq=2)], 8, FAIR),
            r"^job_id \('j1'\) is given more than once$",
            id="duplicate_job_ids_are_rejected",
        ),
        pytest.param(
            lambda: compute_shares([job("j1")], 8, FAIR, hold_time=-1.0),
            r"^hold_time \(-1.0\) must be >= 0$",
            id="negative_hold_time_is_rejected",
        ),
    ],
)
def test_invalid_input_raises_value_error_naming_the_field_and_value(
    make: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        make()  # type: ignore[operator]


# --- sticky rounding -----------------------------------------------------------------------------

AFTER_J4_FINISHED = [
    job("j1", prio=3, hi=7, cur=4),
    job("j2", prio=1, hi=4, cur=2),
    job("j3", prio=3, hi=8, cur=4),
]


@pytest.mark.parametrize(
    ("jobs", "sticky", "expected"),
    [
        pytest.param(
            AFTER_J4_FINISHED,
            True,
            {"j1": 5, "j2": 2, "j3": 4},
            id="a_job_finishing_does_not_shrink_a_running_job_by_rounding",
        ),
        pytest.param(
            AFTER_J4_FINISHED,
            False,
            {"j1": 5, "j2": 1, "j3": 5},
            id="plain_largest_remainder_would_shrink_it",
        ),
        pytest.param(
            [job("j1", cur=2), job("j2", cur=2), job("j3", cur=3)],
            True,
            {"j1": 3, "j2": 2, "j3": 3},
            id="the_spare_unit_stays_with_the_job_that_holds_it",
        ),
        pytest.param(
            [job("j1", cur=2), job("j2", cur=2), job("j3", cur=3)],
            False,
            {"j1": 3, "j2": 3, "j3": 2},
            id="plain_largest_remainder_moves_it_by_submit_order",
        ),
    ],
)
def test_sticky_rounding(jobs: list[JobDemand], sticky: bool, expected: dict[str, int]) -> None:
    capacity = 11 if jobs is AFTER_J4_FINISHED else 8
    alloc = compute_shares(jobs, capacity, PRIO, sticky_rounding=sticky)
    assert shares_of(alloc) == expected


@pytest.mark.parametrize(
    ("jobs", "expected"),
    [
        pytest.param(
            [job("j1", prio=10000, was=5000, cur=2), job("j2", cur=2)],
            {"j1": 3, "j2": 1},
            id="raised_from_2_2_the_raised_job_gets_3_of_4",
        ),
        pytest.param(
            [job("j1", prio=10000, was=5000, cur=1), job("j2", cur=3)],
            {"j1": 3, "j2": 1},
            id="raised_while_holding_1_of_4_it_gets_3",
        ),
        pytest.param(
            [job("j1", prio=5000, cur=2), job("j2", prio=2500, was=5000, cur=2)],
            {"j1": 3, "j2": 1},
            id="a_lowered_job_gives_a_device_up",
        ),
        pytest.param(
            [job("j1", prio=10000, was=10000, cur=2), job("j2", cur=2)],
            {"j1": 2, "j2": 2},
            id="an_unchanged_previous_priority_keeps_sticky_rounding",
        ),
    ],
)
def test_sticky_rounding_never_defeats_a_priority_change(
    jobs: list[JobDemand], expected: dict[str, int]
) -> None:
    assert shares_of(compute_shares(jobs, 4, PRIO)) == expected
    # The next cycle, with the new holdings and nothing changed, keeps the result.
    settled = [
        JobDemand(
            job_id=j.job_id,
            priority=j.priority,
            submit_seq=j.submit_seq,
            max_workers=j.max_workers,
            current=expected[j.job_id],
            previous_priority=j.priority,
        )
        for j in jobs
    ]
    assert shares_of(compute_shares(settled, 4, PRIO)) == expected


def test_a_priority_change_under_fairshare_changes_nothing() -> None:
    jobs = [job("j1", prio=10000, was=5000, cur=1), job("j2", cur=3)]
    assert shares_of(compute_shares(jobs, 5, FAIR)) == {"j1": 2, "j2": 3}


def test_before_j4_finished_the_shares_were_4_2_4_1() -> None:
    jobs = [*AFTER_J4_FINISHED, job("j4", prio=1, hi=6, cur=1)]
    assert shares_of(compute_shares(jobs, 11, PRIO)) == {"j1": 4, "j2": 2, "j3": 4, "j4": 1}


def test_shares_do_not_depend_on_the_order_of_the_input() -> None:
    jobs = [job("j1", prio=3), job("j2", prio=7, hi=2), job("j3", prio=5, lo=2), job("j4")]
    forward = compute_shares(jobs, 9, PRIO)
    backward = compute_shares(list(reversed(jobs)), 9, PRIO)
    assert shares_of(forward) == shares_of(backward)
    assert forward.queue == backward.queue


def test_share_of_an_unknown_job_is_zero() -> None:
    assert compute_shares([job("j1")], 8, FAIR).share("nope") == 0
