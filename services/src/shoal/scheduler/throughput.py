"""Per-job throughput model, learned online from the iteration times shoal measures. Pure.

The model (after Pollux, Qiao et al., OSDI'21, section 3.2: an iteration is compute time plus
synchronization time, fitted from the job's own observations), for a job whose global batch B
is fixed whatever its world size w (shoal's contract):

    T(w) = overhead + compute / w + [w > 1] * (sync + sync_per_worker * (w - 1))

seconds per iteration of the global batch. ``compute`` is the time one device needs for the
whole batch (compute per sample times B: each of w learners processes B / w samples);
``overhead`` is the per-iteration time that does not shrink with w (data loading, optimizer
step); ``sync`` and ``sync_per_worker`` are the gradient exchange, absent on one learner and
growing with the number of peers. Pollux overlaps compute and sync with a fitted exponent
gamma; shoal's learners exchange gradients after the backward pass, so the terms add (gamma =
1, Pollux's no-overlap case). Throughput is ``B / T(w)`` samples/s and the *speedup* of w
learners ``T(1) / T(w)``: the policy compares jobs by speedup, which does not depend on what a
sample of each job costs.

Learning (``ThroughputModel``): each observation is (world size, seconds per iteration); the
model keeps a running mean per world size (an exponential mean once 5 samples were seen, so it
follows drift) and fits the four non-negative parameters by relative least squares (each point
weighted by how often it was seen, at most 10), solved exactly by enumerating the active sets
of the non-negative least-squares problem (4 parameters: 16 small linear systems).

The prior: a *prior curve* (``PRIOR``: 5% overhead, 95% compute, a sync cost of 5% of the
one-learner iteration plus 1% per extra peer, so a speedup of 1.7 at 2 learners and 3.4 at 8),
scaled to agree with the observed time at the world size seen most, pulls each parameter
towards its value: the fit adds ``prior_weight * ((theta_k - prior_k) / s) ** 2`` (ridge
regression towards the prior; ``prior_weight`` 0.2, s the largest observed time). What the
observations cannot tell apart (with one world size seen, how compute splits from overhead and
what a sync costs) comes from the prior; what they can, from them. With no data at all the
model *is* the prior curve (its scale, 1 s per iteration at w = 1, is arbitrary and does not
change speedups).

The learners' split (``observe(..., compute_s=, sync_s=)``): the learners measure the seconds
each iteration spends computing (data, forward and backward of their share) and in the gradient
sync (JobProgress.compute_seconds / sync_seconds). Where a world size w has them, the fit gets
one more row per w, ``compute / w = compute_s(w)`` (relative to T(w), weighted like the time's
row), and the prior's compute becomes the measured one (``w * compute_s(w)`` at the world size
reported most; the prior's overhead and sync are scaled to the rest of the observed time): the
part of an iteration that divides among the learners is then measured rather than split off
by the prior, so a sync-bound job is known not to scale from the first world size it ran at.
The rest of the iteration (sync, overhead) is fitted from the iteration times as before. A
reported compute longer than the measured iteration is cut to it (the learners are not trusted
beyond what the coordinator measured; an inflated report can at most claim perfect scaling at
the sizes not yet seen, which the first measurement there corrects).

Rescale pauses (``observe_pause``): the seconds a job made no progress around a change of its
world size, a running mean, ``PRIOR_PAUSE_S`` before the first one.

State (``samples`` / ``restore``): the means with their counts, what the scheduler stores in
etcd so a new leader goes on from them (``shoal.scheduler.goodput``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations

__all__ = [
    "PRIOR",
    "PRIOR_PAUSE_S",
    "Sample",
    "ThroughputCurve",
    "ThroughputModel",
    "fit_curve",
]

PRIOR_PAUSE_S = 10.0
"""The rescale pause assumed before one was measured (seconds)."""
_MAX_POINT_WEIGHT = 10
_EWMA_AFTER = 5
_FIELDS = ("overhead", "compute", "sync", "sync_per_worker")


@dataclass(frozen=True, slots=True)
class ThroughputCurve:
    """The fitted iteration time of one job as a function of its world size.

    Attributes (seconds per iteration of the global batch; all >= 0, overhead + compute > 0):
        overhead: the part that does not shrink with more learners.
        compute: the part that is divided among the learners.
        sync: the gradient exchange's fixed cost, paid from 2 learners on.
        sync_per_worker: the exchange's cost per learner beyond the first.
        batch: the global batch (samples per iteration, >= 1).
    """

    overhead: float
    compute: float
    sync: float = 0.0
    sync_per_worker: float = 0.0
    batch: int = 1

    def __post_init__(self) -> None:
        for name in _FIELDS:
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} ({value}) must be a finite number >= 0")
        if self.overhead + self.compute <= 0:
            raise ValueError(f"overhead + compute ({self.overhead} + {self.compute}) must be > 0")
        if self.batch < 1:
            raise ValueError(f"batch ({self.batch}) must be >= 1")

    def iteration_time(self, world_size: int) -> float:
        """Seconds per iteration with ``world_size`` learners."""
        if world_size < 1:
            raise ValueError(f"world_size ({world_size}) must be >= 1")
        t = self.overhead + self.compute / world_size
        if world_size > 1:
            t += self.sync + self.sync_per_worker * (world_size - 1)
        return t

    def samples_per_second(self, world_size: int) -> float:
        return self.batch / self.iteration_time(world_size)

    def speedup(self, world_size: int) -> float:
        """Throughput with ``world_size`` learners over throughput with one."""
        return self.iteration_time(1) / self.iteration_time(world_size)

    def best_world_size(self, limit: int) -> int:
        """The world size in 1..limit with the highest throughput (the smallest on ties)."""
        if limit < 1:
            raise ValueError(f"limit ({limit}) must be >= 1")
        # T(w) for w >= 2 is convex with its minimum at sqrt(compute / sync_per_worker).
        candidates = {1, 2, limit}
        if self.sync_per_worker > 0 and self.compute < self.sync_per_worker * (limit + 1) ** 2:
            peak = math.sqrt(self.compute / self.sync_per_worker)  # < limit + 1: finite
            candidates |= {math.floor(peak), math.ceil(peak)}
        return min(
            (w for w in candidates if 1 <= w <= limit), key=lambda w: (self.iteration_time(w), w)
        )

    def scaled(self, factor: float) -> ThroughputCurve:
        return ThroughputCurve(
            self.overhead * factor,
            self.compute * factor,
            self.sync * factor,
            self.sync_per_worker * factor,
            self.batch,
        )


PRIOR = ThroughputCurve(overhead=0.05, compute=0.95, sync=0.05, sync_per_worker=0.01)
"""The prior curve's shape (1 s per iteration on one learner; only ratios matter)."""


