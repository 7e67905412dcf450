"""A job's shape, as its coordinator holds it: the tensor layout, optimizer, dataset size and
sharding fixed by the first Join (or by the checkpoint it resumed from), and the global
batches over its iterations (``shoal.contract.batch_schedule``), which a job with an adaptive
batch changes at a boundary. Pure: no I/O. The coordinator (``coordinator.py``) holds one as
``coord.shape`` and decides when a requested batch takes effect."""

from __future__ import annotations

from collections.abc import Sequence

from shoal.contract.batch_schedule import MAX_SEGMENTS, BatchSchedule, Position
from shoal.contract.wire import TensorMeta
from shoal.param_sync.coordinator_records import (
    JobSettings,
    OptimizerConfig,
    check_same_shape,
    check_shape,
)
from shoal.param_sync.sharding import Sharding, assign_shards
from shoal.runtime.errors import FailedPrecondition, InvalidField


class JobShape:
    """What every member of a job must agree on, and the job's batches (see the module
    docstring)."""

    def __init__(self, settings: JobSettings) -> None:
        self.settings = settings
        self.layout: tuple[TensorMeta, ...] | None = None
        self.optimizer: OptimizerConfig | None = None
        self.dataset_size: int | None = None
        self.sharding: Sharding | None = None
        # The batches over the global iterations (None: the fixed batch of the settings).
        self._schedule: BatchSchedule | None = None
        self.pending_batch: int | None = None  # requested, from the next boundary

    # -- layout -------------------------------------------------------------------------------

    def plan_sharding(
        self, layout: Sequence[TensorMeta], optimizer: OptimizerConfig, dataset_size: int
    ) -> Sharding:
        """Check a Join's job description against the job's (or, for the first, on its own)
        and return the sharding it implies. Changes nothing."""
        if self.layout is not None:
            self._check_same(layout, optimizer, dataset_size)
            assert self.sharding is not None
            return self.sharding
        check_shape(layout, optimizer, dataset_size)
        return assign_shards(layout, self.settings.num_shards)

    def _check_same(
        self, layout: Sequence[TensorMeta], optimizer: OptimizerConfig, dataset_size: int
    ) -> None:
        assert self.layout is not None
        check_same_shape(
            self.layout, self.optimizer, self.dataset_size, layout, optimizer, dataset_size
        )

    def fix_layout(
        self,
        layout: Sequence[TensorMeta],
        optimizer: OptimizerConfig,
        dataset_size: int,
        sharding: Sharding,
    ) -> None:
        """Make ``layout`` the job's (after the shards were configured with ``sharding``)."""
        if self.layout is not None:
            self._check_same(layout, optimizer, dataset_size)
            return
        self.layout = tuple(layout)
        self.optimizer = optimizer
        self.dataset_size = dataset_size
        self.sharding = sharding

    # -- batches ------------------------------------------------------------------------------

    @property
    def schedule(self) -> BatchSchedule:
        """The job's batches over its global iterations (after :meth:`fix_layout`)."""
        assert self.dataset_size is not None
        if self._schedule is None or self._schedule.num_samples != self.dataset_size:
            self._schedule = BatchSchedule.fixed(self.dataset_size, self.settings.batch_size)
        return self._schedule

    @schedule.setter
    def schedule(self, value: BatchSchedule) -> None:
        self._schedule = value

    @property
    def iterations_per_epoch(self) -> int:
        """Iterations per epoch at the current batch (the last one set)."""
        if self.dataset_size is None:
            return 0
        return -(-self.dataset_size // self.global_batch)

    @property
    def global_batch(self) -> int:
        """The global batch of the iterations from now on."""
        if self.dataset_size is None:
            return self.settings.batch_size
        return self.schedule.segments[-1].batch

    @property
    def total_iterations(self) -> int:
        if self.dataset_size is None:
            return 0
        return self.schedule.total_iterations(self.settings.epochs)

    def position(self, global_iteration: int) -> Position:
        """Where ``global_iteration`` stands (epoch, iteration, sample positions, batch)."""
        return self.schedule.locate(global_iteration)

    def epoch_of(self, global_iteration: int) -> int:
        """The epoch of ``global_iteration`` (``settings.epochs`` once all are done)."""
        if self.dataset_size is None:
            return 0
        return self.position(global_iteration).epoch

    def batch_samples(self, global_iteration: int) -> int:
        return self.position(global_iteration).samples

    def request_batch(self, batch: int) -> None:
        """Ask for the global batch ``batch`` from the next boundary (the scheduler's pick for
        a job with an adaptive batch), checked against the job's bounds."""
        s = self.settings
        if not s.adaptive:
            raise FailedPrecondition(
                f"job {s.job_id!r} has no adaptive batch: its global batch is fixed "
                f"({s.batch_size})"
            )
        if isinstance(batch, bool) or not isinstance(batch, int):
            raise InvalidField("global_batch", batch, "must be an int")
        if not s.min_batch <= batch <= s.max_batch:
            raise InvalidField(
                "global_batch",
                batch,
                f"must be within the job's adaptive batch [{s.min_batch}, {s.max_batch}]",
            )
        self.pending_batch = batch

    def apply_pending_batch(self, completed: int) -> BatchSchedule | None:
        """At the boundary of global iteration ``completed``: run the requested batch from
        there. Returns the new schedule when it changed (to be made durable before anyone runs
        at it), None otherwise. Positions are kept in samples, so no sample of the epoch is
        skipped or repeated."""
        if self.pending_batch is None or self.dataset_size is None:
            return None
        batch, self.pending_batch = self.pending_batch, None
        if completed >= self.total_iterations:
            return None  # the job is done: nothing left to run at another batch
        before = self.schedule
        if len(before.segments) >= MAX_SEGMENTS and before.batch_at(completed) != batch:
            return None  # as many changes as a schedule records: the batch stays (never seen)
        self.schedule = before.change(completed, batch)
        return self.schedule if self.schedule is not before else None
