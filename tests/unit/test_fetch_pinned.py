"""A CUDA learner gathers a TensorDataset's batch straight into pinned host memory
(``steps.fetch_batch(pin=True)``): the same values as plain indexing, so the copy to the
device can be asynchronous. Needs CUDA (pinned memory); the default path runs everywhere."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from shoal.learner.steps import fetch_batch


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(50, 3, 4, generator=g),
        torch.randint(0, 10, (50,), generator=g),
        torch.rand(50, generator=g) > 0.5,
    )


def test_unpinned_fetch_is_plain_indexing() -> None:
    ds, idx = _dataset(), torch.tensor([7, 3, 3, 49, 0])
    for got, t in zip(fetch_batch(ds, idx), ds.tensors, strict=True):
        assert torch.equal(got, t[idx]) and got.dtype == t.dtype


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_pinned_fetch_has_the_same_values_in_pinned_memory() -> None:
    ds, idx = _dataset(), torch.tensor([7, 3, 3, 49, 0])
    for got, t in zip(fetch_batch(ds, idx, pin=True), ds.tensors, strict=True):
        assert got.is_pinned()
        assert torch.equal(got, t[idx]) and got.dtype == t.dtype and got.shape == t[idx].shape
        on_device = got.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(on_device.cpu(), t[idx])
    empty = fetch_batch(ds, torch.tensor([], dtype=torch.int64), pin=True)
    assert [tuple(t.shape) for t in empty] == [(0, 3, 4), (0,), (0,)]
