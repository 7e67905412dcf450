"""The data partition of the iteration protocol: exact, pure, and elastic."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from shoal.learner.partition import (
    batch_range,
    epoch_order,
    iterations_per_epoch,
    learner_indices,
    micro_batches,
    shard_range,
)


@settings(max_examples=150, deadline=None)
@given(
    num_samples=st.integers(1, 400),
    batch_size=st.integers(1, 80),
    seed=st.integers(0, 2**32),
    epoch=st.integers(0, 5),
    worlds=st.lists(st.integers(1, 9), min_size=1, max_size=12),
)
def test_every_sample_is_visited_exactly_once_while_the_world_changes(
    num_samples: int, batch_size: int, seed: int, epoch: int, worlds: list[int]
) -> None:
    order = epoch_order(num_samples, seed, epoch)
    n_iter = iterations_per_epoch(num_samples, batch_size)
    seen: list[torch.Tensor] = []
    for i in range(n_iter):
        world = worlds[i % len(worlds)]
        start, stop = batch_range(i, batch_size, num_samples)
        assert start == i * batch_size
        assert stop - start == (batch_size if i < n_iter - 1 else num_samples - i * batch_size)
        cursor = start
        for rank in range(world):
            lo, hi = shard_range(i, batch_size, num_samples, rank, world)
            assert lo == cursor, "the ranks' ranges must tile the batch without gaps"
            assert hi >= lo
            cursor = hi
            share = learner_indices(num_samples, batch_size, seed, epoch, i, rank, world)
            assert torch.equal(share, order[lo:hi])
            seen.append(share)
        assert cursor == stop
    visited = torch.cat(seen)
    assert visited.numel() == num_samples, "no sample is skipped or repeated"
    assert torch.equal(visited.sort().values, torch.arange(num_samples))


def test_epoch_order_is_randperm_seeded_with_seed_plus_epoch() -> None:
    expected = torch.randperm(100, generator=torch.Generator().manual_seed(7 + 3))
    assert torch.equal(epoch_order(100, 7, 3), expected)
    assert torch.equal(epoch_order(100, 8, 2), expected)
    assert not torch.equal(epoch_order(100, 7, 3), epoch_order(100, 7, 4))
    assert epoch_order(100, 7, 3).dtype == torch.int64


def test_the_last_batch_of_an_epoch_may_be_short() -> None:
    assert iterations_per_epoch(10, 4) == 3
    assert batch_range(2, 4, 10) == (8, 10)
    assert [shard_range(2, 4, 10, r, 2) for r in range(2)] == [(8, 9), (9, 10)]
    assert iterations_per_epoch(3, 100) == 1
    assert batch_range(0, 100, 3) == (0, 3)


def test_ranks_beyond_the_batch_size_get_empty_shares() -> None:
    shares = [shard_range(0, 2, 2, r, 5) for r in range(5)]
    assert shares == [(0, 0), (0, 0), (0, 1), (1, 1), (1, 2)]
    assert learner_indices(2, 2, 0, 0, 0, 0, 5).numel() == 0


def test_learner_indices_accepts_a_precomputed_order() -> None:
    order = epoch_order(50, 1, 0)
    a = learner_indices(50, 16, 1, 0, 1, 1, 3, order=order)
    assert torch.equal(a, learner_indices(50, 16, 1, 0, 1, 1, 3))
    with pytest.raises(ValueError, match=r"order \(shape \(49,\)\)"):
        learner_indices(50, 16, 1, 0, 1, 1, 3, order=order[:49])


@settings(max_examples=100, deadline=None)
@given(n=st.integers(0, 200), max_per_device=st.one_of(st.none(), st.integers(1, 64)))
def test_micro_batches_are_balanced_bounded_and_in_order(
    n: int, max_per_device: int | None
) -> None:
    indices = torch.randperm(max(n, 1))[:n]
    chunks = micro_batches(indices, max_per_device)
    if n == 0:
        assert chunks == []
        return
    assert torch.equal(torch.cat(chunks), indices)
    sizes = [c.numel() for c in chunks]
    limit = n if max_per_device is None else max_per_device
    assert max(sizes) <= limit
    assert max(sizes) - min(sizes) <= 1
    assert len(chunks) == -(-n // limit), "the fewest micro-batches that fit"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: iterations_per_epoch(0, 4), r"num_samples \(0\) must be >= 1"),
        (lambda: iterations_per_epoch(10, 0), r"batch_size \(0\) must be >= 1"),
        (lambda: iterations_per_epoch(10, 2.5), r"batch_size \(2.5\) must be an int"),
        (lambda: epoch_order(10, -1, 0), r"seed \(-1\) must be >= 0"),
        (lambda: epoch_order(10, 0, -2), r"epoch \(-2\) must be >= 0"),
        (lambda: epoch_order(10, 2**63 - 1, 1), r"seed \+ epoch \(9223372036854775808\)"),
        (lambda: batch_range(3, 4, 10), r"iteration \(3\) must be < iterations_per_epoch \(3\)"),
        (lambda: batch_range(-1, 4, 10), r"iteration \(-1\) must be >= 0"),
        (lambda: shard_range(0, 4, 10, 2, 2), r"rank \(2\) must be < world_size \(2\)"),
        (lambda: shard_range(0, 4, 10, -1, 2), r"rank \(-1\) must be >= 0"),
        (lambda: shard_range(0, 4, 10, 0, 0), r"world_size \(0\) must be >= 1"),
        (lambda: shard_range(0, 4, 10, True, 2), r"rank \(True\) must be an int"),
        (lambda: learner_indices(10, 4, 0, 0, 0, 0, "2"), r"world_size \('2'\) must be an int"),
        (lambda: micro_batches(torch.arange(5), 0), r"max_per_device \(0\) must be >= 1"),
        (lambda: micro_batches(torch.zeros(2, 2), 1), r"indices \(shape \(2, 2\)\)"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()
