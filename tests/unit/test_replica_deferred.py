"""A replica that defers its steps (docs/data-plane.md, "The replica's steps deferred"): it
keeps each committed iteration's sums instead of stepping them, a snapshot of the primary's
state drops the ones it covers, and whatever uses the replica steps what is left first, so the
state it hands over is bit for bit the primary's."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

from shoal.contract.wire import TensorMeta, pack_layout
from shoal.param_sync.coordinator import OptimizerConfig
from shoal.param_sync.shard import ShardJob
from shoal.runtime.errors import FailedPrecondition, InvalidField
from tests.unit.test_shard_replication import METAS, assert_same_state, contribution

SGD = OptimizerConfig("SGD", '{"lr": 0.1, "momentum": 0.9, "nesterov": true}', clip_grad_norm=0.5)
ADAM = OptimizerConfig("Adam", '{"lr": 0.01}')


def pair(config: OptimizerConfig, limit: int) -> tuple[ShardJob, ShardJob]:
    torch.manual_seed(3)
    layout, _ = pack_layout(METAS)
    primary, replica = ShardJob("job-1", 1, layout, config), ShardJob("job-1", 1, layout, config)
    primary.initialize(contribution(primary, "init", 0, [torch.randn(m.shape) for m in METAS], 0))
    replica.load_state_bytes(primary.state_bytes(0))
    replica.defer_limit = limit
    return primary, replica


def run(primary: ShardJob, replica: ShardJob, k: int, *, generation: int = 1) -> None:
    """Iteration k: the primary's sums to the replica, the commit on both (global norm 2.5)."""
    grads = [torch.randn(m.shape) for m in METAS]
    c = contribution(primary, "a", k, grads, 3)
    c.generation = generation
    primary.accumulate(c, frozenset("a"))
    replica.keep_pending(primary.pending_bytes(generation, k))
    primary.commit(generation, k, 2.5)
    assert replica.apply_replicated(generation, k, 2.5)


def snapshot(sj: ShardJob) -> bytes:
    header, views = sj.state_frames(sj.completed)
    return b"".join([header, *views])


def params(sj: ShardJob) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in sj.named_tensors().items()}


@pytest.mark.parametrize("config", [SGD, ADAM], ids=["sgd", "adam"])
def test_deferred_steps_are_counted_not_taken_and_the_settled_replica_is_the_primary(
    config: OptimizerConfig,
) -> None:
    primary, replica = pair(config, limit=8)
    before = params(replica)
    for k in range(6):
        run(primary, replica, k)
    assert replica.completed == primary.completed == 6
    assert len(replica.deferred) == 6  # nothing stepped yet
    assert all(torch.equal(before[n], t) for n, t in replica.named_tensors().items())
    replica.settle(6, 2.5)
    assert not replica.deferred
    assert_same_state(primary, replica, 6)  # optimizer state included


def test_sums_beyond_the_limit_are_stepped_oldest_first() -> None:
    primary, replica = pair(SGD, limit=2)
    for k in range(5):
        run(primary, replica, k)
        assert len(replica.deferred) == min(k + 1, 2)
    assert [d.pending.iteration for d in replica.deferred] == [3, 4]
    assert_same_state(primary, replica, 5)  # state_bytes steps the rest first


def test_next_sums_count_the_previous_as_committed_without_stepping_them() -> None:
    """The primary sends iteration k + 1's sums only once it committed k: a replica that has
    not seen its own commit of k yet keeps k's sums deferred, not stepped."""
    primary, replica = pair(SGD, limit=8)
    for k in range(3):
        primary.accumulate(
            contribution(primary, "a", k, [torch.randn(m.shape) for m in METAS], 2), frozenset("a")
        )
        assert replica.keep_pending(primary.pending_bytes(1, k)) == k
        primary.commit(1, k, 2.5)
    assert [d.pending.iteration for d in replica.deferred] == [0, 1]
    replica.settle(3, primary.last_grad_norm)
    assert_same_state(primary, replica, 3)


@pytest.mark.parametrize("config", [SGD, ADAM], ids=["sgd", "adam"])
def test_a_snapshot_drops_the_sums_it_covers_and_keeps_the_later_ones(
    config: OptimizerConfig,
) -> None:
    primary, replica = pair(config, limit=8)
    for k in range(3):
        run(primary, replica, k)
    blob = snapshot(primary)  # at iteration 3
    # The blob is a safetensors file with state_bytes' tensors.
    assert (
        safetensors.torch.load(blob).keys() == safetensors.torch.load(primary.state_bytes(3)).keys()
    )
    for k in range(3, 5):
        run(primary, replica, k)
    assert replica.take_snapshot(blob)
    assert [d.pending.iteration for d in replica.deferred] == [3, 4]
    assert replica.completed == 5
    run(primary, replica, 5)
    assert_same_state(primary, replica, 6)


