"""A collective group of one member (a job shrunk to one learner) starts no collective: the sum
or maximum over one member is its own tensor, so ``reduce_contribution`` gives the same bytes
as through gloo's all-reduce, without it. A real gloo group of one, formed through a real
TCPStore."""

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
    assert started and all(w is _DONE for w in started)  # nothing started
    grads, buffers, total, loss_sum = alone
    assert (total, loss_sum) == (through_gloo[2], through_gloo[3]) == (6.0, 1.75)
    assert grads[2] is None and through_gloo[0][2] is None
    for x, y in zip(grads[:2], through_gloo[0][:2], strict=True):
        assert x is not None and y is not None and torch.equal(x, y)
    for x, y in zip(buffers, through_gloo[1], strict=True):
        assert torch.equal(x, y)
