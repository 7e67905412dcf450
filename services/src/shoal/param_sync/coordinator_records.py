"""What a job's coordinator takes and gives: the job's settings, the optimizer config, the
decisions and assignments it hands learners, the side-effect tasks it asks the service to
perform, the learners' ``trainer.log`` values, and the checks of a Join's job description
(:func:`check_shape`, :func:`check_same_shape`).

Plain frozen dataclasses and pure functions, no state: the state machine is
:class:`~shoal.param_sync.coordinator.Coordinator`, and ``coordinator.py`` re-exports every
public name here, so ``from shoal.param_sync.coordinator import ...`` keeps working.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from shoal.contract import user_metrics
from shoal.contract.wire import TensorMeta, validate_layout
from shoal.param_sync.sharding import Sharding
from shoal.runtime.errors import InvalidField


@dataclass(frozen=True)
class JobSettings:
    """A job's data-plane settings (from ``OpenJob``)."""

    job_id: str
    batch_size: int
    epochs: int
    seed: int = 0
    checkpoint_every: int = 0  # epochs; 0: only at the end
    keep_checkpoints: int = 0  # complete checkpoints kept; 0: checkpoint.DEFAULT_KEEP
    keep_every: int = 0  # every Nth checkpoint is also kept for good; 0: none
    storage_uri: str = ""
    shard_addresses: tuple[str, ...] = ()
    # The adaptive batch's bounds (spec.adaptive_batch); 0, 0: the batch is fixed.
    min_batch: int = 0
    max_batch: int = 0

    def __post_init__(self) -> None:
        if not self.job_id:
            raise InvalidField("job_id", self.job_id, "must not be empty")
        if self.batch_size < 1:
            raise InvalidField("spec.batch_size", self.batch_size, "must be >= 1")
        if self.epochs < 1:
            raise InvalidField("spec.epochs", self.epochs, "must be >= 1")
        if self.seed < 0:
            raise InvalidField("spec.seed", self.seed, "must be >= 0")
        if self.checkpoint_every < 0:
            raise InvalidField("spec.checkpoint_every", self.checkpoint_every, "must be >= 0")
        if self.keep_checkpoints < 0:
            raise InvalidField("spec.keep_checkpoints", self.keep_checkpoints, "must be >= 0")
        if self.keep_every < 0:
            raise InvalidField("spec.keep_every_nth_checkpoint", self.keep_every, "must be >= 0")
        if (self.min_batch, self.max_batch) != (0, 0) and not (
            1 <= self.min_batch <= self.batch_size <= self.max_batch
        ):
            raise InvalidField(
                "spec.adaptive_batch",
                [self.min_batch, self.max_batch],
                f"must satisfy 1 <= min_global_batch <= batch_size ({self.batch_size}) "
                "<= max_global_batch",
            )
        if not self.shard_addresses:
            raise InvalidField("shard_addresses", [], "must name at least one shard")

    @property
    def adaptive(self) -> bool:
        """Whether the job opted in to the adaptive batch."""
        return self.max_batch > 0

    @property
    def num_shards(self) -> int:
        return len(self.shard_addresses)


@dataclass(frozen=True)
class OptimizerConfig:
    name: str
    hyperparameters_json: str = "{}"
    #: Clip the job's global gradient to this 2-norm before every step (0: no clipping).
    clip_grad_norm: float = 0.0
    #: Skip the step of an iteration whose global gradient is not finite (float16 scaling).
    skip_nonfinite: bool = False
    #: Parameter groups, JSON ``[[names, overrides], ...]`` ("": one group); see
    #: ``shard.build_optimizer``.
    param_groups_json: str = ""
    #: Report the global gradient's norm without clipping or skipping (an adaptive-batch
    #: job measures its gradient noise scale from it).
    measure_grad_norm: bool = False

    @property
    def needs_norm(self) -> bool:
        """Whether the shards report their slices' norms (clipping, skipping, measuring)."""
        return self.clip_grad_norm > 0 or self.skip_nonfinite or self.measure_grad_norm


@dataclass(frozen=True)
class Assignment:
    generation: int
    epoch: int
    iteration: int
    global_iteration: int
    rank: int
    world_size: int
    sample_start: int
    sample_end: int
    batch_samples: int
    batch_start: int = 0  # the first position of the global batch in the epoch's order
    global_batch: int = 0  # the global batch B of the iteration (batch_samples < B: short)
    gradient_noise_scale: float = 0.0  # the measured phi frozen with the iteration (0: none)


