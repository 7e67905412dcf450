"""Keras-style callbacks for :class:`~shoal.learner.ElasticTrainer`.

Subclass :class:`Callback`, override the hooks you need, and pass instances to the trainer
(``ElasticTrainer(..., callbacks=[MyCallback()])``). Every learner of a job runs its callbacks;
``self.trainer.is_primary`` tells the one learner that should write files or print summaries
(rank 0 of the current iteration; always true standalone).

Order of the calls on one learner::

    on_train_begin(plan, step)          # after joining; step = iterations the job already did
    on_rescale(old_world, new_world, assignment)   # before an iteration whose world changed
    on_epoch_begin(epoch)               # before the first iteration of each epoch it runs
    on_iteration_end(record)            # after every iteration this learner took part in
    on_epoch_end(epoch, result)         # after an epoch's last iteration (result: evaluation,
                                        # on the primary only; None on the others)
    on_train_end(result)                # once, also when retired (result.retired)

Callbacks observe; they must not change the model's parameters or buffers, or the job stops
being equivalent to single-process training (the synchronized state would differ from what
this learner computes with). An exception raised in a callback stops this learner's training
and propagates out of :meth:`~shoal.learner.ElasticTrainer.train`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    from shoal.learner.backend import Assignment, TrainingPlan
    from shoal.learner.trainer import ElasticTrainer, EpochResult, IterationRecord, TrainResult

__all__ = ["Callback", "CallbackList", "LoggingCallback"]

logger = logging.getLogger("shoal.learner")


class Callback:
    """Base class of the trainer's callbacks: every hook does nothing by default.

    ``self.trainer`` is the :class:`~shoal.learner.ElasticTrainer` running the callback (set
    before :meth:`on_train_begin`), so a hook can read ``self.trainer.is_primary``,
    ``self.trainer.model`` or ``self.trainer.device``.
    """

    trainer: ElasticTrainer

    def set_trainer(self, trainer: ElasticTrainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, plan: TrainingPlan, step: int) -> None:
        """This learner joined its job; ``plan`` is the job's (it wins over the script's) and
        ``step`` the number of iterations the job had already completed (0 for a new job)."""

    def on_rescale(self, old_world: int, new_world: int, assignment: Assignment) -> None:
        """The job's membership changed since this learner's previous iteration (learners
        joined, retired or failed): ``old_world`` and ``new_world`` are the numbers of
        learners before and after; ``assignment`` is the coming iteration's (its
        ``generation``, ``rank``, ``step``). Not called before this learner's first
        iteration."""

    def on_epoch_begin(self, epoch: int) -> None:
        """Before the first iteration of ``epoch`` that this learner runs (a learner joining
        mid-epoch gets it for that epoch too)."""

    def on_iteration_end(self, record: IterationRecord) -> None:
        """After every iteration this learner took part in. ``record.step`` is the global
        iteration, ``record.loss`` the iteration's global mean loss (None where the backend
        cannot know it yet, then ``record.share_loss`` is this learner's), ``record.rank``,
        ``record.world_size``, ``record.generation``, ``record.lr`` and, with clipping or
        mixed precision, ``record.grad_norm`` and ``record.skipped``."""

    def on_epoch_end(self, epoch: int, result: EpochResult | None) -> None:
        """After ``epoch``'s last iteration, when this learner ran it. ``result`` is the
        end-of-epoch evaluation on the learner that evaluated (the primary), None on the
        others."""

    def on_train_end(self, result: TrainResult) -> None:
        """Once, when this learner stops: the job completed (``result.completed``), or the
        coordinator retired it (``result.retired``). Not called when training raised."""


class CallbackList:
    """Calls each callback's hook in order (what the trainer holds)."""

    def __init__(self, callbacks: Iterable[Callback] = ()) -> None:
        self.callbacks: list[Callback] = []
        for c in callbacks:
            if not isinstance(c, Callback):
                raise ValueError(f"callback ({c!r}) must be an instance of shoal.learner.Callback")
            self.callbacks.append(c)

    def __len__(self) -> int:
        return len(self.callbacks)

    def set_trainer(self, trainer: ElasticTrainer) -> None:
        for c in self.callbacks:
            c.set_trainer(trainer)

    def overrides(self, hook: str) -> bool:
        """Whether a callback overrides ``hook`` (it may read the model then)."""
        return any(getattr(type(c), hook) is not getattr(Callback, hook) for c in self.callbacks)

    def _call(self, hook: str, *args: Any) -> None:
        for c in self.callbacks:
            getattr(c, hook)(*args)

    def on_train_begin(self, plan: TrainingPlan, step: int) -> None:
        self._call("on_train_begin", plan, step)

    def on_rescale(self, old_world: int, new_world: int, assignment: Assignment) -> None:
        self._call("on_rescale", old_world, new_world, assignment)

    def on_epoch_begin(self, epoch: int) -> None:
        self._call("on_epoch_begin", epoch)

    def on_iteration_end(self, record: IterationRecord) -> None:
        self._call("on_iteration_end", record)

    def on_epoch_end(self, epoch: int, result: EpochResult | None) -> None:
        self._call("on_epoch_end", epoch, result)

    def on_train_end(self, result: TrainResult) -> None:
        self._call("on_train_end", result)


class LoggingCallback(Callback):
    """Logs every ``every``-th iteration (step, loss, world, learning rate) on the primary
    learner, at INFO on the ``shoal.learner`` logger."""

    def __init__(self, every: int = 10) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every ({every!r}) must be an int >= 1")
        self.every = every

    def on_iteration_end(self, record: IterationRecord) -> None:
        if record.step % self.every or not self.trainer.is_primary:
            return
        parts: Sequence[str] = [
            f"step {record.step}",
            f"loss {record.best_loss:.4f}",
            f"world {record.world_size}",
        ]
        if record.lr is not None:
            parts = [*parts, f"lr {record.lr:.3g}"]
        if record.grad_norm is not None:
            parts = [*parts, f"grad norm {record.grad_norm:.3g}"]
        logger.info("%s", ", ".join(parts))
