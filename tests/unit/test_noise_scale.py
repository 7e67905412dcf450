"""The measured gradient noise scale of an adaptive-batch job and the ADASCALE rule: the
estimator on synthetic gradients of known noise, AdaScale's gain, the coordinator's report and
frozen value, the scheduler's use of it, and the learner's estimate and learning rate."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from shoal.contract.batch_schedule import BatchRule, scaled_learning_rate
from shoal.contract.noise_scale import (
    MIN_SAMPLES,
    NoiseScaleEstimate,
    adascale_gain,
    two_batch_estimate,
)
from shoal.param_sync.servicer_common import _progress_proto
from shoal.scheduler.adaptive_batch import AdaptiveBounds, choose_batch
from shoal.scheduler.goodput import measured_noise_scale
from shoal.scheduler.throughput import ThroughputCurve
from shoal.v1 import job_pb2

# -- the estimator ------------------------------------------------------------------------------


def simulate(
    phi_true: float, shares: list[int], iterations: int, seed: int = 0, dim: int = 64
) -> NoiseScaleEstimate:
    """Per-sample gradients G + noise (covariance sigma^2 I, so tr(S) = dim sigma^2 and
    phi = tr(S) / |G|^2); each learner's estimate from its share's mean and the global mean,
    sample-weighted over the learners as the coordinator averages them."""
    rng = np.random.default_rng(seed)
    grad = rng.normal(size=dim)
    sigma = math.sqrt(phi_true * float(grad @ grad) / dim)
    big = sum(shares)
    est = NoiseScaleEstimate()
    for _ in range(iterations):
        samples = grad + sigma * rng.normal(size=(big, dim))
        means, at = [], 0
        for b in shares:
            means.append(samples[at : at + b].mean(axis=0))
            at += b
        g_big = samples.mean(axis=0)
        rows = [
            two_batch_estimate(b, float(m @ m), big, float(g_big @ g_big))
            for b, m in zip(shares, means, strict=True)
        ]
        assert all(r is not None for r in rows)
        g2 = sum(b * r[0] for b, r in zip(shares, rows, strict=True)) / big  # type: ignore[index]
        tr = sum(b * r[1] for b, r in zip(shares, rows, strict=True)) / big  # type: ignore[index]
        est.add(g2, tr)
    return est


@pytest.mark.parametrize(
    ("phi_true", "shares"),
    [(32.0, [16, 16]), (400.0, [32, 32, 32, 32]), (100.0, [10, 30, 24])],
)
def test_the_estimator_converges_to_the_known_noise_scale(
    phi_true: float, shares: list[int]
) -> None:
    est = simulate(phi_true, shares, iterations=400)
    assert est.count == 400
    assert est.phi == pytest.approx(phi_true, rel=0.3)


def test_the_one_iteration_estimates_are_unbiased() -> None:
    # Averaged over many iterations (a running mean: no EMA), both are close to the truth.
    rng = np.random.default_rng(3)
    dim, b, big = 32, 8, 32
    grad = rng.normal(size=dim)
    sigma = 0.5
    g2s, trs = [], []
    for _ in range(4000):
        samples = grad + sigma * rng.normal(size=(big, dim))
        small, full = samples[:b].mean(axis=0), samples.mean(axis=0)
        g2, tr = two_batch_estimate(b, float(small @ small), big, float(full @ full))  # type: ignore[misc]
        g2s.append(g2)
        trs.append(tr)
    assert np.mean(g2s) == pytest.approx(float(grad @ grad), rel=0.03)
    assert np.mean(trs) == pytest.approx(dim * sigma**2, rel=0.05)


def test_two_batch_estimate_refuses_equal_batches_and_nonsense() -> None:
    assert two_batch_estimate(8, 1.0, 8, 0.5) is None  # one learner: nothing to compare
    assert two_batch_estimate(0, 1.0, 8, 0.5) is None
    assert two_batch_estimate(4, math.nan, 8, 0.5) is None
    assert two_batch_estimate(4, 1.0, 8, -1.0) is None


def test_phi_is_none_before_data_or_without_signal_and_ready_waits_for_samples() -> None:
    est = NoiseScaleEstimate()
    assert est.phi is None and est.ready() is None
    est.add(-1.0, 5.0)  # all noise so far: no finite phi
    assert est.phi is None
    est.add(math.inf, 1.0)  # ignored
    assert est.count == 1
    for _ in range(MIN_SAMPLES):
        est.add(3.0, 30.0)
    assert est.ready() is not None and est.ready() == est.phi
    fresh = NoiseScaleEstimate()
    for _ in range(MIN_SAMPLES - 1):
        fresh.add(1.0, 10.0)
    assert fresh.phi == pytest.approx(10.0) and fresh.ready() is None


# -- AdaScale's gain ------------------------------------------------------------------------------


def test_the_adascale_gain_is_johnson_et_al_formula() -> None:
    b0 = 32
    for mu2, tr in [(1.0, 10.0), (2.0, 400.0), (5.0, 0.0), (0.3, 1000.0)]:
        phi = tr / mu2
        sigma2 = tr / b0  # the gradient variance at the declared batch
        for batch in (16, 32, 64, 256):
            s = batch / b0
            expected = (sigma2 + mu2) / (sigma2 / s + mu2)
            assert adascale_gain(phi, batch, b0) == pytest.approx(expected)
    assert adascale_gain(50.0, 32, 32) == pytest.approx(1.0)  # S = 1
    assert adascale_gain(0.0, 256, 32) == pytest.approx(1.0)  # no noise: no faster
    assert adascale_gain(1e12, 256, 32) == pytest.approx(8.0)  # all noise: linear scaling
    assert adascale_gain(None, 256, 32) == 1.0  # not measured: the declared rate
    with pytest.raises(ValueError, match="phi"):
        adascale_gain(-1.0, 64, 32)
    with pytest.raises(ValueError, match="batch"):
        adascale_gain(1.0, 0, 32)


def test_the_adascale_rule_scales_the_learning_rate_by_the_gain() -> None:
    assert scaled_learning_rate(0.1, 128, 32, BatchRule.ADASCALE) == pytest.approx(0.1)
    lr = scaled_learning_rate(0.1, 128, 32, BatchRule.ADASCALE, noise_scale=96.0)
    assert lr == pytest.approx(0.1 * 4 * (96 + 32) / (96 + 128))  # 0.2286
    assert BatchRule("adascale") is BatchRule.ADASCALE


# -- the scheduler ------------------------------------------------------------------------------

SYNC_BOUND = ThroughputCurve(overhead=0.01, compute=0.05, sync=0.2, sync_per_worker=0.0, batch=64)


def test_the_scheduler_prefers_a_larger_batch_when_the_noise_scale_is_large() -> None:
    bounds = AdaptiveBounds(64, 16, 4096)
    with_prior = choose_batch(SYNC_BOUND, 4, bounds)
    small_noise = choose_batch(SYNC_BOUND, 4, bounds, noise_scale=16.0)
    large_noise = choose_batch(SYNC_BOUND, 4, bounds, noise_scale=4096.0)
    assert small_noise < with_prior < large_noise
    assert large_noise >= 4 * with_prior


def test_the_scheduler_takes_the_measured_noise_scale_only_after_enough_iterations() -> None:
    progress = job_pb2.JobProgress(gradient_noise_scale=500.0, gradient_noise_samples=3)
    assert measured_noise_scale(progress) is None  # too few: the prior
    progress.gradient_noise_samples = MIN_SAMPLES
    assert measured_noise_scale(progress) == 500.0
    progress.gradient_noise_scale = 0.0  # not measured
    assert measured_noise_scale(progress) is None


# -- the coordinator -----------------------------------------------------------------------------


def test_the_coordinator_reports_the_noise_scale_and_freezes_it_for_each_iteration() -> None:
    from shoal.contract import user_metrics
    from tests.unit.test_adaptive_batch import adaptive_coordinator
    from tests.unit.test_coordinator import finish_iteration

    coord = adaptive_coordinator(n=1000, batch=4, lo=2, hi=8, epochs=1, every=0)
    coord.join("a")
    coord.join("b")
    assert coord.progress()["gradient_noise_scale"] == 0.0
    for k in range(MIN_SAMPLES + 1):
        decisions = {m: coord.decide(m) for m in ("a", "b")}
        phis = {d.assignment.gradient_noise_scale for d in decisions.values()}
        assert len(phis) == 1  # every member of the iteration gets the same value
        expected = 0.0 if k < MIN_SAMPLES else pytest.approx(25.0)
        assert phis.pop() == expected
        finish_iteration(coord)
        g = coord.generation
        for m, (g2, tr) in (("a", (1.0, 10.0)), ("b", (3.0, 90.0))):
            coord.report(
                m,
                g,
                k,
                1.0,
                2,
                {user_metrics.GNS_GRAD_SQ: (g2 * 2, 2), user_metrics.GNS_TRACE: (tr * 2, 2)},
            )
    progress = coord.progress()
    # The sample-weighted means: |G|^2 2, tr 50 -> phi 25, averaged over every iteration.
    assert progress["gradient_noise_samples"] == MIN_SAMPLES + 1
    assert progress["gradient_noise_scale"] == pytest.approx(25.0)
    message = _progress_proto(progress)
    assert message.gradient_noise_scale == pytest.approx(25.0)
    assert message.gradient_noise_samples == MIN_SAMPLES + 1


# -- the learner ------------------------------------------------------------------------------


def test_the_learner_reports_its_estimate_under_shoals_names() -> None:
    from shoal.contract import user_metrics
    from shoal.learner.user_metrics import with_noise_estimate

    out = with_noise_estimate({"acc": (3.0, 4)}, 4, (2.0, -5.0))
    assert out[user_metrics.GNS_GRAD_SQ] == (8.0, 4)
    assert out[user_metrics.GNS_TRACE] == (-20.0, 4)
    assert with_noise_estimate({}, 0, (2.0, 5.0)) == {}
    assert with_noise_estimate({}, 4, (math.nan, 5.0)) == {}


def test_measure_grad_norm_computes_the_norm_without_clipping() -> None:
    from shoal.learner.gradients import apply_gradient_policy
    from shoal.learner.sync_types import OptimizerSpec, TrainingPlan, TrainingSetup

    def setup(**kw: object) -> TrainingSetup:
        return TrainingSetup(
            plan=TrainingPlan(epochs=1, batch_size=4, num_samples=8),
            optimizer=OptimizerSpec("SGD", {"lr": 0.1}),
            param_specs=(),
            buffer_specs=(),
            params=[],
            buffers=[],
            **kw,  # type: ignore[arg-type]
        )

    grads = [torch.tensor([3.0, 4.0])]
    assert apply_gradient_policy(grads, setup()) == (None, False)
    norm, skipped = apply_gradient_policy(grads, setup(measure_grad_norm=True))
    assert norm == pytest.approx(5.0) and not skipped
    assert grads[0].tolist() == [3.0, 4.0]  # left alone


def test_the_learner_scales_its_rate_by_the_gain_of_the_assignments_noise_scale() -> None:
    from torch import nn

    from shoal.learner.sync_types import Assignment
    from shoal.learner.trainer import ElasticTrainer

    trainer = ElasticTrainer(
        nn.Linear(1, 1), lambda: (None, None), nn.MSELoss(), ("SGD", {"lr": 0.1})
    )
    trainer._batch_rule, trainer._declared_batch = BatchRule.ADASCALE, 4

    def assignment(batch: int, phi: float) -> Assignment:
        return Assignment(1, 0, 0, 1, 0, 2, 0, batch, global_batch=batch, gradient_noise_scale=phi)

    assert trainer._lr(assignment(16, 0.0)) == pytest.approx(0.1)  # not measured: r = 1
    assert trainer._lr(assignment(16, 12.0)) == pytest.approx(0.1 * 4 * 16 / 28)
    assert trainer._lr(assignment(4, 12.0)) == pytest.approx(0.1)  # at B0: B0's rate