class Action(enum.Enum):
    RUN = "run"
    RETIRE = "retire"
    DONE = "done"
    WAIT = "wait"
    CHECKPOINT = "checkpoint"  # collective mode: write the checkpoint ``Decision.checkpoint``


@dataclass(frozen=True)
class Decision:
    action: Action
    assignment: Assignment | None = None
    pull: bool = False
    checkpoint: CheckpointTask | None = None  # for CHECKPOINT
    restore: int | None = None  # collective RUN: no member holds the state; load this one


WAIT = Decision(Action.WAIT)


@dataclass(frozen=True)
class JoinOutcome:
    initialize: bool
    sharding: Sharding


@dataclass(frozen=True)
class ResolveTask:
    """Tell every shard to commit (step) or abort (drop) iteration ``iteration`` of
    ``generation``."""

    generation: int
    iteration: int
    commit: bool
    #: With commit, when the job clips: the 2-norm of the whole mean gradient (+inf when not
    #: finite, so that tasks stay comparable).
    grad_norm: float = 0.0


@dataclass(frozen=True)
class CheckpointTask:
    """Write a checkpoint holding ``iteration`` completed iterations (``final``: the last one,
    followed by the whole model)."""

    iteration: int
    epoch: int
    final: bool = False


@dataclass(frozen=True)
class RewindTask:
    """Collective mode: every learner holding the job's state is gone, so the job continues
    from the checkpoint after ``iteration`` iterations; the records of later iterations are
    dropped before anyone runs again."""

    iteration: int


@dataclass(frozen=True)
class RecoverTask:
    """Parameter-server mode: shard ``shard_index`` was found unreachable or without its slice
    of the job (``reason``). Held until the shard answers again: then either nothing was lost
    or every shard rewinds to the latest checkpoint."""

    shard_index: int
    reason: str


@dataclass(frozen=True)
class ScheduleTask:
    """A job with an adaptive batch changed its batch from iteration ``iteration`` on: store
    the job's batch schedule (``schedule_json``, ``BatchSchedule.to_json``) where a successor
    coordinator finds it, before any learner runs at the new batch."""

    iteration: int
    schedule_json: str


Task = ResolveTask | CheckpointTask | RewindTask | RecoverTask | ScheduleTask


UserMetrics = Mapping[str, tuple[float, int]]
"""A learner's ``trainer.log`` values of one iteration: name -> (sum of value x samples,
samples)."""

#: At most this many names per report; a name is 1-64 characters of ``[A-Za-z0-9_./-]``.
MAX_USER_METRICS = user_metrics.MAX_NAMES


def check_user_metrics(sums: Mapping[str, float], samples: Mapping[str, int]) -> UserMetrics:
    """The learner's ``metric_sums`` / ``metric_samples`` as :data:`UserMetrics`, checked.

    Raises:
        InvalidField: too many names, a bad name, a name in one map only, a count < 1 or a
            non-finite sum.
    """
    if len(sums) > MAX_USER_METRICS:
        raise InvalidField("metric_sums", len(sums), f"must name at most {MAX_USER_METRICS}")
    if set(sums) != set(samples):
        raise InvalidField(
            "metric_samples", sorted(set(sums) ^ set(samples)), "must name what metric_sums does"
        )
    out: dict[str, tuple[float, int]] = {}
    for name, total in sums.items():
        if not user_metrics.NAME_PATTERN.fullmatch(name):
            raise InvalidField("metric_sums", name, f"names are {user_metrics.NAME_RULE}")
        count = samples[name]
        if count < 1 or not math.isfinite(total):
            raise InvalidField(f"metric_sums[{name}]", (total, count), "must be finite, >= 1")
        out[name] = (float(total), int(count))
    return out


def mean_user_metrics(reports: Iterable[UserMetrics]) -> dict[str, float]:
    """The sample-weighted mean of each name over the members that logged it."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for metrics in reports:
        for name, (total, count) in metrics.items():
            sums[name] = sums.get(name, 0.0) + total
            counts[name] = counts.get(name, 0) + count
    return {name: sums[name] / counts[name] for name in sorted(sums)}


@dataclass
class IterationInfo:
    """A committed iteration whose loss is being collected from its members' reports."""

    global_iteration: int
    epoch: int
    iteration: int
    generation: int
    world_size: int
    samples: int
    seconds: float
    time: float
    expected: set[str]
    reports: dict[str, tuple[float, int]] = field(default_factory=dict)
    user: dict[str, UserMetrics] = field(default_factory=dict)  # trainer.log, per member
    #: The last iteration a lost coordinator committed (:meth:`Coordinator.take_over`): its
    #: members are not known here, so any learner's report counts, until the next commit.
    late: bool = False


