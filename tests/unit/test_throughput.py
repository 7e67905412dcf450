"""Unit tests of the per-job throughput model (shoal.scheduler.throughput) and of what the
scheduler learns from progress polls (shoal.scheduler.goodput)."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given, settings, strategies as st

from shoal.scheduler.goodput import MAX_POINTS, GoodputTracker, describe
from shoal.scheduler.policy import JobDemand
from shoal.scheduler.throughput import (
    PRIOR,
    Sample,
    ThroughputCurve,
    ThroughputModel,
    fit_curve,
)
from shoal.v1 import job_pb2

# A job that scales (sync small against compute), one that stops at a few learners (sync
# grows per peer), and one that does not scale at all (a sync-bound tiny model).
SCALES = ThroughputCurve(overhead=0.01, compute=2.0, sync=0.02, sync_per_worker=0.001, batch=256)
STOPS = ThroughputCurve(overhead=0.01, compute=1.0, sync=0.1, sync_per_worker=0.05, batch=64)
FLAT = ThroughputCurve(overhead=0.01, compute=0.02, sync=0.3, sync_per_worker=0.01, batch=32)


def test_curve_formula() -> None:
    c = ThroughputCurve(overhead=0.1, compute=1.0, sync=0.2, sync_per_worker=0.05, batch=10)
    assert c.iteration_time(1) == pytest.approx(1.1)
    assert c.iteration_time(2) == pytest.approx(0.1 + 0.5 + 0.2 + 0.05)
    assert c.iteration_time(4) == pytest.approx(0.1 + 0.25 + 0.2 + 0.15)
    assert c.samples_per_second(1) == pytest.approx(10 / 1.1)
    assert c.speedup(1) == 1.0
    assert c.speedup(4) == pytest.approx(1.1 / 0.7)


def test_best_world_size() -> None:
    assert SCALES.best_world_size(16) == 16
    assert STOPS.best_world_size(16) == 4  # sqrt(compute / sync_per_worker) ~ 4.5
    assert FLAT.best_world_size(16) == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"overhead": -1.0, "compute": 1.0}, "overhead (-1.0) must be a finite number >= 0"),
        ({"overhead": 0.0, "compute": math.nan}, "compute (nan) must be"),
        ({"overhead": 0.0, "compute": 0.0}, "overhead + compute (0.0 + 0.0) must be > 0"),
        ({"overhead": 0.0, "compute": 1.0, "sync": math.inf}, "sync (inf) must be"),
        ({"overhead": 0.0, "compute": 1.0, "batch": 0}, "batch (0) must be >= 1"),
    ],
)
def test_invalid_curves_name_the_field_and_value(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        ThroughputCurve(**kwargs)


def test_invalid_world_size() -> None:
    with pytest.raises(ValueError, match=r"world_size \(0\) must be >= 1"):
        SCALES.iteration_time(0)


@pytest.mark.parametrize("true", [SCALES, STOPS, FLAT], ids=["scales", "stops", "flat"])
def test_fit_recovers_a_curve_from_exact_points(true: ThroughputCurve) -> None:
    points = [(w, true.iteration_time(w), 5.0) for w in (1, 2, 3, 4, 6, 8)]
    fitted = fit_curve(points, batch=true.batch)
    assert fitted is not None
    for w in range(1, 17):
        assert fitted.iteration_time(w) == pytest.approx(true.iteration_time(w), rel=1e-6)


def test_fit_keeps_parameters_non_negative() -> None:
    # Times that grow with w at first (a sync cost) then fall: no parameter may go negative.
    fitted = fit_curve([(1, 1.0, 1.0), (2, 1.2, 1.0), (8, 0.5, 1.0)])
    assert fitted is not None
    assert min(fitted.overhead, fitted.compute, fitted.sync, fitted.sync_per_worker) >= 0


def test_fit_of_nothing_is_none() -> None:
    assert fit_curve([]) is None
    assert fit_curve([(0, 1.0, 1.0), (1, -1.0, 1.0), (2, 1.0, 0.0)]) is None


def test_model_without_data_is_the_prior() -> None:
    model = ThroughputModel(batch=64)
    assert model.curve() == ThroughputCurve(
        PRIOR.overhead, PRIOR.compute, PRIOR.sync, PRIOR.sync_per_worker, batch=64
    )
    assert model.curve().speedup(2) == pytest.approx(1 / (0.05 + 0.475 + 0.05 + 0.01))
    assert model.pause_s == 10.0 and not model.pause_measured


def test_one_world_size_seen_scales_the_prior_to_it() -> None:
    model = ThroughputModel(batch=64)
    for _ in range(3):
        model.observe(1, 2.0)
    curve = model.curve()
    assert curve.iteration_time(1) == pytest.approx(2.0, rel=1e-6)
    assert curve.speedup(8) == pytest.approx(PRIOR.speedup(8), rel=1e-6)  # the prior's shape


@pytest.mark.parametrize("true", [SCALES, STOPS, FLAT], ids=["scales", "stops", "flat"])
def test_model_learns_the_seen_world_sizes(true: ThroughputCurve) -> None:
    model = ThroughputModel(batch=true.batch)
    for w in (1, 2, 4):
        for _ in range(10):
            model.observe(w, true.iteration_time(w))
    curve = model.curve()
    for w in (1, 2, 4):
        assert curve.iteration_time(w) == pytest.approx(true.iteration_time(w), rel=0.05)
    assert model.observed() == pytest.approx({w: true.iteration_time(w) for w in (1, 2, 4)})


def test_model_orders_jobs_by_how_well_they_scale() -> None:
    """The property the policy relies on: from a few observed sizes, the predicted gain of
    more devices is larger for the job that scales."""
    curves = {}
    for name, true in (("scales", SCALES), ("stops", STOPS), ("flat", FLAT)):
        model = ThroughputModel(batch=true.batch)
        for w in (1, 2):
            for _ in range(10):
                model.observe(w, true.iteration_time(w))
        curves[name] = model.curve()
    for w in (2, 4, 8):
        assert curves["scales"].speedup(w) > curves["stops"].speedup(w) > curves["flat"].speedup(w)
    assert curves["flat"].speedup(2) < 1.0


def test_model_follows_drift_with_an_exponential_mean() -> None:
    model = ThroughputModel()
    for _ in range(5):
        model.observe(2, 1.0)
    for _ in range(20):
        model.observe(2, 2.0)
    assert model.observed()[2] == pytest.approx(2.0, rel=0.02)


def test_model_ignores_nonsense_observations() -> None:
    model = ThroughputModel()
    for w, t in ((0, 1.0), (1, 0.0), (1, -1.0), (1, math.nan), (1, math.inf)):
        model.observe(w, t)
    model.observe_pause(-1.0)
    model.observe_pause(math.nan)
    assert model.observed() == {}
    assert not model.pause_measured


def test_pause_is_a_running_mean() -> None:
    model = ThroughputModel()
    model.observe_pause(4.0)
    model.observe_pause(8.0)
    assert model.pause_measured and model.pause_s == pytest.approx(6.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch": 0}, r"batch \(0\) must be >= 1"),
        ({"prior_weight": 0.0}, r"prior_weight \(0.0\) must be > 0"),
        ({"prior_pause_s": -1.0}, r"prior_pause_s \(-1.0\) must be >= 0"),
    ],
)
def test_invalid_model_settings(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ThroughputModel(**kwargs)


@settings(max_examples=60, deadline=None)
@given(
    st.dictionaries(
        st.integers(1, 64),
        st.floats(1e-4, 1e4, allow_nan=False, allow_infinity=False),
        max_size=6,
    )
)
def test_any_observations_give_a_valid_curve(seen: dict[int, float]) -> None:
    model = ThroughputModel(batch=8)
    for w, t in seen.items():
        model.observe(w, t)
    curve = model.curve()
    for w in range(1, 65):
        t = curve.iteration_time(w)
        assert math.isfinite(t) and t > 0


# --- the tracker fed by progress polls ----------------------------------------------------------


def progress(
    iterations: int, at: float, *, world: int = 1, generation: int = 1
) -> job_pb2.JobProgress:
    p = job_pb2.JobProgress(
        completed_iterations=iterations, world_size=world, generation=generation
    )
    p.update_time.FromNanoseconds(round(at * 1e9))
    return p


def test_tracker_measures_iteration_times_between_polls() -> None:
    tracker = GoodputTracker()
    tracker.observe("j", 64, progress(0, 100.0, world=2), 100.5)
    tracker.observe("j", 64, progress(10, 105.0, world=2), 105.5)  # 0.5 s per iteration
    tracker.observe("j", 64, progress(10, 105.0, world=2), 106.5)  # no progress: nothing
    tracker.observe("j", 64, progress(30, 111.0, world=2), 111.2)  # 0.3 s per iteration
    model = tracker.model("j")
    assert model is not None
    assert model.observed() == pytest.approx({2: 0.4})


def test_tracker_measures_the_pause_of_a_rescale() -> None:
    tracker = GoodputTracker()
    for i in range(5):
        tracker.observe("j", 64, progress(10 * i, 100.0 + i, world=1), 100.0 + i)  # 0.1 s/it
    # Generation 2 with 2 learners: the first 5 iterations committed 8 s later.
    tracker.observe("j", 64, progress(45, 112.0, world=2, generation=2), 112.0)
    model = tracker.model("j")
    assert model is not None and model.pause_measured
    expected = 8.0 - 5 * model.curve().iteration_time(2)
    assert model.pause_s == pytest.approx(expected, rel=0.2)
    assert 7.0 < model.pause_s < 8.0
    assert model.observed() == pytest.approx({1: 0.1})  # the mixed interval is no observation


def test_tracker_starts_over_after_a_rewind() -> None:
    tracker = GoodputTracker()
    tracker.observe("j", 64, progress(50, 100.0), 100.0)
    tracker.observe("j", 64, progress(20, 130.0), 130.0)  # retried from a checkpoint
    tracker.observe("j", 64, progress(30, 131.0), 131.0)
    model = tracker.model("j")
    assert model is not None and model.observed() == pytest.approx({1: 0.1})


def test_tracker_integrates_attained_service() -> None:
    tracker = GoodputTracker()
    tracker.observe("j", 64, progress(0, 0.0, world=2), 0.0)
    tracker.observe("j", 64, progress(10, 10.0, world=4), 10.0)  # 2 devices for 10 s
    tracker.observe("j", 64, progress(20, 15.0, world=4), 15.0)  # 4 devices for 5 s
    _, service = tracker.demand("j")
    assert service == pytest.approx(40.0)


def test_annotate_fills_the_demands_and_forgets_ended_jobs() -> None:
    tracker = GoodputTracker()
    tracker.observe("a", 64, progress(0, 0.0), 0.0)
    tracker.observe("gone", 64, progress(0, 0.0), 0.0)
    demands = [
        JobDemand(job_id="a", priority=5000, submit_seq=1, max_workers=4),
        JobDemand(job_id="b", priority=5000, submit_seq=2, max_workers=4),
    ]
    a, b = tracker.annotate(demands)
    assert a.throughput is not None and b.throughput == PRIOR  # not polled yet: the prior
    assert tracker.model("gone") is None


def test_observe_job_sets_the_api_view() -> None:
    tracker = GoodputTracker()
    job = job_pb2.Job(job_id="j", spec=job_pb2.JobSpec(batch_size=64, max_workers=4))
    tracker.observe_job(job, progress(0, 0.0, world=2), 0.0)
    tracker.observe_job(job, progress(10, 5.0, world=2), 5.0)
    points = {p.world_size: p for p in job.throughput.points}
    assert sorted(points) == [1, 2, 3, 4]
    assert points[2].observed and not points[1].observed
    assert points[2].samples_per_second == pytest.approx(64 / 0.5)
    assert points[1].speedup == 1.0
    assert job.throughput.compute_seconds > 0
    assert job.throughput.rescale_pause_seconds == 10.0
    assert not job.throughput.rescale_pause_measured


def test_describe_bounds_the_points() -> None:
    model = ThroughputModel(batch=1)
    model.observe(1000, 1.0)
    out = describe(model, 100_000)
    assert len(out.points) == MAX_POINTS
    assert out.points[-1].world_size == 1000 and out.points[-1].observed


@settings(max_examples=200, deadline=None)
@given(
    st.floats(0.0, 10.0),
    st.floats(1e-3, 10.0),
    st.floats(0.0, 10.0),
    st.floats(0.0, 10.0) | st.just(5e-324),
    st.integers(1, 300),
)
def test_best_world_size_is_the_fastest(
    overhead: float, compute: float, sync: float, per: float, limit: int
) -> None:
    c = ThroughputCurve(overhead, compute, sync, per)
    brute = min(range(1, limit + 1), key=lambda w: (c.iteration_time(w), w))
    assert c.iteration_time(c.best_world_size(limit)) <= c.iteration_time(brute) * (1 + 1e-12)


# --- the learners' compute/sync split -------------------------------------------------------


def test_a_measured_split_tells_a_sync_bound_job_from_one_world_size() -> None:
    """Seen at 2 learners only, both jobs take 1 s per iteration; the time alone cannot tell
    them apart (the prior splits it). The learners' split can: 0.45 s compute per learner is
    a job whose compute halves again at 4; 0.05 s is sync-bound and gains almost nothing."""
    curves = {}
    for name, compute_s in (("compute-bound", 0.45), ("sync-bound", 0.05)):
        model = ThroughputModel(batch=64)
        for _ in range(10):
            model.observe(2, 1.0, compute_s=compute_s, sync_s=1.0 - compute_s)
        curves[name] = model.curve()
        assert model.split()[2] == pytest.approx((compute_s, 1.0 - compute_s))
        assert curves[name].iteration_time(2) == pytest.approx(1.0, rel=0.02)
        assert curves[name].compute == pytest.approx(2 * compute_s, rel=0.01)
    assert curves["compute-bound"].speedup(4) > 1.2
    assert curves["sync-bound"].speedup(4) < 1.05
    without = ThroughputModel(batch=64)
    for _ in range(10):
        without.observe(2, 1.0)
    # Without the split both would look the same (the prior's shape).
    assert curves["sync-bound"].speedup(4) < without.curve().speedup(4)


def test_a_split_that_is_nonsense_is_ignored_but_the_time_is_kept() -> None:
    model = ThroughputModel()
    model.observe(2, 1.0, compute_s=math.nan, sync_s=0.5)
    model.observe(2, 1.0, compute_s=0.5, sync_s=-1.0)
    model.observe(2, 1.0, compute_s=0.0, sync_s=0.5)  # 0: not reported
    assert model.observed() == {2: 1.0} and model.split() == {}
    model.observe(2, 1.0, compute_s=50.0, sync_s=0.0)  # longer than the iteration: cut
    assert model.split() == {2: (1.0, 0.0)}
    assert model.curve().compute == pytest.approx(2.0, rel=0.01)  # at most: all compute


def test_fit_with_compute_rows_recovers_a_curve_from_one_world_size_and_its_split() -> None:
    true = ThroughputCurve(overhead=0.0, compute=0.8, sync=0.2, sync_per_worker=0.0, batch=8)
    t = true.iteration_time(4)
    fitted = fit_curve([(4, t, 1.0), (1, true.iteration_time(1), 1.0)], compute=[(4, 0.2, t, 1.0)])
    assert fitted is not None
    assert fitted.compute == pytest.approx(0.8, rel=1e-6)
    assert fitted.iteration_time(4) == pytest.approx(t, rel=1e-6)


# --- the stored state ---------------------------------------------------------------------


def test_a_model_restored_from_its_state_predicts_the_same_and_goes_on_learning() -> None:
    model = ThroughputModel(batch=32)
    for w, t in ((1, 1.0), (2, 0.6), (4, 0.45)):
        for _ in range(7):
            model.observe(w, t, compute_s=1.0 / w * 0.8, sync_s=t - 0.8 / w)
    model.observe_pause(3.0)
    model.observe_pause(5.0)
    copy = ThroughputModel(batch=32)
    assert copy.restore(model.samples(), model.pause_state()) == 3
    assert copy.curve() == model.curve()
    assert copy.pause_s == model.pause_s == 4.0 and copy.pause_measured
    assert copy.split() == model.split()
    # The counts came back too: one more observation moves both alike.
    model.observe(2, 0.9)
    copy.observe(2, 0.9)
    assert copy.observed() == pytest.approx(model.observed())


def test_restore_skips_invalid_samples() -> None:
    model = ThroughputModel()
    taken = model.restore(
        [
            Sample(0, 1.0, 1),
            Sample(2, -1.0, 1),
            Sample(3, math.inf, 1),
            Sample(4, 1.0, 0),
            Sample(5, 1.0, 2, compute_s=math.nan, split_count=1),
            Sample(6, 0.5, 3),
            Sample(6, 9.0, 3),  # twice: the first counts
        ],
        (math.nan, 4),
    )
    assert taken == 1 and model.observed() == {6: 0.5}
    assert not model.pause_measured


def test_tracker_state_round_trips_through_protobuf_and_is_bounded() -> None:
    tracker = GoodputTracker()
    job = job_pb2.Job(job_id="j", spec=job_pb2.JobSpec(batch_size=64, max_workers=4))
    p = progress(0, 0.0, world=2)
    tracker.observe_job(job, p, 0.0)
    p = progress(10, 5.0, world=2)
    p.compute_seconds, p.sync_seconds = 0.3, 0.15
    tracker.observe_job(job, p, 5.0)
    state = tracker.state("j")
    assert state is not None and tracker.state("other") is None
    assert [(s.world_size, s.count, s.split_count) for s in state.samples] == [(2, 1, 1)]
    assert state.attained_device_seconds == pytest.approx(10.0)
    points = {q.world_size: q for q in job.throughput.points}
    assert (points[2].compute_seconds, points[2].sync_seconds) == (0.3, 0.15)  # shown
    other = GoodputTracker()
    other.restore("j", 64, job_pb2.ThroughputState.FromString(state.SerializeToString()))
    assert other.demand("j") == tracker.demand("j")
    assert other.describe("j", 4) == tracker.describe("j", 4)

    many = ThroughputModel()
    for w in range(1, 2 * MAX_POINTS + 1):
        for _ in range(1 + (w % 3)):
            many.observe(w, 1.0 / w + 0.01 * w)
    big = GoodputTracker()
    big.restore("m", 1, job_pb2.ThroughputState())
    big.model("m").restore(many.samples())  # type: ignore[union-attr]
    stored = big.state("m")
    assert stored is not None and len(stored.samples) == MAX_POINTS
    # The most observed kept: every world size seen 3 times, none seen once.
    kept = {s.world_size for s in stored.samples}
    assert {s.world_size for s in many.samples() if s.count == 3} <= kept
    assert min(s.count for s in stored.samples) == 2
    assert len(stored.SerializeToString()) < 4096