def _features(w: int) -> tuple[float, float, float, float]:
    many = 1.0 if w > 1 else 0.0
    return (1.0, 1.0 / w, many, many * (w - 1))


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when (nearly) singular."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    return [m[i][n] / m[i][i] for i in range(n)]


def fit_curve(
    points: Sequence[tuple[int, float, float]],
    *,
    compute: Sequence[tuple[int, float, float, float]] = (),
    batch: int = 1,
    prior: ThroughputCurve | None = None,
    prior_weight: float = 0.0,
    scale: float = 1.0,
) -> ThroughputCurve | None:
    """Non-negative relative least squares of T(w) over (world size, seconds, weight) points.

    Minimises ``sum(weight * ((T(w) - t) / t) ** 2)`` plus, with a ``prior``,
    ``prior_weight * sum(((theta_k - prior_k) / scale) ** 2)`` over the four parameters
    theta >= 0, exactly (every active set; the best feasible one). ``compute`` adds
    ``weight * ((compute / w - c) / t) ** 2`` for each (world size, measured compute seconds c,
    iteration seconds t, weight). None when no curve fits (no usable point and no prior).
    """
    rows: list[tuple[tuple[float, ...], float]] = []
    for w, t, weight in points:
        if w < 1 or not (t > 0 and math.isfinite(t)) or weight <= 0:
            continue
        root = math.sqrt(weight)
        rows.append((tuple(f * root / t for f in _features(w)), root))
    for w, c, t, weight in compute:
        if w < 1 or not (c > 0 and math.isfinite(c) and t > 0 and math.isfinite(t)) or weight <= 0:
            continue
        root = math.sqrt(weight)
        rows.append(((0.0, root / (w * t), 0.0, 0.0), root * c / t))
    if prior is not None and prior_weight > 0 and scale > 0:
        root = math.sqrt(prior_weight) / scale
        for k, name in enumerate(_FIELDS):
            unit = tuple(root if i == k else 0.0 for i in range(4))
            rows.append((unit, root * getattr(prior, name)))
    if not rows:
        return None
    best: tuple[float, list[float]] | None = None
    for size in range(1, 5):
        for active in combinations(range(4), size):
            if 0 not in active and 1 not in active:
                continue  # overhead + compute must be > 0
            ata = [[sum(r[i] * r[j] for r, _ in rows) for j in active] for i in active]
            atb = [sum(r[i] * y for r, y in rows) for i in active]
            sol = _solve(ata, atb)
            if sol is None or any(x < 0 for x in sol):
                continue
            theta = [0.0] * 4
            for k, x in zip(active, sol, strict=True):
                theta[k] = x
            if theta[0] + theta[1] <= 0:
                continue
            err = sum((sum(f * x for f, x in zip(r, theta, strict=True)) - y) ** 2 for r, y in rows)
            if best is None or err < best[0] - 1e-15:
                best = (err, theta)
    if best is None:
        return None
    theta_overhead, theta_compute, theta_sync, theta_per = best[1]
    return ThroughputCurve(theta_overhead, theta_compute, theta_sync, theta_per, batch=batch)