def check_shape(
    layout: Sequence[TensorMeta], optimizer: OptimizerConfig, dataset_size: int
) -> None:
    """Check the first Join's job description on its own (a layout with a parameter, laid
    out contiguously; a dataset; an optimizer name). Raises :class:`InvalidField`."""
    if not layout:
        raise InvalidField("layout", [], "must hold at least one tensor")
    if not any(not m.buffer for m in layout):
        raise InvalidField("layout", len(layout), "must hold at least one parameter")
    try:
        validate_layout(layout, max(m.end for m in layout), what="layout")
    except ValueError as exc:
        raise InvalidField("layout", "...", str(exc)) from None
    if dataset_size < 1:
        raise InvalidField("dataset_size", dataset_size, "must be >= 1")
    if not optimizer.name:
        raise InvalidField("optimizer.name", optimizer.name, "must name a torch.optim class")


def check_same_shape(
    job_layout: tuple[TensorMeta, ...],
    job_optimizer: OptimizerConfig | None,
    job_dataset_size: int | None,
    layout: Sequence[TensorMeta],
    optimizer: OptimizerConfig,
    dataset_size: int,
) -> None:
    """Check a later Join's job description against the job's: the same layout, optimizer
    and dataset size. Raises :class:`InvalidField` naming the first difference."""
    if tuple(layout) != job_layout:
        if len(layout) != len(job_layout):
            raise InvalidField(
                "layout",
                f"{len(layout)} tensors",
                f"differs from the job's layout ({len(job_layout)} tensors)",
            )
        for i, (mine, theirs) in enumerate(zip(job_layout, layout, strict=True)):
            if mine != theirs:
                raise InvalidField(
                    f"layout[{i}]",
                    f"{theirs.name} {theirs.dtype} {list(theirs.shape)} @{theirs.offset}",
                    f"differs from the job's ({mine.name} {mine.dtype} {list(mine.shape)} "
                    f"@{mine.offset})",
                )
    if optimizer != job_optimizer:
        assert job_optimizer is not None
        raise InvalidField(
            "optimizer",
            f"{optimizer.name} {optimizer.hyperparameters_json}",
            f"differs from the job's ({job_optimizer.name} {job_optimizer.hyperparameters_json})",
        )
    if dataset_size != job_dataset_size:
        raise InvalidField(
            "dataset_size", dataset_size, f"differs from the job's ({job_dataset_size})"
        )


@dataclass
class IterationSplit:
    """The learners' recent compute/sync seconds per iteration (``shoal.compute_s`` and
    ``shoal.sync_s`` among an iteration's metrics, sample-weighted over its learners): a
    running mean, exponential after 5 iterations, restarted when the world size changes.
    ``JobProgress.compute_seconds`` / ``sync_seconds`` report it for the current world size."""

    world_size: int = 0
    compute_s: float = 0.0
    sync_s: float = 0.0
    count: int = 0
    sync_count: int = 0

    def add(self, world_size: int, values: Mapping[str, float]) -> None:
        compute = values.get(user_metrics.COMPUTE_SECONDS)
        if compute is None or not (math.isfinite(compute) and compute >= 0):
            return
        if world_size != self.world_size:
            self.world_size, self.count, self.sync_count = world_size, 0, 0
            self.compute_s = self.sync_s = 0.0
        self.count += 1
        self.compute_s += (compute - self.compute_s) / min(self.count, 5)
        sync = values.get(user_metrics.SYNC_SECONDS)
        if sync is not None and math.isfinite(sync) and sync >= 0:
            self.sync_count += 1
            self.sync_s += (sync - self.sync_s) / min(self.sync_count, 5)

    def at(self, world_size: int) -> tuple[float, float]:
        """(compute, sync) seconds at ``world_size``; zeros when not reported there."""
        if world_size != self.world_size or self.count == 0:
            return 0.0, 0.0
        return self.compute_s, self.sync_s
