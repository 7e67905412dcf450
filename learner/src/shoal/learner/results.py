"""What :meth:`ElasticTrainer.train <shoal.learner.trainer.ElasticTrainer.train>` returns: a
record per iteration, a result per epoch and the run's result.

Plain frozen dataclasses, kept apart from the loop so callbacks and tests can name them
without reading the trainer. ``trainer.py`` re-exports them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from shoal.learner.backend import TrainingPlan
from shoal.learner.frozen_init import fast_frozen_init


@fast_frozen_init  # (built every iteration)
@dataclass(frozen=True)
class IterationRecord:
    """One completed iteration as this learner saw it: ``loss`` is the global mean training
    loss of the iteration (all learners) when the backend reports it, else None;
    ``share_loss`` the mean over this learner's ``n_samples`` (NaN for an empty share);
    ``metrics`` what the script logged for it (``trainer.log``), as this learner's
    sample-weighted means (the job's values, over every learner, are in the job's metrics)."""

    step: int
    epoch: int
    iteration: int
    generation: int
    rank: int
    world_size: int
    batch_size: int
    n_samples: int
    loss: float | None
    share_loss: float
    lr: float | None
    grad_norm: float | None = None
    skipped: bool = False
    loss_scale: float | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)

    @property
    def best_loss(self) -> float:
        """The global loss when known, else this learner's share loss."""
        return self.share_loss if self.loss is None else self.loss


@dataclass(frozen=True)
class EpochResult:
    """End-of-epoch evaluation: mean training loss over the epoch's iterations this learner
    took part in, mean test loss (NaN without a test set), and the metrics hook's values."""

    epoch: int
    step: int
    train_loss: float
    test_loss: float
    metrics: Mapping[str, float]
    seconds: float

    def summary(self, epochs: int | None = None) -> str:
        total = f"/{epochs}" if epochs is not None else ""
        parts = [
            f"epoch {self.epoch + 1}{total}",
            f"train loss {self.train_loss:.4f}",
            f"test loss {self.test_loss:.4f}",
        ]
        parts += [f"{name} {value:.4f}" for name, value in self.metrics.items()]
        return ", ".join(parts) + f" ({self.seconds:.1f} s)"


@dataclass
class TrainResult:
    """What :meth:`ElasticTrainer.train` returns.

    ``params`` is the final ``state_dict`` (CPU copies). ``history`` has one record per
    iteration this learner completed; ``epochs`` one result per epoch it evaluated (on the
    cluster only the learner of rank 0 at an epoch's end evaluates). ``retired`` is true when
    the coordinator retired this learner before the job ended; ``completed`` when the job ran
    all its iterations. ``is_primary`` is true on exactly one learner of a completed job: the
    one of rank 0 in the job's last iteration (always standalone); code after ``train()``
    that writes files or prints summaries should run only where it is true.
    """

    plan: TrainingPlan
    params: dict[str, torch.Tensor]
    history: list[IterationRecord] = field(default_factory=list)
    epochs: list[EpochResult] = field(default_factory=list)
    retired: bool = False
    completed: bool = False
    is_primary: bool = False

    @property
    def losses(self) -> list[float]:
        """Mean training loss of each iteration in :attr:`history`: the global one where the
        backend reports it (always standalone), else this learner's share's."""
        return [r.best_loss for r in self.history]
