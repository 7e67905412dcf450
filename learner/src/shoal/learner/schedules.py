"""Learning-rate schedules by name, as functions of the global step (or epoch).

The trainer evaluates a schedule on every learner at every iteration, so it must be a pure
function of the step: these are. Give one to the trainer by name, and it fills in the job's
length and the optimizer's ``lr``::

    ElasticTrainer(..., ("AdamW", {"lr": 3e-4}), lr_schedule=("warmup_cosine", {"warmup": 100}))
    ElasticTrainer(..., ("SGD", {"lr": 0.1}), lr_schedule=("step", {"step_size": 30}),
                   lr_schedule_unit="epoch")

or build the function yourself (``warmup_cosine(3e-4, 100, 10_000)``) and pass it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["SCHEDULES", "resolve_schedule", "step_decay", "warmup_cosine"]


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"lr schedule {name} ({value!r}) must be an int >= {low}")
    return value


def _check_float(name: str, value: Any, low: float) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < low
    ):
        raise ValueError(f"lr schedule {name} ({value!r}) must be a finite number >= {low}")
    return float(value)


def warmup_cosine(
    base_lr: float, warmup: int, total: int, min_lr: float = 0.0
) -> Callable[[int], float]:
    """Linear warmup from ``base_lr / warmup`` to ``base_lr`` over the first ``warmup`` steps,
    then cosine decay to ``min_lr`` at step ``total``."""
    base_lr = _check_float("base_lr", base_lr, 0.0)
    warmup = _check_int("warmup", warmup, 0)
    total = _check_int("total", total, 1)
    min_lr = _check_float("min_lr", min_lr, 0.0)

    def schedule(step: int) -> float:
        if step < warmup:
            return base_lr * (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_lr + (base_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return schedule


def step_decay(base_lr: float, step_size: int, gamma: float = 0.1) -> Callable[[int], float]:
    """``base_lr * gamma ** (step // step_size)`` (``torch.optim.lr_scheduler.StepLR``)."""
    base_lr = _check_float("base_lr", base_lr, 0.0)
    step_size = _check_int("step_size", step_size, 1)
    gamma = _check_float("gamma", gamma, 0.0)
    return lambda step: base_lr * gamma ** (step // step_size)


#: Schedules by name: each builds a ``step -> lr`` function.
SCHEDULES: dict[str, Callable[..., Callable[[int], float]]] = {
    "warmup_cosine": warmup_cosine,
    "step": step_decay,
}


def resolve_schedule(
    spec: str | tuple[str, Mapping[str, Any]], *, base_lr: float | None, total: int
) -> Callable[[int], float]:
    """The schedule ``spec`` names (``"name"`` or ``("name", {kwargs})``) for a job of
    ``total`` steps (epochs with ``lr_schedule_unit="epoch"``) and the optimizer's ``lr``."""
    name, kwargs = (spec, {}) if isinstance(spec, str) else spec
    if name not in SCHEDULES:
        raise ValueError(f"lr_schedule ({name!r}) is not one of {sorted(SCHEDULES)}")
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"lr_schedule arguments ({kwargs!r}) must be a mapping")
    args = dict(kwargs)
    if "base_lr" not in args:
        if base_lr is None:
            raise ValueError(
                f"lr_schedule {name!r} needs the optimizer's lr: give the optimizer an 'lr' "
                "or the schedule a 'base_lr'"
            )
        args["base_lr"] = base_lr
    if name == "warmup_cosine":
        args.setdefault("total", total)
    try:
        return SCHEDULES[name](**args)
    except TypeError as exc:
        raise ValueError(f"lr_schedule {name!r} rejected its arguments {args!r}: {exc}") from exc
