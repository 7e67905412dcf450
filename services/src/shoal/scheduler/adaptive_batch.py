"""The opt-in adaptive batch: which global batch maximises a job's goodput at a world size.
Pure (no grpc, no I/O).

A job that sets ``JobSpec.adaptive_batch`` lets the scheduler pick its global batch ``B``
within ``[min_global_batch, max_global_batch]`` together with its world size ``w``; a job that
does not keeps its declared batch ``B0`` (``JobSpec.batch_size``) and with it the exact
equivalence to one process. The choice follows Pollux (Qiao et al., OSDI'21, section 3):

    GOODPUT(w, B) = THROUGHPUT(w, B) x EFFICIENCY(B)

* **Throughput** from the job's learned model (``shoal.scheduler.throughput``), fitted at the
  declared batch ``B0``: the part of an iteration that is divided among the learners
  (``compute``) is proportional to the samples per learner, so at batch ``B`` it is
  ``compute x B / B0``; the overhead and the gradient exchange do not depend on ``B`` (the
  gradient has the model's size whatever the batch):

      T(w, B) = overhead + compute x (B / B0) / w + [w > 1] (sync + sync_per_worker (w - 1))
      THROUGHPUT(w, B) = B / T(w, B)

  (Pollux's T_grad = alpha + beta x m per learner with m = B / w, and T_sync independent of m.)

* **Statistical efficiency**, the progress per sample at ``B`` relative to ``B0``, from the
  gradient noise scale ``phi`` (McCandlish et al. 2018, "An Empirical Model of Large-Batch
  Training"; Pollux eq. 5):

      EFFICIENCY(B) = (phi + B0) / (phi + B)

  A larger batch is worth its extra samples only while ``B`` is small against ``phi``. shoal
  does not measure ``phi`` yet (that needs the per-learner gradient variance; the AdaScale
  rule would too), so it uses a **prior** ``phi = B0``: the declared batch is taken as the
  job's critical batch (McCandlish et al.: training near ``B_crit ~ phi`` is where time and
  samples are best balanced), i.e. doubling the batch makes each sample worth 2/3. This is
  conservative: the batch grows only where the throughput gain beats that loss, which is where
  the exchange (``sync``) dominates an iteration.

With ``a = overhead + [w > 1] (sync + sync_per_worker (w - 1))`` and ``c = compute / (B0 w)``
(seconds per sample per learner), ``d/dB log GOODPUT = a / (B (a + c B)) - 1 / (phi + B)``
vanishes once, at

    B* = sqrt(a x phi / c)      (with the prior: B0 x sqrt(w x a / compute))

so goodput is unimodal in ``B``: the batch grows with the world size and with the share of an
iteration that does not shrink with more learners, and it shrinks below ``B0`` where compute
dominates (a job that must not go below its declared batch sets ``min_global_batch`` to it).

The scheduler does not pick ``B*`` itself but the best of a quarter-octave grid, the bounds,
``B0`` and the batches ``B0 x 2^(k/4)`` inside them (by unimodality, one of the two grid
points around ``B*``): the choice moves in whole steps, so noise in the fitted curve does not
change the batch at every poll, and the batch in use is kept unless the best one is predicted to
be ``MIN_GAIN`` (5%) better (hysteresis: the fit moves a little with every measurement). Ties
go to the batch closest to ``B0``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shoal.scheduler.throughput import ThroughputCurve
from shoal.v1 import job_pb2

__all__ = [
    "AdaptiveBounds",
    "choose_batch",
    "efficiency",
    "goodput",
    "iteration_time",
]

_GRID_STEPS_PER_OCTAVE = 4
MIN_GAIN = 0.05
"""The predicted goodput gain (a fraction) below which the batch in use is kept."""


@dataclass(frozen=True, slots=True)
class AdaptiveBounds:
    """A job's declared batch and the bounds it lets the scheduler pick in."""

    declared: int
    minimum: int
    maximum: int

    def __post_init__(self) -> None:
        if not 1 <= self.minimum <= self.declared <= self.maximum:
            raise ValueError(
                f"bounds (min {self.minimum}, declared {self.declared}, max {self.maximum}) "
                "must satisfy 1 <= min <= declared <= max"
            )

    @classmethod
    def of(cls, spec: job_pb2.JobSpec) -> AdaptiveBounds | None:
        """The bounds of a validated spec; None when it does not opt in."""
        if not spec.HasField("adaptive_batch"):
            return None
        ab = spec.adaptive_batch
        return cls(spec.batch_size, ab.min_global_batch, ab.max_global_batch)


