"""The data positions of a job whose global batch changes (the opt-in adaptive batch), and
the learning-rate rules that follow the batch. Pure integer arithmetic, no torch: the
coordinator, every learner and the tests compute the same answer without talking.

With a fixed batch ``B`` (every job that does not opt in), iteration ``i`` of an epoch takes the
positions ``[i*B, min((i+1)*B, N))`` of the epoch's order (``shoal.learner.partition``). When
the batch may change, the position is kept **in samples**: a :class:`BatchSchedule` is a list
of :class:`Segment`\\ s, each saying that from global iteration ``step`` on (epoch ``epoch``,
iteration ``iteration`` of that epoch, sample position ``position`` of the epoch's order) the
batch is ``batch``. Within a segment the iterations take consecutive ranges of ``batch``
samples; the last one of an epoch may be short; the next epoch starts at position 0 with the
same batch. A change (:meth:`BatchSchedule.change`) starts a new segment at the position the
next iteration would have started at, so within an epoch no sample is skipped or repeated
whatever the batches were, and the schedule with one segment is exactly the fixed-batch
protocol.

A schedule is part of a job's position: it is saved with checkpoints
(:meth:`BatchSchedule.to_json` / :meth:`BatchSchedule.from_json`, which checks everything it
reads) so a resumed job goes on at the same sample.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from enum import Enum

from shoal.contract.noise_scale import adascale_gain

__all__ = [
    "BatchRule",
    "BatchSchedule",
    "Position",
    "Segment",
    "check_int",
    "scaled_learning_rate",
]

MAX_SEGMENTS = 4096
"""The most batch changes a schedule records (a checkpoint holds them all)."""


class BatchRule(Enum):
    """How the learning rate follows the global batch ``B`` relative to the declared ``B0``."""

    LINEAR = "linear"
    """``lr x B / B0`` (Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet
    in 1 Hour", for SGD with momentum)."""
    SQRT = "sqrt"
    """``lr x sqrt(B / B0)`` (Krizhevsky 2014, "One weird trick"; Hoffer et al. 2017; the
    usual rule for Adam-like optimizers)."""
    ADASCALE = "adascale"
    """``lr x r`` with AdaScale's gain ``r = S (phi + B0) / (phi + B)``, ``S = B / B0``, from
    the measured gradient noise scale ``phi`` (Johnson et al. 2020, "AdaScale SGD";
    ``shoal.contract.noise_scale.adascale_gain``); ``r = 1`` until ``phi`` is measured."""


def scaled_learning_rate(
    lr: float, batch: int, declared: int, rule: BatchRule, noise_scale: float | None = None
) -> float:
    """The learning rate at global batch ``batch`` for a job whose rate is ``lr`` at its
    declared batch ``declared``. Equal to ``lr`` at ``batch == declared``. ``noise_scale``
    (the measured ``phi``, None: not measured) is used by :attr:`BatchRule.ADASCALE` only."""
    if not (isinstance(lr, (int, float)) and not isinstance(lr, bool) and math.isfinite(lr)):
        raise ValueError(f"lr ({lr!r}) must be a finite number")
    check_int("batch", batch, 1)
    check_int("declared", declared, 1)
    ratio = batch / declared
    if rule is BatchRule.LINEAR:
        return lr * ratio
    if rule is BatchRule.SQRT:
        return lr * math.sqrt(ratio)
    if rule is BatchRule.ADASCALE:
        return lr * adascale_gain(noise_scale, batch, declared)
    raise ValueError(f"rule ({rule!r}) must be a BatchRule")


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` if it is an int (not a bool: ``rank=True`` is not rank 1) of at least
    ``minimum``; a ValueError naming ``name`` and the value otherwise. The learner's sample
    partition checks its arguments with it too."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} ({value!r}) must be an int")
    if value < minimum:
        raise ValueError(f"{name} ({value}) must be >= {minimum}")
    return value


@dataclass(frozen=True, slots=True)
class Segment:
    """From global iteration ``step`` on (iteration ``iteration`` of epoch ``epoch``, starting
    at sample ``position`` of the epoch's order) the global batch is ``batch``."""

    step: int
    epoch: int
    iteration: int
    position: int
    batch: int


@dataclass(frozen=True, slots=True)
class Position:
    """Where global iteration ``step`` stands: iteration ``iteration`` of epoch ``epoch``,
    taking the positions ``[start, stop)`` of the epoch's order, with global batch ``batch``
    (``stop - start`` is smaller only for an epoch's last iteration)."""

    step: int
    epoch: int
    iteration: int
    start: int
    stop: int
    batch: int

    @property
    def samples(self) -> int:
        return self.stop - self.start

    def share(self, rank: int, world_size: int) -> tuple[int, int]:
        """Positions ``[start, stop)`` of rank ``rank`` of ``world_size``:
        ``[start + r*b//W, start + (r+1)*b//W)``, as with a fixed batch."""
        check_int("world_size", world_size, 1)
        check_int("rank", rank, 0)
        if rank >= world_size:
            raise ValueError(f"rank ({rank}) must be < world_size ({world_size})")
        b = self.samples
        return self.start + rank * b // world_size, self.start + (rank + 1) * b // world_size


class BatchSchedule:
    """The batches of a job over its global iterations (see the module docstring)."""

    def __init__(self, num_samples: int, segments: list[Segment]) -> None:
        self.num_samples = check_int("num_samples", num_samples, 1)
        if not segments:
            raise ValueError("segments must not be empty")
        if len(segments) > MAX_SEGMENTS:
            raise ValueError(f"segments ({len(segments)}) must be at most {MAX_SEGMENTS}")
        first = segments[0]
        if (first.step, first.epoch, first.iteration, first.position) != (0, 0, 0, 0):
            raise ValueError(f"the first segment ({first}) must start at step 0, position 0")
        for i, seg in enumerate(segments):
            for name in ("step", "epoch", "iteration", "position"):
                check_int(f"segments[{i}].{name}", getattr(seg, name), 0)
            check_int(f"segments[{i}].batch", seg.batch, 1)
            if seg.position >= num_samples:
                raise ValueError(
                    f"segments[{i}].position ({seg.position}) must be < num_samples ({num_samples})"
                )
        self.segments = list(segments[:1])
        for i, seg in enumerate(segments[1:], start=1):
            prev = self.segments[-1]
            if seg.step <= prev.step:
                raise ValueError(
                    f"segments[{i}].step ({seg.step}) must be > the previous ({prev.step})"
                )
            # The segment must start where the previous one's batches left off.
            here = self._locate_in(prev, seg.step)
            if (here.epoch, here.iteration, here.start) != (seg.epoch, seg.iteration, seg.position):
                raise ValueError(
                    f"segments[{i}] ({seg}) does not start where the previous batches end "
                    f"(epoch {here.epoch}, iteration {here.iteration}, position {here.start})"
                )
            self.segments.append(seg)

    @classmethod
    def fixed(cls, num_samples: int, batch: int) -> BatchSchedule:
        """The schedule of a job whose batch never changes."""
        return cls(num_samples, [Segment(0, 0, 0, 0, check_int("batch", batch, 1))])

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, BatchSchedule)
            and self.num_samples == other.num_samples
            and self.segments == other.segments
        )

    def __repr__(self) -> str:
        return f"BatchSchedule({self.num_samples}, {self.segments!r})"

    def _segment(self, step: int) -> Segment:
        check_int("step", step, 0)
        lo, hi = 0, len(self.segments)
        while hi - lo > 1:  # the last segment whose step is <= step
            mid = (lo + hi) // 2
            if self.segments[mid].step <= step:
                lo = mid
            else:
                hi = mid
        return self.segments[lo]

    def _locate_in(self, seg: Segment, step: int) -> Position:
        n, b = self.num_samples, seg.batch
        offset = step - seg.step
        left = -(-(n - seg.position) // b)  # iterations left in the segment's first epoch
        if offset < left:
            epoch, iteration = seg.epoch, seg.iteration + offset
            start = seg.position + offset * b
        else:
            per_epoch = -(-n // b)
            more_epochs, i = divmod(offset - left, per_epoch)
            epoch, iteration, start = seg.epoch + 1 + more_epochs, i, i * b
        return Position(step, epoch, iteration, start, min(start + b, n), b)

    def locate(self, step: int) -> Position:
        """Where global iteration ``step`` stands."""
        return self._locate_in(self._segment(step), step)

    def batch_at(self, step: int) -> int:
        return self._segment(step).batch

    def total_iterations(self, epochs: int) -> int:
        """The number of global iterations of ``epochs`` epochs (the job's length) with the
        current last batch."""
        check_int("epochs", epochs, 1)
        seg = self.segments[-1]
        if seg.epoch >= epochs:
            raise ValueError(f"epochs ({epochs}) must be > the last segment's epoch ({seg.epoch})")
        n, b = self.num_samples, seg.batch
        left = -(-(n - seg.position) // b)
        return seg.step + left + (epochs - seg.epoch - 1) * -(-n // b)

    def is_last_of_epoch(self, step: int) -> bool:
        """Whether global iteration ``step`` ends its epoch."""
        return self.locate(step).stop == self.num_samples

    def samples_before(self, step: int) -> int:
        """Samples processed by the iterations before ``step`` (over all epochs)."""
        pos = self.locate(step)
        return pos.epoch * self.num_samples + pos.start

    def change(self, step: int, batch: int) -> BatchSchedule:
        """This schedule with the batch ``batch`` from global iteration ``step`` on (a
        boundary: ``step`` has not run). The iterations before ``step`` keep their positions;
        ``step`` starts where the previous batch would have. Iterations after ``step`` that
        an earlier schedule had planned are forgotten. Unchanged if ``batch`` is already the
        batch at ``step``."""
        check_int("batch", batch, 1)
        if self.batch_at(step) == batch:
            return self
        here = self.locate(step)
        kept = [s for s in self.segments if s.step < step]
        return BatchSchedule(
            self.num_samples, [*kept, Segment(step, here.epoch, here.iteration, here.start, batch)]
        )

    # -- persistence --------------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(
            {
                "num_samples": self.num_samples,
                "segments": [
                    [s.step, s.epoch, s.iteration, s.position, s.batch] for s in self.segments
                ],
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> BatchSchedule:
        """A schedule saved by :meth:`to_json`; ``ValueError`` naming what is wrong with
        anything else (it comes from storage: nothing is trusted)."""
        try:
            data = json.loads(text)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"batch schedule is not JSON: {exc}") from exc
        if not isinstance(data, dict) or set(data) != {"num_samples", "segments"}:
            raise ValueError("batch schedule must be an object with num_samples and segments")
        rows = data["segments"]
        if not isinstance(rows, list) or len(rows) > MAX_SEGMENTS:
            raise ValueError(f"batch schedule segments must be a list of at most {MAX_SEGMENTS}")
        segments = []
        for i, row in enumerate(rows):
            if not isinstance(row, list) or len(row) != 5:
                raise ValueError(f"segments[{i}] ({row!r}) must be 5 integers")
            segments.append(Segment(*row))
        return cls(data["num_samples"], segments)
