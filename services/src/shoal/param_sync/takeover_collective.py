"""Coordinator failover in collective mode (issue 12): what a successor coordinator makes of
the learners that re-join it. Pure, no gRPC, an injected clock; the servicer's ``TakeOverJob``
creates a :class:`CollectiveTakeover` and every re-``Join`` feeds it (docs/data-plane.md,
"Coordinator failover in collective mode").

In collective mode the shards hold nothing of a job: the model and the optimizer are on the
learners, so the successor rebuilds the job's progress from what each re-joining learner says
it holds (``JoinRequest.collective_state``): ``state_step`` (the iterations its state holds)
and ``holds_pending`` (it voted for iteration ``state_step``, i.e. its all-reduce succeeded,
and keeps the reduced update until a Boundary answer says the iteration committed).

**Commit k or run k again.** The old coordinator commits k only once every member voted, and
a learner applies k only once an answer said k committed. So, with S the highest state step
reported:

* a learner at S without a pending update has not voted for S (it waits for its assignment):
  S was not committed. The job continues at S; pending updates of S are dropped (S runs again)
  and a learner at S - 1 holding the pending update of S - 1 applies it (S - 1 was committed,
  since a learner is at S).
* every learner at S holds the pending update of S: S was committed if the old coordinator
  recorded it (``recorded``, its metrics file) or once every member of the last generation
  re-joined (all voted: the old coordinator would have committed, and every member holds the
  same reduced update). The job continues at S + 1 and every pending update is applied. Until
  one of the two is known the decision waits, at most until a deadline; then S runs again
  (a member that was answered the commit and re-joins later is behind no one: it is not a
  holder of the state and receives it by broadcast, as a joiner).

Learners whose state is neither the job's after the decision nor one pending update short of
it (joiners, the late member above) are not holders: the group's formation broadcasts the
state to them. When no learner holds any state the job continues from its latest checkpoint
(the coordinator's existing rewind, ``restore_from``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from shoal.contract.wire import TensorMeta
from shoal.param_sync.coordinator import Coordinator, OptimizerConfig
from shoal.param_sync.coordinator_records import IterationInfo
from shoal.runtime.errors import InvalidField

__all__ = [
    "DEFAULT_SETTLE_S",
    "CollectiveTakeover",
    "LearnerState",
    "Resume",
    "apply_resume",
    "decide_resume",
]

DEFAULT_SETTLE_S = 10.0  # how long a commit-or-rerun question waits for every member


@dataclass(frozen=True)
class LearnerState:
    """What one re-joining learner holds (``JoinRequest.collective_state``)."""

    state_step: int  # iterations its state holds; -1: none
    holds_pending: bool = False  # the voted update of iteration ``state_step``, not applied
    generation: int = 0  # of its last process group
    world_size: int = 0  # members of that group

    def __post_init__(self) -> None:
        if self.state_step < -1:
            raise InvalidField("collective_state.state_step", self.state_step, "must be >= -1")
        if self.holds_pending and self.state_step < 0:
            raise InvalidField("collective_state.holds_pending", True, "needs a state_step >= 0")
        if self.generation < 0 or self.world_size < 0:
            raise InvalidField(
                "collective_state",
                (self.generation, self.world_size),
                "generation and world_size must be >= 0",
            )


@dataclass(frozen=True)
class Resume:
    """Where the job continues: ``completed`` iterations; ``committed``: iteration
    ``completed - 1`` was committed by the successor from the pending updates (its loss
    reports are collected again); ``holders``: the learners holding the job's state once they
    settled their pending update by the answer's ``completed_iterations``."""

    completed: int
    committed: bool = False
    holders: frozenset[str] = frozenset()
    #: When ``committed``: the learners that voted for it, in generation ``vote_generation``
    #: (their re-sent votes are the iteration's loss reports).
    voters: frozenset[str] = frozenset()
    vote_generation: int = 0

    def holds(self, state: LearnerState) -> bool:
        """Whether a learner in ``state`` holds the job's state after settling."""
        return state.state_step == self.completed or (
            state.holds_pending and state.state_step + 1 == self.completed
        )


def _all_members_here(reports: Mapping[str, LearnerState]) -> bool:
    """Every member of the latest generation any learner reports has re-joined."""
    last = max((s.generation for s in reports.values() if s.state_step >= 0), default=0)
    if last <= 0:
        return False
    members = [s for s in reports.values() if s.generation == last]
    return len(members) >= max(s.world_size for s in members)


