"""The successor coordinator's decisions (shoal.param_sync.takeover), without servers: where a
taken-over job continues when its coordinator was lost in the middle of a commit, and the
sharding it rebuilds after an earlier promotion."""

from __future__ import annotations

import pytest

from shoal.contract.wire import TensorMeta
from shoal.param_sync.sharding import assign_shards
from shoal.param_sync.takeover import (
    ShardState,
    TakeoverPlan,
    plan_takeover,
    sharding_after_takeover,
)
from shoal.runtime.errors import FailedPrecondition


def test_shards_at_one_iteration_continue_there_and_drop_sums_in_flight() -> None:
    plan = plan_takeover(
        "j",
        {
            1: ShardState(12, ("b",), pending=(4, 12)),
            2: ShardState(12, ("c",)),
            3: ShardState(-1),  # a spare: holds nothing
        },
    )
    assert plan == TakeoverPlan(12, commits={}, aborts={1: (4, 12)})


def test_a_commit_delivered_to_some_shards_only_is_completed_on_the_others() -> None:
    plan = plan_takeover(
        "j",
        {
            1: ShardState(13, ("b",), last_grad_norm=2.5),
            2: ShardState(12, ("c",), pending=(4, 12), last_grad_norm=1.0),
            3: ShardState(12, ("d",), pending=(4, 12), last_grad_norm=1.0),
        },
    )
    assert plan == TakeoverPlan(13, commits={2: (4, 12), 3: (4, 12)}, aborts={}, grad_norm=2.5)


@pytest.mark.parametrize(
    "states",
    [
        {1: ShardState(13), 2: ShardState(11, pending=(4, 11))},  # two apart
        {1: ShardState(13), 2: ShardState(12)},  # behind without the sums
        {1: ShardState(13), 2: ShardState(12, pending=(4, 11))},  # sums of another iteration
        {1: ShardState(13), 2: ShardState(12, pending=(4, 12)), 3: ShardState(12, pending=(5, 12))},
        {
            1: ShardState(13, last_grad_norm=1.0),
            3: ShardState(13, last_grad_norm=2.0),
            2: ShardState(12, pending=(4, 12)),
        },  # norms differ
        {1: ShardState(-1)},  # nobody holds a slice
    ],
)
def test_states_it_cannot_continue_from_are_refused_with_the_iterations(states) -> None:
    with pytest.raises(FailedPrecondition, match="resume it from its latest checkpoint"):
        plan_takeover("j", states)


def _layout(*sizes: int) -> list[TensorMeta]:
    metas, offset = [], 0
    for n, size in enumerate(sizes):
        metas.append(TensorMeta(f"t{n}", "float32", (size,), offset, 4 * size, False))
        offset += 4 * size
    return metas


def test_without_a_promotion_the_rebuilt_sharding_is_the_hash_rules() -> None:
    layout = _layout(40, 30, 20, 10, 5)
    rule = assign_shards(layout, 3)
    held = {1: rule.tensors[1], 2: rule.tensors[2]}
    assert sharding_after_takeover(layout, held, 0, 3) == rule


def test_after_a_promotion_the_lost_shard_holds_what_no_shard_left_holds() -> None:
    """Shard 2 was lost first and promoted onto shard 0; now shard 0 (the coordinator) is
    lost and shard 2 does not answer: shard 0's part is its own tensors plus shard 2's."""
    layout = _layout(40, 30, 20, 10, 5)
    rule = assign_shards(layout, 3)
    sharding = sharding_after_takeover(layout, {1: rule.tensors[1]}, 0, 3)
    assert sharding.tensors[1] == rule.tensors[1]
    assert sharding.tensors[2] == ()
    assert set(sharding.tensors[0]) == set(rule.tensors[0]) | set(rule.tensors[2])
    assert sharding.loads[0] == rule.loads[0] + rule.loads[2] and sharding.loads[2] == 0
    assert sharding.active_shards == 2


def test_a_shard_claiming_an_unknown_or_doubly_held_tensor_is_refused() -> None:
    layout = _layout(4, 3)
    with pytest.raises(FailedPrecondition, match="'zz', which is not in the job's layout"):
        sharding_after_takeover(layout, {1: ("zz",)}, 0, 3)
    with pytest.raises(FailedPrecondition, match="'t0', which is shard 1's"):
        sharding_after_takeover(layout, {1: ("t0",), 2: ("t0",)}, 0, 3)
    with pytest.raises(ValueError, match="shard 0 is not a shard left"):
        sharding_after_takeover(layout, {0: ("t0",)}, 0, 3)