def test_a_snapshot_of_the_iteration_whose_sums_the_replica_holds_replaces_them() -> None:
    primary, replica = pair(SGD, limit=8)
    run(primary, replica, 0)
    primary.accumulate(
        contribution(primary, "a", 1, [torch.randn(m.shape) for m in METAS], 2), frozenset("a")
    )
    replica.keep_pending(primary.pending_bytes(1, 1))
    primary.commit(1, 1, 2.5)  # the replica has not seen its own commit of 1 yet
    assert replica.take_snapshot(snapshot(primary))
    assert replica.completed == 2 and replica.pending is None and not replica.deferred
    assert not replica.apply_replicated(1, 1, 2.5)  # covered by the snapshot
    assert_same_state(primary, replica, 2)


def test_snapshots_it_cannot_place_are_ignored_and_change_nothing() -> None:
    primary, replica = pair(SGD, limit=8)
    run(primary, replica, 0)
    old = snapshot(primary)  # at 1
    run(primary, replica, 1)
    replica.settle(2, 2.5)  # stepped: 1 is applied
    assert not replica.take_snapshot(old)
    ahead_primary, _ = pair(SGD, limit=0)
    for k in range(4):
        ahead_primary.accumulate(
            contribution(ahead_primary, "a", k, [torch.randn(m.shape) for m in METAS], 2),
            frozenset("a"),
        )
        ahead_primary.commit(1, k, 1.0)
    before = safetensors.torch.load(replica.state_bytes(2))
    # From ahead (a rewound replica, a snapshot sent before the rewind): not taken.
    assert not replica.take_snapshot(snapshot(ahead_primary))
    after = safetensors.torch.load(replica.state_bytes(2))
    assert replica.completed == 2
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_a_snapshot_rewritten_while_taken_is_refused() -> None:
    primary, replica = pair(SGD, limit=8)
    for k in range(2):
        run(primary, replica, k)
    with pytest.raises(FailedPrecondition, match="rewritten"):
        replica.take_snapshot(snapshot(primary), still_there=lambda: False)
    assert len(replica.deferred) == 2 and replica.completed == 2
    assert_same_state(primary, replica, 2)


def test_a_load_drops_the_deferred_sums() -> None:
    primary, replica = pair(SGD, limit=8)
    saved = primary.state_bytes(0)
    for k in range(2):
        run(primary, replica, k)
    assert replica.load_state_bytes(saved) == 0
    assert not replica.deferred and replica.completed == 0


def test_state_frames_align_each_tensor() -> None:
    metas = [
        TensorMeta("h", "float16", (3,), 0, 6),
        TensorMeta("d", "float64", (2,), 0, 16),
        TensorMeta("n", "int64", (1,), 0, 8, buffer=True),
    ]
    layout, _ = pack_layout(metas)
    sj = ShardJob("job-1", 0, layout, ADAM)
    sj.initialize(
        contribution(
            sj,
            "init",
            0,
            [
                torch.ones(3, dtype=torch.float16),
                torch.ones(2, dtype=torch.float64),
                torch.ones(1, dtype=torch.int64),
            ],
            0,
        )
    )
    header, views = sj.state_frames(0)
    assert len(header) % 8 == 0
    entries = json.loads(header[8:])
    entries.pop("__metadata__")
    sizes = {"F64": 8, "I64": 8, "F32": 4, "F16": 2}
    for name, entry in entries.items():
        assert entry["data_offsets"][0] % sizes[entry["dtype"]] == 0, name
    loaded = safetensors.torch.load(b"".join([header, *views]))
    assert torch.equal(loaded["param/d"], torch.ones(2, dtype=torch.float64))


def test_a_snapshot_of_another_slice_is_refused_and_changes_nothing() -> None:
    """Tensors that are not the replica's slice (another layout) are refused before the
    replica's state or the sums it kept are touched."""
    primary, replica = pair(SGD, limit=8)
    for k in range(2):
        run(primary, replica, k)
    other_metas = [TensorMeta("w", "float32", (4, 3), 0, 48), *METAS[1:]]
    layout, _ = pack_layout(other_metas)
    other = ShardJob("job-1", 1, layout, SGD)
    other.initialize(contribution(other, "init", 0, [torch.ones(m.shape) for m in other_metas], 0))
    other.completed = 1  # an iteration the replica counts and has not stepped
    with pytest.raises(InvalidField, match=r"holds param/w as torch.float32 \[4, 3\]"):
        replica.take_snapshot(snapshot(other))
    assert [d.pending.iteration for d in replica.deferred] == [0, 1] and replica.completed == 2
    assert_same_state(primary, replica, 2)