def iteration_time(curve: ThroughputCurve, world_size: int, batch: int) -> float:
    """Seconds per iteration of a global batch of ``batch`` samples at ``world_size``
    learners, from ``curve`` (fitted at its own ``curve.batch``)."""
    if batch < 1:
        raise ValueError(f"batch ({batch}) must be >= 1")
    if world_size < 1:
        raise ValueError(f"world_size ({world_size}) must be >= 1")
    t = curve.overhead + curve.compute * (batch / curve.batch) / world_size
    if world_size > 1:
        t += curve.sync + curve.sync_per_worker * (world_size - 1)
    return t


def efficiency(batch: int, declared: int, noise_scale: float | None = None) -> float:
    """Progress per sample at ``batch`` relative to ``declared``: ``(phi + B0) / (phi + B)``,
    with the prior ``phi = B0`` when ``noise_scale`` is None."""
    phi = float(declared) if noise_scale is None else noise_scale
    if not (math.isfinite(phi) and phi >= 0):
        raise ValueError(f"noise_scale ({noise_scale}) must be a finite number >= 0")
    return (phi + declared) / (phi + batch)


def goodput(
    curve: ThroughputCurve,
    world_size: int,
    batch: int,
    declared: int,
    noise_scale: float | None = None,
) -> float:
    """Samples per second at ``(world_size, batch)``, weighted by their statistical
    efficiency relative to the declared batch: declared-batch-equivalent samples per second."""
    return (
        batch / iteration_time(curve, world_size, batch) * efficiency(batch, declared, noise_scale)
    )


def _candidates(bounds: AdaptiveBounds) -> list[int]:
    out = {bounds.minimum, bounds.maximum, bounds.declared}
    for direction in (1, -1):
        k = 1
        while True:
            b = round(bounds.declared * 2 ** (direction * k / _GRID_STEPS_PER_OCTAVE))
            if not bounds.minimum <= b <= bounds.maximum:
                break
            out.add(b)
            k += 1
    return sorted(out)


def choose_batch(
    curve: ThroughputCurve,
    world_size: int,
    bounds: AdaptiveBounds,
    noise_scale: float | None = None,
    *,
    current: int | None = None,
    min_gain: float = MIN_GAIN,
) -> int:
    """The global batch in ``bounds`` with the highest :func:`goodput` at ``world_size``
    (ties: the closest to the declared batch, then the smaller). With ``current`` (the batch
    in use, inside the bounds), that batch is kept unless the best one's predicted goodput is
    higher by more than ``min_gain`` (a fraction): noise in the fitted curve does not move the
    batch back and forth."""
    if curve.batch != bounds.declared:
        curve = ThroughputCurve(
            curve.overhead, curve.compute, curve.sync, curve.sync_per_worker, bounds.declared
        )

    def key(b: int) -> tuple[float, int, int]:
        g = goodput(curve, world_size, b, bounds.declared, noise_scale)
        # Round so that float noise does not break ties between equal goodputs.
        return (-round(g, 9), abs(b - bounds.declared), b)

    best = min(_candidates(bounds), key=key)
    if current is None or not bounds.minimum <= current <= bounds.maximum or best == current:
        return best
    now = goodput(curve, world_size, current, bounds.declared, noise_scale)
    then = goodput(curve, world_size, best, bounds.declared, noise_scale)
    return best if then > now * (1 + min_gain) else current