def decide_resume(
    reports: Mapping[str, LearnerState], *, recorded: int, final: bool = False
) -> Resume | None:
    """The successor's decision from the learners re-joined so far (see the module
    docstring). ``recorded``: the highest iteration in the job's metrics (-1: none);
    ``final``: decide now (the deadline passed). None: not decidable yet."""
    holding = {name: s for name, s in reports.items() if s.state_step >= 0}
    if not holding:
        # Nobody holds the state: the coordinator's rewind (to the latest checkpoint) decides.
        return Resume(max(recorded + 1, 0)) if final else None
    top = max(s.state_step for s in holding.values())
    at_top = [s for s in holding.values() if s.state_step == top]
    if any(not s.holds_pending for s in at_top):
        completed, committed = top, False
    elif recorded >= top or _all_members_here(reports):
        completed, committed = top + 1, True
    elif final:
        completed, committed = top, False
    else:
        return None
    resume = Resume(completed, committed)
    holders = frozenset(name for name, s in holding.items() if resume.holds(s))
    if not committed:
        return Resume(completed, False, holders)
    voters = {name: s for name, s in holding.items() if s.holds_pending and s.state_step == top}
    return Resume(
        completed,
        True,
        holders,
        frozenset(voters),
        max(s.generation for s in voters.values()),
    )


@dataclass
class CollectiveTakeover:
    """A collective job taken over, waiting for its learners (held by the servicer's job
    until the decision is applied to the coordinator)."""

    lost: int  # the lost coordinator's shard
    generation: int  # the first generation number of the new coordinator (epoch << 32)
    last_checkpoint: int  # the latest checkpoint's iteration (-1: none)
    recorded: int  # the highest iteration in metrics/iterations.jsonl (-1: none)
    settle_s: float = DEFAULT_SETTLE_S
    clock: Callable[[], float] = time.monotonic
    reports: dict[str, LearnerState] = field(default_factory=dict)
    resume: Resume | None = None
    _first_report: float | None = None

    def report(self, learner: str, state: LearnerState) -> Resume | None:
        """A learner re-joined holding ``state``. Returns the decision once there is one
        (and the same one after: it never changes)."""
        if not learner:
            raise InvalidField("learner_id", learner, "must not be empty")
        if self.resume is None:
            self.reports[learner] = state
            if self._first_report is None:
                self._first_report = self.clock()
        return self.poll()

    def poll(self) -> Resume | None:
        """Decide if the reports so far allow it, or if the settle time since the first
        report has passed."""
        if self.resume is None and self._first_report is not None:
            final = self.clock() - self._first_report >= self.settle_s
            self.resume = decide_resume(self.reports, recorded=self.recorded, final=final)
        return self.resume

    @property
    def deadline(self) -> float | None:
        """When :meth:`poll` decides at the latest (None: no learner re-joined yet)."""
        if self._first_report is None:
            return None
        return self._first_report + self.settle_s

    def holds(self, state: LearnerState) -> bool:
        """Whether a learner re-joining in ``state`` holds the job's state (after the
        decision)."""
        return self.resume is not None and self.resume.holds(state)


def apply_resume(
    coord: Coordinator,
    takeover: CollectiveTakeover,
    *,
    layout: Sequence[TensorMeta],
    optimizer: OptimizerConfig,
    dataset_size: int,
) -> None:
    """Make ``coord`` (the successor's, empty) the job's coordinator at the decision: the
    layout of the re-joined learners, ``completed`` iterations, generations from the takeover's
    floor, the decided holders ``synced`` (the others receive the state by broadcast when the
    group forms; with none, the first freeze rewinds to the latest checkpoint), and the loss
    reports of an iteration the successor committed collected from the voters' re-sent votes
    (recorded once all came) unless the old coordinator recorded it. The learners join as
    usual after (:meth:`Coordinator.join`)."""
    resume = takeover.resume
    if resume is None:
        raise RuntimeError("apply_resume before the decision")
    completed = resume.completed
    coord.restore(
        layout=layout,
        optimizer=optimizer,
        dataset_size=dataset_size,
        completed=completed,
        samples_processed=0,
        generation=takeover.generation - 1,
    )
    coord.set_mode(True)
    coord.resumed = False
    coord.initialized = True
    coord.samples_processed = coord.shape.schedule.samples_before(completed)
    coord.last_checkpoint = takeover.last_checkpoint
    if resume.committed and takeover.recorded < completed - 1:
        # Its loss reports are the voters' votes, which they send again (same generation).
        k = completed - 1
        epoch, iteration = coord.shape.position(k).epoch, coord.shape.position(k).iteration
        coord._collecting[k] = IterationInfo(
            global_iteration=k,
            epoch=epoch,
            iteration=iteration,
            generation=resume.vote_generation,
            world_size=len(resume.voters),
            samples=coord.shape.batch_samples(k),
            seconds=1e-9,
            time=coord._clock(),
            expected=set(resume.voters),
        )
