"""What a successor coordinator makes of the shards it found (coordinator failover, issue 12).

Pure decisions, no gRPC: the servicer's ``TakeOverJob`` asks every shard left for its state
(``SetCoordinator`` with ``keep_pending``), then :func:`plan_takeover` says at which iteration the
job continues and what to do with sums still in flight, and :func:`sharding_after_takeover`
rebuilds the job's sharding from what each shard holds (after an earlier promotion it is not
the hash rule's any more).

**A coordinator lost in the middle of a commit.** The old coordinator sends
``ResolveIteration(commit)`` for iteration k to every shard only once every shard is ready, i.e.
holds every member's sums of k. If it dies while delivering, some shards stepped k (they are at
k + 1) and the others still hold those complete sums (the takeover keeps them): the successor
commits k on them too, with the global gradient norm the others used, and the job continues at
k + 1 with nothing lost. If no shard left stepped k, nobody did (the lost shard's commit is
recovered from its replica, which settles to the successor's count), and the sums are dropped:
k runs again.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from shoal.contract.wire import TensorMeta
from shoal.param_sync.sharding import Sharding
from shoal.runtime.errors import FailedPrecondition

__all__ = [
    "PendingAction",
    "ShardState",
    "TakeoverPlan",
    "pending_on_move",
    "plan_takeover",
    "sharding_after_takeover",
]


class PendingAction(enum.Enum):
    """What a shard does with the sums it holds when told where the coordinator is
    (``SetCoordinator``): see :func:`pending_on_move`."""

    NONE = "none"  # it holds no sums
    KEEP_FOR_SUCCESSOR = "keep for the successor"  # a takeover asks; it resolves them
    ABORT = "abort"  # an older coordinator's, never committed: run again by the new one
    KEEP = "keep"  # the (new) coordinator's own running iteration: untouched


def pending_on_move(
    pending_generation: int | None, *, keep: bool, min_generation: int
) -> PendingAction:
    """The sums of ``pending_generation`` a shard holds, when a coordinator tells it that it
    coordinates the job and that its generations start at ``min_generation``
    (``SetCoordinator``; ``keep``: a takeover that resolves them itself).

    Only sums of a generation below ``min_generation`` are an older coordinator's and are
    dropped. Sums at or above it belong to the coordinator that is telling: it is running
    that iteration. Dropping them (the bug behind issue 12's livelock) raised the shard's
    generation floor above the running generation without the coordinator knowing: after a
    takeover, the new coordinator's deposer reached the restarted old coordinator's shard
    once its slice had been restored there and an iteration was running; the shard then
    refused every contribution of that iteration as stale, the coordinator re-issued it
    unchanged at every boundary, and the learners looped ~50 times a second, for ever."""
    if pending_generation is None:
        return PendingAction.NONE
    if keep:
        return PendingAction.KEEP_FOR_SUCCESSOR
    if pending_generation < min_generation:
        return PendingAction.ABORT
    return PendingAction.KEEP


@dataclass(frozen=True)
class ShardState:
    """One shard left, as its ``SetCoordinatorResponse`` says."""

    completed: int  # iterations its slice stepped; -1: it holds no slice
    tensors: tuple[str, ...] = ()
    pending: tuple[int, int] | None = None  # (generation, iteration) of sums it kept
    last_grad_norm: float = 0.0


@dataclass(frozen=True)
class TakeoverPlan:
    """Where the job continues: ``completed`` iterations on every shard left, after the
    ``commits`` (shard -> (generation, iteration) to commit there, with ``grad_norm``) and the
    ``aborts`` (shard -> sums to drop)."""

    completed: int
    commits: dict[int, tuple[int, int]] = field(default_factory=dict)
    aborts: dict[int, tuple[int, int]] = field(default_factory=dict)
    grad_norm: float = 0.0


def plan_takeover(job_id: str, states: Mapping[int, ShardState]) -> TakeoverPlan:
    """Decide the successor's starting point from the states of the shards left that hold a
    slice (see the module docstring). Raises FailedPrecondition when they do not hold one
    state it can continue from (then the job resumes from its latest checkpoint)."""
    held = {i: s for i, s in states.items() if s.completed >= 0}
    at = {i: s.completed for i, s in held.items()}
    values = sorted(set(at.values()))
    if not values or len(values) > 2 or (len(values) == 2 and values[1] != values[0] + 1):
        raise FailedPrecondition(
            f"the shards left of job {job_id!r} do not hold one state (iterations by shard: "
            f"{at or 'none'}); resume it from its latest checkpoint instead"
        )
    if len(values) == 1:
        aborts = {i: s.pending for i, s in held.items() if s.pending is not None}
        return TakeoverPlan(values[0], aborts=aborts)
    k = values[0]
    ahead = {i: s for i, s in held.items() if s.completed == k + 1}
    behind = {i: s for i, s in held.items() if s.completed == k}
    norms = {s.last_grad_norm for s in ahead.values()}
    kept = {s.pending for s in behind.values()}
    if len(norms) != 1 or len(kept) != 1 or None in kept or next(iter(kept))[1] != k:  # type: ignore[index]
        raise FailedPrecondition(
            f"job {job_id!r}'s coordinator was lost while it committed iteration {k}, and the "
            f"shards still at {k} do not all hold its sums (kept: "
            f"{ {i: s.pending for i, s in behind.items()} }, norms {sorted(norms)}); resume it "
            "from its latest checkpoint instead"
        )
    pending = next(iter(kept))
    assert pending is not None
    aborts = {i: s.pending for i, s in ahead.items() if s.pending is not None}
    return TakeoverPlan(
        k + 1,
        commits=dict.fromkeys(behind, pending),
        aborts=aborts,
        grad_norm=next(iter(norms)),
    )


def sharding_after_takeover(
    layout: Sequence[TensorMeta], held: Mapping[int, Sequence[str]], lost: int, num_shards: int
) -> Sharding:
    """The job's sharding as the shards left hold it (``held``: shard -> its tensors; a shard
    that did not answer is taken to hold nothing, as after an earlier promotion of its slice),
    the lost shard holding every other tensor. If an unanswering shard did hold a slice, the
    lost shard's part is wrong, and recovering it fails on its replica's names (two slices
    lost at once: the checkpoint path)."""
    names = [m.name for m in layout]
    known = set(names)
    owner: dict[str, int] = {}
    for i, tensors in held.items():
        if not 0 <= i < num_shards or i == lost:
            raise ValueError(f"shard {i} is not a shard left of {num_shards} (lost: {lost})")
        for name in tensors:
            if name not in known or name in owner:
                raise FailedPrecondition(
                    f"shard {i} holds {name!r}, which is "
                    + ("not in the job's layout" if name not in known else f"shard {owner[name]}'s")
                )
            owner[name] = i
    size = {m.name: m.nbytes for m in layout}
    tensors = tuple(tuple(n for n in names if owner.get(n, lost) == i) for i in range(num_shards))
    loads = tuple(sum(size[n] for n in t) for t in tensors)
    return Sharding(tensors, loads)
