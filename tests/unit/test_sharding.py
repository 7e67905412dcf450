"""Whole tensors onto shards, balanced by bytes (greedy largest-first)."""

from __future__ import annotations

import random

import pytest

from shoal.contract.wire import TensorMeta, pack_layout
from shoal.param_sync.sharding import assign_shards


def _layout(sizes: list[int]) -> list[TensorMeta]:
    metas = [TensorMeta(f"t{i}", "float32", (n,), 0, 4 * n) for i, n in enumerate(sizes)]
    return pack_layout(metas)[0]


def resnet18_like() -> list[TensorMeta]:
    """The parameter sizes of torchvision's ResNet-18 (11.69M float32)."""
    sizes = [9408, 64, 64]
    for cin, cout, blocks in ((64, 64, 2), (64, 128, 2), (128, 256, 2), (256, 512, 2)):
        for b in range(blocks):
            first_in = cin if b == 0 else cout
            sizes += [first_in * cout * 9, cout, cout, cout * cout * 9, cout, cout]
            if b == 0 and cin != cout:
                sizes += [cin * cout, cout, cout]
    sizes += [512 * 1000, 1000]
    return _layout(sizes)


def test_resnet18_sizes_add_up_to_11_69_million_parameters():
    assert sum(m.numel for m in resnet18_like()) == 11_689_512


@pytest.mark.parametrize("shards", [1, 2, 3, 4, 8])
def test_every_tensor_lands_on_exactly_one_shard_in_layout_order(shards):
    layout = resnet18_like()
    sharding = assign_shards(layout, shards)
    names = [n for part in sharding.tensors for n in part]
    assert sorted(names) == sorted(m.name for m in layout)
    position = {m.name: i for i, m in enumerate(layout)}
    for part in sharding.tensors:
        assert [position[n] for n in part] == sorted(position[n] for n in part)
    by_name = {m.name: m.nbytes for m in layout}
    assert sharding.loads == tuple(sum(by_name[n] for n in part) for part in sharding.tensors)


@pytest.mark.parametrize("shards", [2, 4])
def test_resnet18_is_balanced_within_five_percent(shards):
    sharding = assign_shards(resnet18_like(), shards)
    assert sharding.imbalance < 1.05, sharding.loads


def test_greedy_is_within_four_thirds_of_the_optimum_on_random_layouts():
    rng = random.Random(7)
    for _ in range(50):
        sizes = [rng.randint(1, 10_000) for _ in range(rng.randint(1, 40))]
        shards = rng.randint(1, 6)
        sharding = assign_shards(_layout(sizes), shards)
        lower_bound = max(max(sizes) * 4, sum(sizes) * 4 / shards)
        assert max(sharding.loads) <= lower_bound * 4 / 3 + 1e-9


def test_a_tensor_larger_than_a_share_gets_a_shard_to_itself():
    sharding = assign_shards(_layout([1000, 10, 20, 30]), 2)
    assert sharding.tensors[0] == ("t0",)
    assert sharding.tensors[1] == ("t1", "t2", "t3")


def test_more_shards_than_tensors_leaves_shards_idle():
    sharding = assign_shards(_layout([5, 6]), 4)
    assert sharding.active_shards == 2
    assert sum(1 for part in sharding.tensors if not part) == 2


def test_the_assignment_is_a_pure_function_of_layout_and_shard_count():
    layout = resnet18_like()
    assert assign_shards(layout, 3) == assign_shards(list(layout), 3)


def test_zero_shards_is_refused():
    with pytest.raises(ValueError, match="num_shards"):
        assign_shards(_layout([1]), 0)
