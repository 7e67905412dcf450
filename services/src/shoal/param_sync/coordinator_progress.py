"""The part of a job's coordinator that keeps its loss and progress: an iteration's record
once every member reported its loss (for ``metrics/iterations.jsonl``), the recent samples per
second, and the progress GetJobProgress and the manifests report.

It is one of the :class:`~shoal.param_sync.coordinator.Coordinator`'s bases and works on its
state (``self.members``, ``self.completed``, ...), like
:class:`~shoal.param_sync.coordinator_recovery.RecoveryMixin`. Pure: no I/O, the coordinator's
injected clock.
"""

from __future__ import annotations

import math
from typing import Any

from shoal.contract import user_metrics
from shoal.param_sync.coordinator_records import IterationInfo, mean_user_metrics


class ProgressMixin:
    """Loss records and progress, for :class:`Coordinator`."""

    def _maybe_finish(self, info: IterationInfo) -> None:
        if not set(info.expected) <= set(info.reports):
            return
        del self._collecting[info.global_iteration]
        loss_sum = sum(s for s, _ in info.reports.values())
        n = sum(c for _, c in info.reports.values())
        loss = loss_sum / n if n else math.nan
        if info.global_iteration >= max(
            (r["global_iteration"] for r in self._finished[-1:]), default=-1
        ):
            self.last_loss = loss
        if info.user:
            self.split.add(info.world_size, values := mean_user_metrics(info.user.values()))
            grad_sq = values.get(user_metrics.GNS_GRAD_SQ)
            trace = values.get(user_metrics.GNS_TRACE)
            if grad_sq is not None and trace is not None:
                self.noise.add(grad_sq, trace)
        self._finished.append(
            {
                "epoch": info.epoch,
                "iteration": info.iteration,
                "global_iteration": info.global_iteration,
                "generation": info.generation,
                "world_size": info.world_size,
                "loss": loss,
                "samples": info.samples,
                "samples_per_second": info.samples / info.seconds,
                "time": info.time,
                **({"values": values} if info.user else {}),
            }
        )

    def take_metrics(self) -> list[dict[str, Any]]:
        """Iteration records finished since the last call (for metrics/iterations.jsonl)."""
        out, self._finished = self._finished, []
        return out

    @property
    def samples_per_second(self) -> float:
        samples = sum(s for s, _ in self._recent)
        seconds = sum(t for _, t in self._recent)
        return samples / seconds if seconds > 0 else 0.0

    def progress(self) -> dict[str, Any]:
        ipe = self.shape.iterations_per_epoch
        compute, sync = self.split.at(len(self.members))
        epoch, iteration = 0, 0
        if ipe:
            here = self.shape.position(self.completed)
            epoch, iteration = here.epoch, here.iteration
            if epoch >= self.settings.epochs:
                last = self.shape.position(self.completed - 1)
                epoch, iteration = last.epoch, last.iteration
        return {
            "epoch": epoch,
            "iteration": iteration,
            "iterations_per_epoch": ipe,
            "completed_iterations": self.completed,
            "samples_processed": self.samples_processed,
            "world_size": len(self.members),
            "generation": self.generation,
            "samples_per_second": self.samples_per_second,
            "last_loss": self.last_loss,
            "update_time": self.update_time,
            "compute_seconds": compute,
            "sync_seconds": sync,
            "global_batch": self.shape.global_batch,
            "gradient_noise_scale": self.noise.phi or 0.0,
            "gradient_noise_samples": self.noise.count,
        }

    def _touch(self) -> None:
        self.update_time = self._clock()
