"""The gradient noise scale of an adaptive-batch job, measured online, and the AdaScale gain.

Imports neither grpc nor torch: the learner computes one estimate per iteration, the
coordinator smooths them, the scheduler reads the result.

**Estimator** (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training",
appendix A.1; Pollux, Qiao et al. OSDI'21, section 3.1). The mean gradient ``g_b`` of ``b``
independent samples has ``E|g_b|^2 = |G|^2 + tr(S)/b`` (``G`` the true gradient, ``S`` the
per-sample covariance). A learner's share (``b`` samples, its local mean gradient) and the
job's aggregated gradient of the same iteration (``B > b`` samples) give unbiased estimates

    |G|^2  ~  (B |g_B|^2 - b |g_b|^2) / (B - b)
    tr(S)  ~  (|g_b|^2 - |g_B|^2) / (1/b - 1/B)

each very noisy on its own; both are smoothed separately (:class:`NoiseScaleEstimate`, an
exponential moving average) and the *simple noise scale* is the ratio of the smoothed values,
``phi = tr(S) / |G|^2`` (the ratio of the means, not the mean of the ratios, as McCandlish
et al. advise). ``phi`` is in samples: the batch at which a step's gradient noise equals its
signal, near the critical batch.

**AdaScale gain** (Johnson et al. 2020, "AdaScale SGD", eq. 3): at ``S = B / B0`` times the
declared batch, with the gradient variance at the declared batch ``sigma^2 = tr(S) / B0`` and
``mu^2 = |G|^2``, ``r = (sigma^2 + mu^2) / (sigma^2 / S + mu^2)``; in terms of ``phi``
that is ``r = S (phi + B0) / (phi + B)`` = ``S`` x Pollux's statistical efficiency, between 1
(all signal: no faster than B0) and ``S`` (all noise: linear scaling).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "EMA_WEIGHT",
    "MIN_SAMPLES",
    "NoiseScaleEstimate",
    "adascale_gain",
    "two_batch_estimate",
]

#: The weight of each new estimate in the moving averages (after a running mean of the first
#: ``1 / EMA_WEIGHT`` ones): about the last 20 iterations count.
EMA_WEIGHT = 0.05
#: Estimates (iterations) before the measured ``phi`` replaces the prior in the scheduler.
MIN_SAMPLES = 10


def two_batch_estimate(
    small_batch: int, small_sq: float, big_batch: int, big_sq: float
) -> tuple[float, float] | None:
    """Unbiased one-iteration estimates ``(|G|^2, tr(S))`` from the squared norm ``small_sq``
    of a mean gradient over ``small_batch`` samples and ``big_sq`` of one over ``big_batch``
    samples of the same iteration that include them; None when the batches do not differ
    (``small_batch >= big_batch``) or a value is not finite."""
    if not (0 < small_batch < big_batch):
        return None
    if not all(math.isfinite(x) and x >= 0 for x in (small_sq, big_sq)):
        return None
    b, big = float(small_batch), float(big_batch)
    grad_sq = (big * big_sq - b * small_sq) / (big - b)
    trace = (small_sq - big_sq) / (1.0 / b - 1.0 / big)
    return grad_sq, trace


@dataclass
class NoiseScaleEstimate:
    """Smoothed ``|G|^2`` and ``tr(S)`` estimates; ``phi`` their ratio."""

    grad_sq: float = 0.0
    trace: float = 0.0
    count: int = 0

    def add(self, grad_sq: float, trace: float) -> None:
        """One iteration's estimates (non-finite ones are ignored)."""
        if not (math.isfinite(grad_sq) and math.isfinite(trace)):
            return
        self.count += 1
        w = max(1.0 / self.count, EMA_WEIGHT)
        self.grad_sq += (grad_sq - self.grad_sq) * w
        self.trace += (trace - self.trace) * w

    @property
    def phi(self) -> float | None:
        """``tr(S) / |G|^2`` in samples (clamped at 0), or None before any estimate or while
        the smoothed ``|G|^2`` is not positive (all noise so far: no finite value)."""
        if self.count == 0 or self.grad_sq <= 0:
            return None
        return max(self.trace, 0.0) / self.grad_sq

    def ready(self, min_samples: int = MIN_SAMPLES) -> float | None:
        """``phi`` once ``min_samples`` estimates were averaged, else None."""
        return self.phi if self.count >= min_samples else None


def adascale_gain(phi: float | None, batch: int, declared: int) -> float:
    """AdaScale's gain ``r = S (phi + B0) / (phi + B)`` with ``S = B / B0``; 1 when ``phi`` is
    unknown (None), so the learning rate stays the declared one until it is measured."""
    if batch < 1 or declared < 1:
        raise ValueError(f"batch ({batch}) and declared ({declared}) must be >= 1")
    if phi is None:
        return 1.0
    if not (math.isfinite(phi) and phi >= 0):
        raise ValueError(f"phi ({phi}) must be a finite number >= 0")
    scale = batch / declared
    return scale * (phi + declared) / (phi + batch)
