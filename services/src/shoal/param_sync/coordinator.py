"""The coordinator of one job: membership generations, iteration boundaries, admission,
retirement, eviction, the two-phase commit of each iteration, progress and the loss of each
iteration. Pure: no I/O, no gRPC, an injected clock. ``service.py`` drives it and performs the
side effects it asks for (:class:`ResolveTask`, :class:`CheckpointTask`).

The protocol (DESIGN.md, "The iteration protocol"):

* A learner ``join``\\ s (it becomes *ready*) and asks ``decide`` at every boundary.
* When no iteration is running, the first ``decide`` freezes the next generation: the previous
  members minus those retiring or evicted, plus the ready joiners (survivors keep their
  relative order, joiners are appended; rank = position). The generation number changes only
  when the member list does. Everyone then gets the same generation and iteration; a learner
  that is not a member waits (``WAIT``) until a freeze admits it.
* Shards report ``shard_ready(g, k)`` when they hold every member's gradients; when all active
  shards are ready the coordinator commits: a :class:`ResolveTask` (commit) for every shard.
* ``evict`` of a member while iteration ``k`` runs aborts it (:class:`ResolveTask` abort, no
  shard has stepped) and re-freezes the survivors for the same ``k`` with new ranks.
* While a side effect that must finish first is outstanding (a commit or abort being
  delivered, a checkpoint being written) every ``decide`` answers ``WAIT``: no learner starts
  an iteration before every shard is at the same state.

Collective mode (the first ``Join`` fixes the mode, :meth:`Coordinator.set_mode`): the
learners hold the state and all-reduce among themselves, so the commit votes come from them.

* A member reports ``(g, k)`` with its next Boundary once its all-reduce of iteration ``k``
  succeeded; when every member has, ``k`` commits (no shard is involved) and the learners apply
  the update they kept pending. A member whose collective failed calls :meth:`fail`: ``k`` is
  aborted and the survivors are re-frozen in a new generation (a new process group).
* A new generation runs only once every member has reached its boundary in it
  (the rendezvous barrier), so a group is never formed with a member that is not there.
* Checkpoints are written by a learner that holds the state (``CHECKPOINT`` decisions); when
  the last holders retire, the state is checkpointed first; when no member holds it any more
  (every holder died), the job rewinds to its latest checkpoint (:class:`RewindTask`).

Shard loss (parameter-server mode): when the service finds a shard unreachable or without its
slice (it restarted), :meth:`Coordinator.shard_lost` aborts the running iteration and holds a
:class:`RecoverTask`: every boundary waits while the service waits for the shard to answer. If
it comes back holding the slice at the current iteration, nothing was lost
(:meth:`Coordinator.recovered`); otherwise every shard loads the latest checkpoint and
:meth:`Coordinator.rewind` continues from it, every learner pulling. No learner is stopped and
no job fails for it.

The values it takes and gives (settings, decisions, tasks) are in ``coordinator_records.py``,
re-exported here; the job's shape (layout, sharding, batches) is a
:class:`~shoal.param_sync.coordinator_shape.JobShape`, ``coord.shape``; shard loss,
coordinator failover and resume are in ``coordinator_recovery.py``
(:class:`~shoal.param_sync.coordinator_recovery.RecoveryMixin`).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from shoal.contract.noise_scale import NoiseScaleEstimate
from shoal.param_sync.coordinator_progress import ProgressMixin
from shoal.param_sync.coordinator_records import (
    MAX_USER_METRICS as MAX_USER_METRICS,
    WAIT,
    Action,
    Assignment,
    CheckpointTask,
    Decision,
    IterationInfo,
    IterationSplit,
    JobSettings,
    JoinOutcome,
    OptimizerConfig,
    RecoverTask,
    ResolveTask,
    RewindTask,
    ScheduleTask,
    Task,
    UserMetrics,
    check_user_metrics as check_user_metrics,
)
from shoal.param_sync.coordinator_recovery import RecoveryMixin
from shoal.param_sync.coordinator_shape import JobShape
from shoal.runtime.errors import FailedPrecondition, InvalidField, StaleGeneration

__all__ = [
    "Action",
    "Assignment",
    "CheckpointTask",
    "Coordinator",
    "Decision",
    "JobSettings",
    "JoinOutcome",
    "OptimizerConfig",
    "RecoverTask",
    "ResolveTask",
    "RewindTask",
    "ScheduleTask",
]


class Coordinator(RecoveryMixin, ProgressMixin):
    """One job's coordinator state (see the module docstring)."""

    def __init__(self, settings: JobSettings, *, clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self._clock = clock
        # The job's shape, fixed by the first Join (or the checkpoint it resumed from), and
        # its batches (:meth:`set_global_batch`).
        self.shape = JobShape(settings)
        self.initialized = False
        self.initializer: str | None = None
        self.resumed = False
        # Membership.
        self.generation = 0
        self.members: list[str] = []
        self.ready: list[str] = []
        self.known: set[str] = set()
        self.retiring: set[str] = set()
        self.retired: set[str] = set()
        self.evicted: set[str] = set()
        self.synced: set[str] = set()  # members holding the current parameters
        # Iterations.
        self.completed = 0
        self.samples_processed = 0
        self.running = False  # iteration `completed` is issued to `members`
        self.ready_shards: set[int] = set()
        self._grad_sq_norm = 0.0  # the ready shards' squared gradient norms, summed
        self.done = False
        self.last_checkpoint = -1
        self._holds: list[Task] = []
        self._deferred_commit = False
        self._iteration_started = 0.0
        self._last_commit_time: float | None = None
        self._paused = False
        # Collective mode (None until the first Join says).
        self.collective: bool | None = None
        self._arrived: set[str] = set()  # members at the boundary of an unformed generation
        self._formed = 0  # the last generation whose members all reached the boundary
        self._votes: dict[str, tuple[float, int]] = {}  # members done with the iteration
        self._vote_user: dict[str, UserMetrics] = {}  # their trainer.log values
        self.checkpoint_writer: str | None = None
        self._checkpoint_written = -1
        self.restore_from: int | None = None
        # Shard loss (parameter-server mode): why the job is recovering ("" when it is not),
        # and how many times a lost shard's slice moved to its backup (the routing epoch).
        self.recovering = ""
        self.routing_epoch = 0
        # Loss and throughput.
        self._collecting: dict[int, IterationInfo] = {}
        self._finished: list[dict[str, Any]] = []
        self.last_loss = math.nan
        self._recent: deque[tuple[int, float]] = deque(maxlen=20)
        self.split = IterationSplit()  # the learners' compute/sync seconds (JobProgress)
        # An adaptive-batch job's gradient noise scale (JobProgress.gradient_noise_scale).
        self.noise = NoiseScaleEstimate()
        self.frozen_noise_scale = 0.0
        self.update_time = clock()

    def set_global_batch(self, batch: int) -> None:
        """Run the iterations from the next boundary (the next freeze of a generation) with
        the global batch ``batch`` (:meth:`JobShape.request_batch`). Every member gets the
        same batch since they get their shares of the same frozen iteration."""
        self.shape.request_batch(batch)
        self._touch()

    def _apply_pending_batch(self) -> None:
        changed = self.shape.apply_pending_batch(self.completed)
        if changed is not None:
            # Durable before anyone runs at the new batch (a successor reads it back).
            self._hold(ScheduleTask(self.completed, changed.to_json()))

    def join(self, learner: str) -> bool:
        """Admit ``learner`` to the ready set (after :meth:`fix_layout`). Returns whether it
        must upload the initial parameters. Joining again is harmless (it pulls again)."""
        if not learner:
            raise InvalidField("learner_id", learner, "must not be empty")
        if learner in self.evicted:
            raise StaleGeneration(f"learner {learner!r} was evicted from job {self.job_id!r}")
        if self.shape.layout is None:
            raise FailedPrecondition(f"job {self.job_id!r} has no layout yet")
        self.known.add(learner)
        self.synced.discard(learner)
        if (
            learner not in self.members
            and learner not in self.retired
            and learner not in self.ready
        ):
            self.ready.append(learner)
        self._touch()
        if self.initialized or self.resumed:
            return False
        if self.initializer is None:
            self.initializer = learner
        return self.initializer == learner

    @property
    def job_id(self) -> str:
        return self.settings.job_id

    def set_mode(self, collective: bool) -> None:
        """Fix the job's mode at the first Join; a Join in the other mode is refused."""
        if self.collective is None:
            self.collective = collective
            return
        if self.collective != collective:
            mine = "COLLECTIVE" if self.collective else "PARAMETER_SERVER"
            theirs = "COLLECTIVE" if collective else "PARAMETER_SERVER"
            raise InvalidField("sync_mode", theirs, f"differs from the job's ({mine})")

    # -- boundaries ---------------------------------------------------------------------------

    def report(
        self,
        learner: str,
        generation: int,
        completed_iteration: int,
        loss_sum: float,
        n: int,
        user: UserMetrics | None = None,
    ) -> None:
        """Record a learner's loss of ``completed_iteration`` (sent with its next Boundary),
        and the values its script logged for it (``user``, :func:`check_user_metrics`).
        Reports for iterations not being collected, from non-members or twice are ignored.

        In collective mode a member's report of the running iteration is its commit vote."""
        if (
            self.collective
            and self.running
            and generation == self.generation
            and completed_iteration == self.completed
            and learner in self.members
        ):
            self._votes[learner] = (float(loss_sum), int(n))
            if user:
                self._vote_user[learner] = user
            if set(self.members) <= set(self._votes):
                if any(isinstance(t, CheckpointTask) for t in self._holds):
                    self._deferred_commit = True  # committed when the checkpoint is written
                else:
                    self._commit()
            return
        info = self._collecting.get(completed_iteration)
        if info is not None and info.late and learner not in info.reports:
            info.reports[learner] = (float(loss_sum), int(n))
            info.expected.add(learner)
            if user:
                info.user[learner] = user
            return  # finished at the next commit (:meth:`_commit`)
        if info is None or info.generation != generation or learner not in info.expected:
            return
        if learner in info.reports:
            return
        info.reports[learner] = (float(loss_sum), int(n))
        if user:
            info.user[learner] = user
        self._maybe_finish(info)

    def reported_running(self, learner: str, generation: int, iteration: int) -> bool:
        """Parameter-server mode: whether ``learner``'s report of ``iteration`` of
        ``generation`` is of the iteration still running, or of the one just committed while
        its commit is being delivered to the shards (a Boundary sent beside its SyncStep waits
        until neither: then its answer needs no second wait)."""
        if self.collective or learner not in self.members or generation != self.generation:
            return False
        if self.running:
            return iteration == self.completed
        return iteration == self.completed - 1 and self.commit_in_flight

    def decide(self, learner: str) -> Decision:
        """The learner's answer at its boundary: RUN, RETIRE, DONE or WAIT (ask again after
        the next state change). The first call while no iteration runs freezes the next
        generation."""
        if learner in self.evicted:
            raise StaleGeneration(f"learner {learner!r} was evicted from job {self.job_id!r}")
        if learner not in self.known:
            raise StaleGeneration(
                f"learner {learner!r} has not joined job {self.job_id!r}: join first"
            )
        if learner == self.initializer and not self.initialized:
            # It asks for its first boundary only after uploading the initial parameters,
            # which it holds already.
            self.initialized = True
            self.synced.add(learner)
        if learner in self.retired:
            return Decision(Action.RETIRE)
        if self.done:
            return Decision(Action.DONE)
        if self._holds or not self.initialized:
            return self._writer_or_wait(learner)
        if not self.running:
            if self.completed >= self.shape.total_iterations:
                self._hold(CheckpointTask(self.completed, self.settings.epochs, final=True))
                return self._writer_or_wait(learner)
            self._freeze()
            if learner in self.retired:
                return Decision(Action.RETIRE)
            if self._holds or not self.running:
                return self._writer_or_wait(learner)
        if learner in self.members:
            if self.collective and learner in self._votes:
                return WAIT  # it did its part of the running iteration: wait for the commit
            if self.collective and self._formed != self.generation:
                # The rendezvous barrier: the group forms once every member is here.
                self._arrived.add(learner)
                if not set(self.members) <= self._arrived:
                    return WAIT
                self._formed = self.generation
            pull = learner not in self.synced
            if not self.collective:
                self.synced.add(learner)  # it loads the current parameters before it runs
            # (Collective: it holds the state once an iteration of its group commits.)
            return Decision(
                Action.RUN,
                self._assignment(learner),
                pull=pull,
                restore=self.restore_from if self.collective else None,
            )
        return WAIT

    def _writer_or_wait(self, learner: str) -> Decision:
        """Collective mode: a checkpoint being held is written by the first learner holding
        the state that asks (until it reports the file, or dies and another takes over)."""
        if not self.collective or learner not in self.synced:
            return WAIT
        task = next((t for t in self._holds if isinstance(t, CheckpointTask)), None)
        if task is None or self._checkpoint_written == task.iteration:
            return WAIT
        if self.checkpoint_writer not in (None, learner):
            return WAIT
        self.checkpoint_writer = learner
        return Decision(Action.CHECKPOINT, checkpoint=task)

    def checkpoint_file_written(self, learner: str, iteration: int) -> bool:
        """Collective mode: ``learner`` wrote its file of the checkpoint after ``iteration``
        iterations. Returns whether it is the file the held checkpoint waits for."""
        task = next((t for t in self._holds if isinstance(t, CheckpointTask)), None)
        if task is None or task.iteration != iteration or self.checkpoint_writer != learner:
            return False
        self._checkpoint_written = iteration
        return True

    def checkpoint_write_failed(self, task: CheckpointTask) -> None:
        """Collective mode: the held checkpoint ``task``'s file was not written (the storage
        refused it) and it stays held (the final one): the next learner holding the state that
        asks writes it again."""
        if task in self._holds:
            self.checkpoint_writer = None
            self._checkpoint_written = -1

    def _freeze(self) -> None:
        """Freeze the generation of iteration ``completed``."""
        survivors = [m for m in self.members if m not in self.retiring and m not in self.evicted]
        leaving = [m for m in self.members if m in self.retiring]
        if (
            self.collective
            and leaving
            and not set(survivors) & self.synced
            and self.completed > max(self.last_checkpoint, 0)
        ):
            # The leaving learners hold the only copy of the state: checkpoint it first.
            self._hold(CheckpointTask(self.completed, self.shape.epoch_of(self.completed)))
            return
        for m in leaving:
            self.retiring.discard(m)
            self.retired.add(m)
        self._apply_pending_batch()
        # The ADASCALE rule's phi, the same for every member of the iteration.
        self.frozen_noise_scale = (self.noise.ready() or 0.0) if self.settings.adaptive else 0.0
        self._admit(survivors)
        if self.collective and self.members and not set(self.members) & self.synced:
            self._rewind()
        c = self.completed
        here = self.shape.position(c)
        every = self.settings.checkpoint_every
        if (
            c > 0
            and here.start == 0
            and every > 0
            and here.epoch % every == 0
            and self.last_checkpoint != c
        ):
            self._hold(CheckpointTask(c, here.epoch))

    def _rewind(self) -> None:
        """Collective mode: no member holds the state (its holders died). Continue from the
        latest checkpoint (or from the start, with rank 0's fresh model, when there is
        none)."""
        target = max(self.last_checkpoint, 0)
        self.restore_from = self.last_checkpoint if self.last_checkpoint >= 0 else None
        # A checkpoint waiting for a writer will never get one: no member holds the state.
        self._holds = [t for t in self._holds if not isinstance(t, CheckpointTask)]
        self.checkpoint_writer = None
        if target != self.completed:
            self._hold(RewindTask(target))
            self._collecting = {k: v for k, v in self._collecting.items() if k < target}
            self.completed = target
            self.samples_processed = self.shape.schedule.samples_before(target)

    def _admit(self, survivors: list[str], *, new_generation: bool = False) -> None:
        members = survivors + [j for j in self.ready if j not in self.evicted]
        self.ready = []
        if members != self.members or new_generation:
            self.generation += 1
            self.members = members
        self._arrived = set()
        self._votes = {}
        self._vote_user = {}
        self.running = bool(self.members)
        if not self.running:
            self._paused = True
        self.ready_shards = set()
        self._grad_sq_norm = 0.0
        self._deferred_commit = False
        self._iteration_started = self._clock()
        self._touch()

    def _assignment(self, learner: str) -> Assignment:
        rank, world = self.members.index(learner), len(self.members)
        here = self.shape.position(self.completed)
        sample_start, sample_end = here.share(rank, world)
        return Assignment(
            generation=self.generation,
            epoch=here.epoch,
            iteration=here.iteration,
            global_iteration=self.completed,
            rank=rank,
            world_size=world,
            sample_start=sample_start,
            sample_end=sample_end,
            batch_samples=here.samples,
            batch_start=here.start,
            global_batch=here.batch,
            gradient_noise_scale=self.frozen_noise_scale,
        )

    # -- membership changes -------------------------------------------------------------------

    def retire(self, learners: Sequence[str]) -> int:
        """Retire ``learners`` at their next boundary (members finish their iteration first;
        ready joiners and learners not seen yet are never admitted). Returns the generation
        from which they are no longer members."""
        for learner in learners:
            if not learner:
                raise InvalidField("learner_ids", learner, "must not be empty")
        for learner in learners:
            if learner in self.evicted or learner in self.retired:
                continue
            if learner in self.members:
                self.retiring.add(learner)
            else:
                if learner in self.ready:
                    self.ready.remove(learner)
                self.retired.add(learner)
        self._touch()
        return self.generation + 1

    def evict(self, learner: str) -> tuple[int, ResolveTask | None]:
        """Remove a dead learner at once. If it is a member of the running iteration, abort
        that iteration and re-freeze the survivors (plus ready joiners) for the same
        iteration. Returns (aborted iteration or -1, the abort to deliver)."""
        if not learner:
            raise InvalidField("learner_id", learner, "must not be empty")
        self.evicted.add(learner)
        self.known.discard(learner)
        self.retiring.discard(learner)
        if learner in self.ready:
            self.ready.remove(learner)
        if learner == self.initializer and not self.initialized:
            self.initializer = None
        if learner == self.checkpoint_writer:
            self.checkpoint_writer = None  # another holder of the state writes it
        self.synced.discard(learner)
        for info in list(self._collecting.values()):
            if learner in info.expected and learner not in info.reports:
                info.expected.discard(learner)
                self._maybe_finish(info)
        self._touch()
        if not (self.running and learner in self.members):
            return -1, None
        k, g = self.completed, self.generation
        survivors = [m for m in self.members if m not in self.evicted]
        self._admit(survivors)
        if self.collective:
            if self.members and not set(self.members) & self.synced:
                self._rewind()
            return k, None  # no shard holds anything of the iteration
        task = ResolveTask(g, k, commit=False)
        self._hold(task)
        return k, task

    def fail(self, learner: str, generation: int) -> bool:
        """Collective mode: ``learner``'s collective in ``generation`` failed (a peer died or
        timed out). Abort the running iteration and re-freeze the members in a new
        generation, so that a new process group forms. Returns whether it aborted."""
        if not (
            self.collective
            and self.running
            and generation == self.generation
            and learner in self.members
        ):
            return False
        self._admit([m for m in self.members if m not in self.evicted], new_generation=True)
        self._touch()
        return True

    def reissue_at(self, generation: int) -> ResolveTask | None:
        """A shard's generation floor drifted above this coordinator's generation, so it
        refuses every contribution of the running iteration as stale: continue in
        ``generation`` (at or above that floor, within this coordinator's epoch:
        ``generation_floor.decide_on_floors``). A running iteration is aborted (no shard
        stepped it) and re-issued to the same members (plus ready joiners) in ``generation``;
        between iterations the next freeze continues from it. Returns the abort to deliver.
        Nothing changes (None) for a generation not above the current one, in collective mode
        (no shard keeps a floor), or while every shard is ready for the running iteration (it
        commits first; a floor still above is acted on at the next report or probe)."""
        if generation <= self.generation or self.collective:
            return None
        if not (self.running and self.members):
            self.generation = generation
            self._touch()
            return None
        if (
            self.shape.sharding is not None
            and len(self.ready_shards) >= self.shape.sharding.active_shards
        ):
            return None
        k, g = self.completed, self.generation
        self.generation = generation - 1
        self._admit(list(self.members), new_generation=True)
        task = ResolveTask(g, k, commit=False)
        self._hold(task)
        return task

    def membership(self, generation: int) -> tuple[tuple[str, ...], int]:
        """Members and iteration of ``generation`` (for shards validating contributions)."""
        if generation < self.generation:
            raise StaleGeneration(
                f"generation ({generation}) of job {self.job_id!r} was superseded by "
                f"{self.generation}"
            )
        if generation > self.generation or not self.members:
            raise FailedPrecondition(
                f"generation ({generation}) of job {self.job_id!r} is not frozen yet "
                f"(current {self.generation})"
            )
        return tuple(self.members), self.completed

    # -- the two-phase commit -----------------------------------------------------------------

    def shard_ready(
        self, shard_index: int, generation: int, iteration: int, grad_sq_norm: float = 0.0
    ) -> ResolveTask | None:
        """A shard holds every member's gradients of (generation, iteration). Returns the
        commit to deliver to every shard once all active shards are ready. ``grad_sq_norm`` is
        the squared norm of the shard's slice of the mean gradient (when the job clips); the
        commit carries the global norm."""
        if self.shape.sharding is None or not 0 <= shard_index < self.shape.sharding.num_shards:
            raise InvalidField("shard_index", shard_index, "is not a shard of the job")
        if not self.shape.sharding.tensors[shard_index]:
            raise InvalidField("shard_index", shard_index, "holds none of the job's tensors")
        if not self.running or generation != self.generation or iteration != self.completed:
            raise StaleGeneration(
                f"iteration {iteration} of generation {generation} is not running in job "
                f"{self.job_id!r} (generation {self.generation}, iteration {self.completed}, "
                f"{'running' if self.running else 'between iterations'})"
            )
        if shard_index not in self.ready_shards:
            self._grad_sq_norm += float(grad_sq_norm)
        self.ready_shards.add(shard_index)
        if len(self.ready_shards) < self.shape.sharding.active_shards:
            return None
        if any(isinstance(t, CheckpointTask) for t in self._holds):
            self._deferred_commit = True  # committed when the checkpoint is written
            return None
        return self._commit()

    def _commit(self) -> ResolveTask:
        g, k = self.generation, self.completed
        now = self._clock()
        for late in [v for v in self._collecting.values() if v.late]:
            # The reports of a lost coordinator's last iteration that came: recorded now
            # (none came: its learners had reported it to the lost coordinator, which recorded
            # it, or they are gone).
            if not late.reports:
                del self._collecting[late.global_iteration]
                continue
            late.seconds = max(now - late.time, 1e-9)
            late.world_size = len(late.reports)
            self._maybe_finish(late)
        # Throughput counts from the previous commit (boundary time included), or from the
        # freeze when the job had no iteration just before (start, resume, no members).
        if self._last_commit_time is None or self._paused:
            start = self._iteration_started
        else:
            start = self._last_commit_time
        seconds = now - start
        self._paused = False
        here = self.shape.position(k)
        samples, epoch, iteration = here.samples, here.epoch, here.iteration
        self._collecting[k] = IterationInfo(
            global_iteration=k,
            epoch=epoch,
            iteration=iteration,
            generation=g,
            world_size=len(self.members),
            samples=samples,
            seconds=max(seconds, 1e-9),
            time=now,
            expected=set(self.members),
        )
        self._recent.append((samples, max(seconds, 1e-9)))
        self._last_commit_time = now
        self.completed += 1
        self.samples_processed += samples
        self.running = False
        self.synced.update(self.members)
        self._deferred_commit = False
        self._touch()
        norm = math.sqrt(self._grad_sq_norm) if self._grad_sq_norm >= 0 else math.inf
        task = ResolveTask(g, k, commit=True, grad_norm=norm if math.isfinite(norm) else math.inf)
        if self.collective:
            votes, self._votes = self._votes, {}
            user, self._vote_user = self._vote_user, {}
            self.restore_from = None  # the members hold the state again
            for member, (loss_sum, n) in votes.items():
                self.report(member, g, k, loss_sum, n, user.get(member))
        else:
            self._hold(task)
        return task

    # -- side effects -------------------------------------------------------------------------

    def _hold(self, task: Task) -> None:
        if task not in self._holds:
            self._holds.append(task)

    @property
    def holds(self) -> tuple[Task, ...]:
        return tuple(self._holds)

    @property
    def commit_in_flight(self) -> bool:
        return any(isinstance(t, ResolveTask) and t.commit for t in self._holds)

    def begin_checkpoint(self) -> CheckpointTask | None:
        """A checkpoint now (CreateCheckpoint): held like a boundary checkpoint, so no shard
        steps while it is written. None when one is already being written. The caller waits
        for :attr:`commit_in_flight` to clear first."""
        if any(isinstance(t, CheckpointTask) for t in self._holds):
            return None
        epoch = self.shape.epoch_of(self.completed)
        task = CheckpointTask(self.completed, epoch)
        self._hold(task)
        return task

    def task_done(self, task: Task, *, ok: bool = True) -> ResolveTask | None:
        """A side effect finished (``ok=False``: it failed and was logged). Returns a commit
        that was deferred behind a checkpoint, if any. A checkpoint no longer held (a rewind
        dropped it) is neither taken for written nor ends the job."""
        held = task in self._holds
        if held:
            self._holds.remove(task)
        follow: ResolveTask | None = None
        if isinstance(task, CheckpointTask):
            self.checkpoint_writer = None
            self._checkpoint_written = -1  # a failed one is written again, by any holder
            if held and (ok or not self.collective):
                self.last_checkpoint = task.iteration
            if held and task.final and (ok or not self.collective):
                self.done = True
            if self._deferred_commit and self.running:
                follow = self._commit()
        self._touch()
        return follow
