"""The part of a job's coordinator that recovers from loss: a parameter-server shard found
unreachable or without its slice (:meth:`~RecoveryMixin.shard_lost`, ``promote``,
``recovered``, ``rewind``), the loss of the coordinator itself (``take_over``) and the resume
from a checkpoint (``restore``).

It is one of the :class:`~shoal.param_sync.coordinator.Coordinator`'s bases and works on its
state (``self.members``, ``self._holds``, ...): the protocol it follows is in
``coordinator.py``'s docstring. Kept apart so the iteration protocol reads in one module and
recovery in another. Pure like the rest: no I/O, no gRPC, the coordinator's injected clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from shoal.contract.batch_schedule import BatchSchedule
from shoal.contract.wire import TensorMeta
from shoal.param_sync.coordinator_records import (
    CheckpointTask,
    IterationInfo,
    OptimizerConfig,
    RecoverTask,
    ResolveTask,
    ScheduleTask,
    Task,
)
from shoal.param_sync.sharding import Sharding
from shoal.runtime.errors import InvalidField


class RecoveryMixin:
    """Shard loss, coordinator failover and resume, for :class:`Coordinator`."""

    # -- shard loss (parameter-server mode) ----------------------------------------------------

    @property
    def recovery(self) -> RecoverTask | None:
        return next((t for t in self._holds if isinstance(t, RecoverTask)), None)

    def shard_lost(self, shard_index: int, reason: str) -> list[Task]:
        """Shard ``shard_index`` is unreachable or lost its slice. Aborts the running
        iteration (its sums may be gone) and holds a :class:`RecoverTask`, so every boundary
        waits until the shard answers again. Returns the tasks to start (none when the job is
        in collective mode, not started, done, or already recovering)."""
        if self.shape.sharding is None or not 0 <= shard_index < self.shape.sharding.num_shards:
            raise InvalidField("shard_index", shard_index, "is not a shard of the job")
        if (
            self.collective is not False
            or not self.initialized
            or self.done
            or self.recovery is not None
            or not self.shape.sharding.tensors[shard_index]
        ):
            return []
        self.recovering = f"shard {shard_index} {reason} at iteration {self.completed}"
        tasks: list[Task] = []
        if self.running and self.members:
            abort = ResolveTask(self.generation, self.completed, commit=False)
            self._hold(abort)
            tasks.append(abort)
            self._admit(list(self.members), new_generation=True)
        task = RecoverTask(shard_index, reason)
        self._hold(task)
        tasks.append(task)
        self._touch()
        return tasks

    def promote(self, lost: int, backup: int) -> Sharding:
        """Move the lost shard's tensors to ``backup`` (which kept their replica): the new
        sharding, in layout order; the lost shard holds nothing from now on (it may come back
        as a spare). Increases the routing epoch, so learners re-route."""
        sharding = self.shape.sharding
        if sharding is None or not (
            0 <= lost < sharding.num_shards and 0 <= backup < sharding.num_shards
        ):
            raise InvalidField("shard_index", (lost, backup), "is not a shard of the job")
        if lost == backup or not sharding.tensors[backup]:
            raise InvalidField("backup", backup, f"cannot take shard {lost}'s tensors")
        assert self.shape.layout is not None
        moved = set(sharding.tensors[lost]) | set(sharding.tensors[backup])
        tensors = list(sharding.tensors)
        loads = list(sharding.loads)
        tensors[backup] = tuple(m.name for m in self.shape.layout if m.name in moved)
        tensors[lost] = ()
        loads[backup] += loads[lost]
        loads[lost] = 0
        self.shape.sharding = Sharding(tuple(tensors), tuple(loads))
        self.routing_epoch += 1
        return self.shape.sharding

    def recovered(self, task: RecoverTask) -> None:
        """The lost shard answered holding its slice at the current iteration: nothing was
        lost. The boundaries go on (the aborted iteration is re-run)."""
        self.recovering = ""
        self.task_done(task)

    def rewind(self, task: RecoverTask, iteration: int, *, generation: int) -> None:
        """Every shard loaded the checkpoint after ``iteration`` iterations (written in
        ``generation``): continue from it in a new generation, every member pulling. Records
        of iterations at or after it are dropped (they will be run again)."""
        self.completed = iteration
        self.samples_processed = self.shape.schedule.samples_before(iteration)
        self._collecting = {k: v for k, v in self._collecting.items() if k < iteration}
        self._finished = [r for r in self._finished if r["global_iteration"] < iteration]
        self.synced = set()
        self.generation = max(self.generation, generation)
        self._holds = [t for t in self._holds if not isinstance(t, CheckpointTask)]
        self._deferred_commit = False
        self._admit(
            [m for m in self.members if m not in self.evicted and m not in self.retired],
            new_generation=True,
        )
        self.recovering = ""
        self.task_done(task)

    # -- coordinator failover -----------------------------------------------------------------

    def take_over(
        self,
        *,
        layout: Sequence[TensorMeta],
        optimizer: OptimizerConfig,
        dataset_size: int,
        completed: int,
        generation: int,
        last_checkpoint: int,
        lost_shard: int,
        collect_last: bool = True,
        sharding: Sharding | None = None,
    ) -> list[Task]:
        """Become the coordinator of a parameter-server job whose coordinator shard was lost
        (shard ``lost_shard``), at ``completed`` iterations, which every shard left holds: the
        layout comes from the first learner that re-joins, generations continue from
        ``generation`` (above every generation of the lost coordinator), every learner pulls,
        and the lost shard's slice is recovered as for any lost shard (the returned tasks:
        :meth:`shard_lost`). The report of the last committed iteration, which went to the lost
        coordinator, is collected again from whoever sends it, until the next commit, unless
        ``collect_last`` is false (it is recorded already). ``sharding``: the one the shards
        left hold (after an earlier promotion it is not the hash rule's; default: the hash
        rule's)."""
        self.restore(
            layout=layout,
            optimizer=optimizer,
            dataset_size=dataset_size,
            completed=completed,
            samples_processed=0,
            generation=generation,
        )
        if sharding is not None:
            if sharding.num_shards != self.settings.num_shards:
                raise InvalidField(
                    "sharding", sharding.num_shards, f"must have {self.settings.num_shards} shards"
                )
            self.shape.sharding = sharding
        self.set_mode(False)
        self.resumed = False
        self.initialized = True
        self.samples_processed = self.shape.schedule.samples_before(completed)
        self.last_checkpoint = last_checkpoint
        if completed > 0 and collect_last:
            k = completed - 1
            epoch, iteration = self.shape.position(k).epoch, self.shape.position(k).iteration
            self._collecting[k] = IterationInfo(
                global_iteration=k,
                epoch=epoch,
                iteration=iteration,
                generation=-1,
                world_size=0,
                samples=self.shape.batch_samples(k),
                seconds=1e-9,
                time=self._clock(),
                expected=set(),
                late=True,
            )
        return self.shard_lost(lost_shard, "lost (it was the coordinator)")

    # -- resume -------------------------------------------------------------------------------

    def restore(
        self,
        *,
        layout: Sequence[TensorMeta],
        optimizer: OptimizerConfig,
        dataset_size: int,
        completed: int,
        samples_processed: int,
        generation: int,
        last_loss: float = math.nan,
        schedule: BatchSchedule | None = None,
    ) -> None:
        """Continue from a checkpoint: the layout is fixed, the shards hold the parameters
        after ``completed`` iterations, every learner pulls them; generations continue after
        the checkpoint's so that no learner of the previous life is taken for a member.
        ``schedule``: the batches the checkpoint recorded (a job with an adaptive batch);
        None: the settings' fixed batch."""
        if schedule is not None and schedule.num_samples != dataset_size:
            raise InvalidField(
                "batch_schedule.num_samples",
                schedule.num_samples,
                f"differs from the checkpoint's dataset_size ({dataset_size})",
            )
        sharding = self.shape.plan_sharding(layout, optimizer, dataset_size)
        self.shape.fix_layout(layout, optimizer, dataset_size, sharding)
        if schedule is not None:
            self.shape.schedule = schedule
        if self.settings.adaptive:
            # The stored schedule must be this one from now on (it may hold changes made
            # after the checkpoint, by iterations that are run again).
            self._hold(ScheduleTask(completed, self.shape.schedule.to_json()))
        self.completed = completed
        self.samples_processed = samples_processed
        self.generation = generation + 1
        self.last_checkpoint = completed
        self.initialized = True
        self.resumed = True
        self.last_loss = last_loss
        self._touch()
