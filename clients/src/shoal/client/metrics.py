"""A job's metrics as rows and series: what `shoal jobs metrics`, `shoal jobs tensorboard` and
the dashboard show, from GetJobMetrics.

Generic on purpose: every numeric field of ``IterationMetric`` that is not one of its
coordinates (epoch, iteration, generation, world size, samples) is a metric, and so is every
entry of any ``map<string, double>`` field (``EpochMetric.values`` today, metrics a training
script logs tomorrow). A metric the API starts returning shows up everywhere without a change
here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from shoal.v1 import job_pb2

__all__ = [
    "EPOCH_COORDINATES",
    "ITERATION_COORDINATES",
    "epoch_rows",
    "finite",
    "global_iteration",
    "iteration_rows",
    "metric_values",
    "seconds",
]

# Fields that say where a record is, not how training went.
ITERATION_COORDINATES = frozenset({"epoch", "iteration", "generation", "world_size", "samples"})
EPOCH_COORDINATES = frozenset({"epoch"})
_NUMERIC = {
    FieldDescriptor.TYPE_DOUBLE,
    FieldDescriptor.TYPE_FLOAT,
    FieldDescriptor.TYPE_INT32,
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT32,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT32,
    FieldDescriptor.TYPE_SINT64,
}


def seconds(ts: Any) -> float:
    """A protobuf Timestamp as unix seconds (0.0 when unset)."""
    return float(ts.seconds) + ts.nanos / 1e9


def finite(value: float) -> float | None:
    """NaN and infinities become None (JSON has none of them; charts draw a gap)."""
    return float(value) if math.isfinite(value) else None


def _repeated(field: Any) -> bool:
    flag = getattr(field, "is_repeated", None)  # protobuf >= 5.28; the label before
    if flag is not None:
        return bool(flag)
    return bool(field.label == FieldDescriptor.LABEL_REPEATED)


def metric_values(message: Message, skip: Iterable[str] = ()) -> dict[str, float | None]:
    """Every numeric scalar field (but those in ``skip``) and every string -> number map entry
    of ``message``, by name: the metrics it carries."""
    skipped = frozenset(skip)
    out: dict[str, float | None] = {}
    for field in message.DESCRIPTOR.fields:
        if field.name in skipped:
            continue
        value = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            if field.message_type.fields_by_name["value"].type in _NUMERIC:
                for key in sorted(value):
                    # A script's metric named like a field ("loss") keeps both: "values.loss".
                    name = str(key) if str(key) not in out else f"{field.name}.{key}"
                    out[name] = finite(float(value[key]))
        elif field.type in _NUMERIC and not _repeated(field):
            out[field.name] = finite(float(value))
    return out


def global_iteration(m: job_pb2.IterationMetric, per_epoch: int, position: int) -> int:
    """The 1-based index of an iteration over the whole job (``position`` in the list when the
    number of iterations per epoch is not known yet)."""
    return m.epoch * per_epoch + m.iteration + 1 if per_epoch else position + 1


def iteration_rows(
    metrics: Sequence[job_pb2.IterationMetric], per_epoch: int, *, offset: int = 0
) -> list[dict[str, Any]]:
    """One dict per iteration: its coordinates, its time, then every metric it carries."""
    rows = []
    for i, m in enumerate(metrics):
        row: dict[str, Any] = {
            "global_iteration": global_iteration(m, per_epoch, offset + i),
            "epoch": m.epoch,
            "iteration": m.iteration,
            "generation": m.generation,
            "world_size": m.world_size,
            "samples": m.samples,
            "time": seconds(m.time),
        }
        row.update(metric_values(m, ITERATION_COORDINATES))
        rows.append(row)
    return rows


def epoch_rows(
    metrics: Sequence[job_pb2.EpochMetric], iterations: Sequence[job_pb2.IterationMetric] = ()
) -> list[dict[str, Any]]:
    """One dict per epoch (``epoch`` 1-based: epochs completed): its evaluation's metrics, and
    for what the training script logged per iteration (``IterationMetric.values``,
    ``trainer.log``) ``mean_<name>``, the sample-weighted mean over the epoch's iterations."""
    rows: dict[int, dict[str, Any]] = {}
    for m in metrics:
        row: dict[str, Any] = {"epoch": m.epoch + 1, "time": seconds(m.time)}
        row.update(metric_values(m, EPOCH_COORDINATES))
        rows[m.epoch] = row
    sums: dict[int, dict[str, list[float]]] = {}
    last: dict[int, float] = {}
    for it in iterations:
        if not it.values:
            continue
        last[it.epoch] = max(last.get(it.epoch, 0.0), seconds(it.time))
        weight = max(it.samples, 1)
        for name, value in it.values.items():
            acc = sums.setdefault(it.epoch, {}).setdefault(name, [0.0, 0.0])
            acc[0] += value * weight
            acc[1] += weight
    for epoch, names in sums.items():
        row = rows.setdefault(epoch, {"epoch": epoch + 1, "time": last[epoch]})
        for name in sorted(names):
            total, samples = names[name]
            row[f"mean_{name}"] = finite(total / samples)
    return [rows[e] for e in sorted(rows)]
