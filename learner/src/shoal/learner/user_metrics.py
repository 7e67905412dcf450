"""The training script's own metrics: ``trainer.log({"name": value})``.

A value logged *during a step* (from the loss function or the model's forward, which run once
per micro-batch) is a mean over that micro-batch: it is weighted by the micro-batch's sample
count, so the learner's figure for the iteration is the sample-weighted mean over its share.
A value logged *between steps* (in a callback such as ``on_iteration_end``) belongs to the
next step and is weighted by that step's share. The coordinator then takes the sample-weighted
mean over the learners that logged the name, as it does for the loss: the job's value of an
iteration is what one process would compute over the whole global batch (for per-sample means;
a name logged by some learners only is the mean over their samples).

Names are 1-64 characters of ``[A-Za-z0-9_./-]``, at most :data:`MAX_NAMES` per iteration;
values are finite numbers (a one-element tensor is read with ``float``). Anything else is a
``ValueError`` naming the name and the value, and nothing is recorded. Names beginning with
``shoal.`` are shoal's own: the trainer adds ``shoal.compute_s`` (seconds of the learner's
compute of the iteration: data, forward, backward) and ``shoal.sync_s`` (seconds of its
previous gradient sync in the same generation) to what it reports (:func:`with_timings`), so
they travel and are averaged as the script's metrics are; the scheduler's throughput model
reads them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from shoal.contract import user_metrics as contract

__all__ = [
    "MAX_NAMES",
    "MetricLog",
    "StepMetrics",
    "means",
    "with_noise_estimate",
    "with_timings",
]

MAX_NAMES = contract.MAX_NAMES

#: One iteration's values of one learner: name -> (sum of value x samples, samples).
StepMetrics = dict[str, tuple[float, int]]


def means(metrics: Mapping[str, tuple[float, int]]) -> dict[str, float]:
    """The sample-weighted mean of each name."""
    if not metrics:  # (nothing logged: every iteration of most scripts)
        return {}
    return {name: total / count for name, (total, count) in sorted(metrics.items()) if count}


def with_timings(
    step: StepMetrics, n_samples: int, compute_s: float, sync_s: float | None
) -> StepMetrics:
    """``step`` with this learner's compute (and last sync) seconds added under shoal's
    names, weighted by its share's ``n_samples`` (a learner without samples, or a script
    that logs :data:`MAX_NAMES` names already, reports none: nothing the coordinator would
    refuse)."""
    names = [contract.COMPUTE_SECONDS] + ([contract.SYNC_SECONDS] if sync_s is not None else [])
    if n_samples <= 0 or len(step) + len(names) > MAX_NAMES:
        return step
    out = dict(step)
    for name, value in zip(names, (compute_s, sync_s), strict=False):
        if value is not None and math.isfinite(value) and value >= 0:
            out[name] = (value * n_samples, n_samples)
    return out


def with_noise_estimate(
    step: StepMetrics, n_samples: int, estimate: tuple[float, float]
) -> StepMetrics:
    """``step`` with one iteration's gradient-noise estimate ``(|G|^2, tr(S))`` of an
    adaptive-batch job (``shoal.contract.noise_scale``) under shoal's names, weighted by the
    share's ``n_samples``: the coordinator's sample-weighted mean over the learners is again
    an unbiased estimate. Left out when it does not fit or is not finite."""
    names = (contract.GNS_GRAD_SQ, contract.GNS_TRACE)
    if n_samples <= 0 or len(step) + len(names) > MAX_NAMES:
        return step
    if not all(math.isfinite(v) for v in estimate):
        return step
    out = dict(step)
    for name, value in zip(names, estimate, strict=True):
        out[name] = (value * n_samples, n_samples)
    return out


def _checked(values: Mapping[str, Any]) -> dict[str, float]:
    if not isinstance(values, Mapping):
        raise ValueError(f"trainer.log: values ({values!r}) must be a mapping of name to number")
    out: dict[str, float] = {}
    for name, value in values.items():
        if not isinstance(name, str) or not contract.NAME_PATTERN.fullmatch(name):
            raise ValueError(f"trainer.log: metric name ({name!r}) must be {contract.NAME_RULE}")
        if name.startswith(contract.RESERVED_PREFIX):
            raise ValueError(
                f"trainer.log: metric name ({name!r}) must not begin with "
                f"{contract.RESERVED_PREFIX!r} (shoal's own metrics)"
            )
        try:
            number = float(value)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(
                f"trainer.log: value of {name!r} ({value!r}) must be a number"
            ) from None
        if not math.isfinite(number):
            raise ValueError(f"trainer.log: value of {name!r} ({number}) must be finite")
        out[name] = number
    return out


class MetricLog:
    """What the script logged, collected per step (one per trainer)."""

    def __init__(self) -> None:
        self.chunk: int | None = None
        """Samples of the micro-batch being computed (set by ``compute_contribution``), or
        None between steps."""
        self._step: StepMetrics = {}
        self._pending: dict[str, float] = {}

    def log(self, values: Mapping[str, Any]) -> None:
        checked = _checked(values)
        known = set(self._step) | set(self._pending)
        if len(known | set(checked)) > MAX_NAMES:
            raise ValueError(
                f"trainer.log: {len(known | set(checked))} metric names in one iteration; "
                f"at most {MAX_NAMES}"
            )
        if self.chunk is None:
            self._pending.update(checked)  # between steps: the latest value goes to the next
            return
        m = self.chunk
        for name, value in checked.items():
            total, count = self._step.get(name, (0.0, 0))
            self._step[name] = (total + value * m, count + m)

    def begin_step(self) -> None:
        self._step = {}

    def end_step(self, n_samples: int) -> StepMetrics:
        """This step's values (the pending ones weighted by the share's ``n_samples``)."""
        step, self._step = self._step, {}
        if n_samples > 0:
            for name, value in self._pending.items():
                if name not in step:
                    step[name] = (value * n_samples, n_samples)
            self._pending = {}
        return step
