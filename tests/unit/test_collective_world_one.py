"""A collective group of one member (a job shrunk to one learner) starts no collective: the sum
or maximum over one member is its own tensor (``CollectiveGroup.allreduce`` starts nothing and
leaves the tensor as it is), and ``reduce_contribution`` hands back the member's own gradients
and a copy of its buffers: the sums over the one member, without the weighting by ``n`` and
back that a larger group's path does (which may move a gradient by its last bit). A real gloo
group of one, formed through a real TCPStore; the gloo path over the same member is the
reference."""

from __future__ import annotations

import datetime
import socket
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from shoal.learner.backend import Assignment, Contribution
from shoal.learner.collective_group import _DONE, CollectiveGroup, reduce_contribution


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def group() -> Iterator[CollectiveGroup]:
    port = _free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, use_libuv=True)
    g = CollectiveGroup(datetime.timedelta(seconds=30), torch.device("cpu"))
    g.rendezvous_at(f"127.0.0.1:{port}", "job")
    g.form(Assignment(1, 0, 0, 0, 0, 1, 0, 8))
    try:
        yield g
    finally:
        g.drop()
        del server


def _contribution() -> tuple[list[torch.Tensor], Contribution]:
    torch.manual_seed(0)
    params = [torch.zeros(5, 3), torch.zeros(7), torch.zeros(2)]
    grads: list[torch.Tensor | None] = [torch.randn(5, 3), torch.randn(7), None]
    buffers = [torch.randn(4), torch.tensor([3, 9], dtype=torch.int64)]
    return params, Contribution(grads, 6, 1.75, buffers)


def test_a_group_of_one_reduces_without_a_collective(group: CollectiveGroup, monkeypatch) -> None:
    assert group.world == 1 and group.backend_name == "gloo"
    params, contribution = _contribution()
    # The reference: gloo's all-reduces over the one member (as for any larger group).
    monkeypatch.setattr(group, "world", 2)
    started: list[object] = []
    real = CollectiveGroup.allreduce

    def counting(self: CollectiveGroup, tensors, op=None):  # type: ignore[no-untyped-def]
        works = real(self, tensors, op)
        started.extend(works)
        return works

    monkeypatch.setattr(CollectiveGroup, "allreduce", counting)
    through_gloo = reduce_contribution(group, params, contribution, None, 1 << 20, 1 << 20)
    assert started and not any(w is _DONE for w in started)
    started.clear()
    monkeypatch.setattr(group, "world", 1)
    _, contribution = _contribution()
    alone = reduce_contribution(group, params, contribution, None, 1 << 20, 1 << 20)
    assert not started  # no collective at all
    grads, buffers, total, loss_sum = alone
    assert (total, loss_sum) == (through_gloo[2], through_gloo[3]) == (6.0, 1.75)
    assert grads[2] is None and through_gloo[0][2] is None
    for own, x, y in zip(contribution.grads[:2], grads[:2], through_gloo[0][:2], strict=True):
        assert x is not None and y is not None and own is not None
        assert torch.equal(x, own)  # the member's own gradient: the exact mean over one
        torch.testing.assert_close(x, y, rtol=2e-7, atol=0)  # 6 * g / 6: its last bit
    for own, x, y in zip(contribution.buffers, buffers, through_gloo[1], strict=True):
        assert torch.equal(x, own)
        torch.testing.assert_close(x, y, rtol=2e-7, atol=0)  # (6 * b / 6 for a float one)
        assert x.data_ptr() != own.data_ptr()  # a copy: the next forward changes the model's
    # Nothing to reduce: an iteration without a sample is refused, as in any group.
    empty = Contribution([None, None, None], 0, 0.0, [])
    with pytest.raises(RuntimeError, match="no member of the iteration had a sample"):
        reduce_contribution(group, params, empty, None, 1 << 20, 1 << 20)


def test_a_sum_over_a_group_of_one_starts_nothing(group: CollectiveGroup) -> None:
    steps = torch.tensor([4, -1], dtype=torch.int64)
    works = group.allreduce([steps], dist.ReduceOp.MAX)
    assert works == [_DONE]
    group.wait(works)
    assert steps.tolist() == [4, -1]


def test_the_counts_ride_on_the_last_bucket_one_collective_less(
    group: CollectiveGroup, monkeypatch
) -> None:
    """``ride``: ``[n, loss sum, flags]`` go in the tail of the last gradient bucket (its
    float32) instead of a float64 collective of their own: the same gradients and buffers
    bitwise, the same counts, the loss sum to float32's precision, one collective less; and
    the overlap path (the bucketer holding the last bucket, with room for the tail) gives the
    same bytes as the path without it."""
    from torch import nn

    from shoal.learner.collective_group import counts_ride
    from shoal.learner.overlap import GradientBucketer
    from shoal.learner.steps import compute_contribution

    monkeypatch.setattr(group, "world", 2)  # gloo's all-reduce over the one member
    started: list[object] = []
    real = CollectiveGroup.allreduce

    def counting(self: CollectiveGroup, tensors, op=None):  # type: ignore[no-untyped-def]
        started.append(len(tensors))
        return real(self, tensors, op)

    monkeypatch.setattr(CollectiveGroup, "allreduce", counting)
    params, _ = _contribution()
    assert counts_ride(params, 1797, 64, 64)
    assert not counts_ride([p.half() for p in params], 1797, 64, 64)  # float16: not exact
    assert not counts_ride(params, 2**24, 64, 64)  # a batch could exceed 2**24 samples
    results = {}
    for ride in (False, True):
        started.clear()
        _, contribution = _contribution()
        results[ride] = reduce_contribution(group, params, contribution, None, 64, 64, ride)
        results[ride, "collectives"] = sum(started)
    assert results[True, "collectives"] == results[False, "collectives"] - 1
    (g0, b0, t0, l0), (g1, b1, t1, l1) = results[False], results[True]
    assert t0 == t1 == 6.0 and l1 == pytest.approx(l0, rel=1e-7)
    for x, y in zip([*g0, *b0], [*g1, *b1], strict=True):
        assert (x is None and y is None) or torch.equal(x, y)

    # The overlap path: the hooks fill the buckets, the last one is held with room for the
    # counts, and the result is the path without overlap's, bitwise.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    ps = list(model.parameters())
    data = torch.utils.data.TensorDataset(torch.randn(12, 8), torch.randint(0, 3, (12,)))
    bucketer = GradientBucketer(
        ps,
        lambda flat: real(group, [flat])[0],
        lambda: torch.device("cpu"),
        bucket_bytes=64,
        first_bucket_bytes=64,
        tail=2 + len(ps),
    )
    hooked = compute_contribution(
        model, nn.CrossEntropyLoss(), data, torch.arange(12), hooks=bucketer
    )
    launched = bucketer.take()
    assert launched.held and len(launched.works) == len(bucketer.layout) - 1
    last = launched.buckets[-1][1]
    assert last.numel() == sum(ps[j].numel() for j in bucketer.layout[-1]) + 2 + len(ps)
    detached = [p.detach() for p in ps]
    with_hooks = reduce_contribution(group, detached, hooked, launched, 64, 64, True)
    model.zero_grad()
    plain = compute_contribution(model, nn.CrossEntropyLoss(), data, torch.arange(12))
    without = reduce_contribution(group, detached, plain, None, 64, 64, True)
    assert with_hooks[2:] == without[2:]
    for x, y in zip(with_hooks[0], without[0], strict=True):
        assert torch.equal(x, y)
    bucketer.remove()
