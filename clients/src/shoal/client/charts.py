"""Charts of a job's life: GPUs per job over time (a step chart) and loss curves (PNG).

Needs matplotlib (``pip install 'shoal-client[charts]'``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from shoal.v1 import job_pb2


def _pyplot():  # type: ignore[no-untyped-def]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("charts need matplotlib: pip install 'shoal-client[charts]'") from exc
    return plt


def allocation_series(
    events: Iterable[job_pb2.AllocationEvent],
) -> dict[str, list[tuple[float, int]]]:
    """job id -> [(seconds since the first event, workers)], in time order."""
    ordered = sorted(events, key=lambda e: e.time.ToNanoseconds())
    if not ordered:
        return {}
    t0 = ordered[0].time.ToNanoseconds()
    series: dict[str, list[tuple[float, int]]] = {}
    for e in ordered:
        series.setdefault(e.job_id, []).append(((e.time.ToNanoseconds() - t0) / 1e9, e.workers))
    return series


def draw_allocation_chart(
    series: Mapping[str, Sequence[tuple[float, int]]],
    out: str | Path,
    *,
    capacity: int | None = None,
    labels: Mapping[str, str] | None = None,
    end_time: float | None = None,
) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    end = (
        end_time
        if end_time is not None
        else max((p[-1][0] for p in series.values() if p), default=1.0)
    )
    for job_id, points in series.items():
        xs = [t for t, _ in points] + [end]
        ys = [w for _, w in points] + [points[-1][1]]
        ax.step(xs, ys, where="post", label=(labels or {}).get(job_id, job_id), linewidth=2)
    if capacity:
        ax.axhline(capacity, color="grey", linestyle=":", label=f"capacity ({capacity})")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("GPUs (learners)")
    ax.set_title("GPUs per job over time")
    ax.legend(loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(out)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draw_loss_curves(
    curves: Mapping[str, Sequence[tuple[int, float]]], out: str | Path, *, title: str = "loss"
) -> Path:
    """curves: label -> [(global iteration, loss)]."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    for label, points in curves.items():
        if points:
            ax.plot([i for i, _ in points], [v for _, v in points], label=label)
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.legend(loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(out)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def loss_points(
    metrics: Iterable[job_pb2.IterationMetric], per_epoch: int
) -> list[tuple[int, float]]:
    """(global iteration, loss) from a job's iteration metrics."""
    return [(m.epoch * per_epoch + m.iteration, m.loss) for m in metrics]
