"""TensorBoard event files of a job, from what the API returns (``shoal jobs tensorboard``).

Needs tensorboardX (``pip install 'shoal-client[tensorboard]'``): it writes the standard event
files without TensorFlow or torch. The run directory is ``<logdir>/<job_id>``, so one
``tensorboard --logdir <logdir>`` compares jobs. Tags:

- ``train/<metric>`` per iteration (step: the 1-based global iteration; wall time: when the
  iteration completed): ``loss``, ``samples_per_second`` and every other metric the API returns
  for iterations; ``train/world_size``: the learners that ran the iteration, whose steps are
  the rescales;
- ``epoch/<metric>`` per evaluated epoch (step: epochs completed): ``accuracy``,
  ``test_loss``, ... whatever the job reported;
- ``allocation/workers`` and ``allocation/target_workers`` at each allocation change (step:
  the iterations completed by then; wall time: the change), and ``allocation/reason`` as text.

Writing again replaces the run's event files (they are all derived from the API), so a run
never holds a point twice.
"""

from __future__ import annotations

import bisect
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shoal.client.metrics import epoch_rows, iteration_rows, seconds
from shoal.v1 import job_pb2

__all__ = ["EventWriter", "run_directory"]

EVENT_FILE_PREFIX = "events.out.tfevents."
_COORDINATES = ("global_iteration", "epoch", "iteration", "generation", "samples", "time")


def _summary_writer() -> Any:
    # tensorboardX imports torch whenever it is installed (seconds of start-up) to accept its
    # tensors; scalars need none of it, so it is hidden from that import.
    hide_torch = "torch" not in sys.modules
    if hide_torch:
        sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        from tensorboardX import SummaryWriter
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "TensorBoard event files need tensorboardX: pip install 'shoal-client[tensorboard]'"
        ) from exc
    finally:
        if hide_torch:
            del sys.modules["torch"]
    return SummaryWriter


def run_directory(logdir: str | Path, job_id: str) -> Path:
    return Path(logdir) / job_id


class EventWriter:
    """The event files of one job's run; add metrics as they come, then close."""

    def __init__(self, logdir: str | Path, job_id: str) -> None:
        writer_cls = _summary_writer()
        self.path = run_directory(logdir, job_id)
        self.path.mkdir(parents=True, exist_ok=True)
        for old in self.path.glob(EVENT_FILE_PREFIX + "*"):
            old.unlink()
        self._writer = writer_cls(logdir=str(self.path), flush_secs=5)
        self.iterations = 0  # how many iterations were written (for incremental updates)
        self._epochs = 0
        self._allocations = 0
        self._times: list[float] = []  # completion time of each written iteration

    @property
    def last_time(self) -> float:
        """When the last written iteration completed (0 before any)."""
        return self._times[-1] if self._times else 0.0

    def add_iterations(self, metrics: Sequence[job_pb2.IterationMetric], per_epoch: int) -> None:
        for row in iteration_rows(metrics, per_epoch, offset=self.iterations):
            step, walltime = row["global_iteration"], row["time"] or None
            for name, value in row.items():
                if name in _COORDINATES or value is None:
                    continue
                self._writer.add_scalar(f"train/{name}", value, step, walltime=walltime)
            self._times.append(row["time"])
        self.iterations += len(metrics)

    def add_epochs(self, metrics: Sequence[job_pb2.EpochMetric]) -> None:
        """The epoch metrics (all of them, as GetJobMetrics returns them: new ones are added)."""
        for row in epoch_rows(metrics[self._epochs :]):
            for name, value in row.items():
                if name in ("epoch", "time") or value is None:
                    continue
                self._writer.add_scalar(
                    f"epoch/{name}", value, row["epoch"], walltime=row["time"] or None
                )
        self._epochs = max(self._epochs, len(metrics))

    def add_allocations(
        self, events: Sequence[job_pb2.AllocationEvent], *, until: float | None = None
    ) -> None:
        """The allocation history (all of it, as GetAllocationHistory returns it); with
        ``until``, only the changes up to that time (whose step is known by then)."""
        for event in events[self._allocations :]:
            when = seconds(event.time)
            if until is not None and when > until:
                break
            self._allocations += 1
            step = bisect.bisect_right(self._times, when)  # iterations completed by then
            self._writer.add_scalar("allocation/workers", event.workers, step, walltime=when)
            self._writer.add_scalar(
                "allocation/target_workers", event.target_workers, step, walltime=when
            )
            self._writer.add_text(
                "allocation/reason",
                f"{event.workers} learners (target {event.target_workers}): {event.reason}",
                step,
                walltime=when,
            )

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