@dataclass
class _Mean:
    seconds: float
    count: int = 1

    def add(self, seconds: float) -> None:
        self.count += 1
        alpha = 1.0 / min(self.count, _EWMA_AFTER)
        self.seconds += alpha * (seconds - self.seconds)


@dataclass(frozen=True, slots=True)
class Sample:
    """One world size's running means, as stored (``ThroughputModel.samples``/``restore``).

    Attributes:
        world_size: the number of learners (>= 1).
        seconds: mean seconds per iteration (> 0); ``count`` observations (>= 1).
        compute_s / sync_s: the learners' mean compute and sync seconds per iteration over
            ``split_count`` observations (0: none reported).
    """

    world_size: int
    seconds: float
    count: int
    compute_s: float = 0.0
    sync_s: float = 0.0
    split_count: int = 0

    def valid(self) -> bool:
        finite = all(math.isfinite(x) for x in (self.seconds, self.compute_s, self.sync_s))
        return (
            finite
            and self.world_size >= 1
            and self.seconds > 0
            and self.count >= 1
            and self.split_count >= 0
            and self.compute_s >= 0
            and self.sync_s >= 0
        )


@dataclass
class ThroughputModel:
    """One job's online throughput model (mutable; no I/O). See the module docstring."""

    batch: int = 1
    prior: ThroughputCurve = PRIOR
    prior_weight: float = 0.2
    prior_pause_s: float = PRIOR_PAUSE_S
    _points: dict[int, _Mean] = field(default_factory=dict)
    _split: dict[int, tuple[_Mean, _Mean]] = field(default_factory=dict)
    _pause: _Mean | None = None
    _curve: ThroughputCurve | None = None

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise ValueError(f"batch ({self.batch}) must be >= 1")
        if not (self.prior_weight > 0 and math.isfinite(self.prior_weight)):
            raise ValueError(f"prior_weight ({self.prior_weight}) must be > 0")
        if not (self.prior_pause_s >= 0 and math.isfinite(self.prior_pause_s)):
            raise ValueError(f"prior_pause_s ({self.prior_pause_s}) must be >= 0")

    def observe(
        self,
        world_size: int,
        seconds_per_iteration: float,
        *,
        compute_s: float = 0.0,
        sync_s: float = 0.0,
    ) -> None:
        """One measured iteration time at ``world_size``, with the learners' compute/sync
        split when they reported one (``compute_s`` > 0); nonsense values are ignored."""
        if world_size < 1 or not (
            seconds_per_iteration > 0 and math.isfinite(seconds_per_iteration)
        ):
            return
        mean = self._points.get(world_size)
        if mean is None:
            self._points[world_size] = _Mean(seconds_per_iteration)
        else:
            mean.add(seconds_per_iteration)
        if compute_s > 0 and math.isfinite(compute_s) and sync_s >= 0 and math.isfinite(sync_s):
            # What the learners say is bounded by what the coordinator measured: a learner
            # cannot compute longer than its iteration took (a noisy or inflated report would
            # claim the job scales better than it can).
            compute_s = min(compute_s, seconds_per_iteration)
            split = self._split.get(world_size)
            if split is None:
                self._split[world_size] = (_Mean(compute_s), _Mean(sync_s))
            else:
                split[0].add(compute_s)
                split[1].add(sync_s)
        self._curve = None

    def samples(self) -> list[Sample]:
        """The running means with their counts (what ``restore`` takes back), by world size."""
        out = []
        for w, m in sorted(self._points.items()):
            split = self._split.get(w)
            if split is None:
                out.append(Sample(w, m.seconds, m.count))
            else:
                out.append(
                    Sample(
                        w, m.seconds, m.count, split[0].seconds, split[1].seconds, split[0].count
                    )
                )
        return out

    def pause_state(self) -> tuple[float, int]:
        """(mean rescale pause, how many were measured; 0: none)."""
        return (0.0, 0) if self._pause is None else (self._pause.seconds, self._pause.count)

    def restore(self, samples: Sequence[Sample], pause: tuple[float, int] = (0.0, 0)) -> int:
        """Replace what was learned with stored ``samples`` and ``pause`` (from ``samples``
        and ``pause_state`` of an earlier model). Invalid entries (and a world size given
        twice: the first counts) are skipped; returns how many samples were taken."""
        self._points, self._split, self._pause, self._curve = {}, {}, None, None
        for sample in samples:
            if not sample.valid() or sample.world_size in self._points:
                continue
            self._points[sample.world_size] = _Mean(sample.seconds, sample.count)
            if sample.split_count > 0 and sample.compute_s > 0:
                self._split[sample.world_size] = (
                    _Mean(sample.compute_s, sample.split_count),
                    _Mean(sample.sync_s, sample.split_count),
                )
        seconds, count = pause
        if count >= 1 and seconds >= 0 and math.isfinite(seconds):
            self._pause = _Mean(seconds, count)
        return len(self._points)

    def observe_pause(self, seconds: float) -> None:
        """One measured rescale pause (seconds without progress around a rescale)."""
        if not (seconds >= 0 and math.isfinite(seconds)):
            return
        if self._pause is None:
            self._pause = _Mean(seconds)
        else:
            self._pause.add(seconds)

    @property
    def pause_s(self) -> float:
        """The expected pause of a rescale (measured mean, else the prior)."""
        return self.prior_pause_s if self._pause is None else self._pause.seconds

    @property
    def pause_measured(self) -> bool:
        return self._pause is not None

    def observed(self) -> Mapping[int, float]:
        """Mean seconds per iteration at each world size seen."""
        return {w: m.seconds for w, m in sorted(self._points.items())}

    def split(self) -> Mapping[int, tuple[float, float]]:
        """The learners' mean (compute, sync) seconds per iteration at each world size they
        reported them for."""
        return {w: (c.seconds, s.seconds) for w, (c, s) in sorted(self._split.items())}

    def curve(self) -> ThroughputCurve:
        """The fitted curve (the prior, scaled, where data is missing); cached until new data."""
        if self._curve is None:
            self._curve = self._fit()
        return self._curve

    def _fit(self) -> ThroughputCurve:
        prior = ThroughputCurve(
            self.prior.overhead,
            self.prior.compute,
            self.prior.sync,
            self.prior.sync_per_worker,
            self.batch,
        )
        if not self._points:
            return prior
        anchor_w, anchor = max(self._points.items(), key=lambda kv: (kv[1].count, -kv[0]))
        prior = prior.scaled(anchor.seconds / prior.iteration_time(anchor_w))
        if self._split:
            # A measured split replaces the prior's: its compute is the learners' (at the
            # world size they reported most), the rest of the anchor's time keeps the prior's
            # proportions of overhead and sync.
            split_w, (c, _) = max(self._split.items(), key=lambda kv: (kv[1][0].count, -kv[0]))
            measured = c.seconds * split_w
            rest = prior.iteration_time(anchor_w) - prior.compute / anchor_w
            ratio = max(0.0, anchor.seconds - measured / anchor_w) / rest if rest > 0 else 0.0
            prior = ThroughputCurve(
                prior.overhead * ratio,
                measured,
                prior.sync * ratio,
                prior.sync_per_worker * ratio,
                self.batch,
            )
        points = [
            (w, m.seconds, float(min(m.count, _MAX_POINT_WEIGHT))) for w, m in self._points.items()
        ]
        compute = [
            (w, c.seconds, self._points[w].seconds, float(min(c.count, _MAX_POINT_WEIGHT)))
            for w, (c, _) in self._split.items()
            if w in self._points
        ]
        scale = max(m.seconds for m in self._points.values())
        fitted = fit_curve(
            points,
            compute=compute,
            batch=self.batch,
            prior=prior,
            prior_weight=self.prior_weight,
            scale=scale,
        )
        return fitted or prior
