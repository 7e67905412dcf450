"""The gradient bucketer of collective mode (shoal.learner.overlap): its layout (reverse
parameter order, DDP's sizes, one dtype per bucket), buckets leaving during backward in order,
the flush of what backward did not produce, micro-batch accumulation and loss scaling, all
bit-for-bit what the path without overlap sends. The launch is a recorder here; the real gloo
group is in tests/integration/test_collective_training.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._utils import _flatten_dense_tensors
from torch.utils.data import TensorDataset

from shoal.learner.overlap import GradientBucketer, bucket_layout
from shoal.learner.steps import compute_contribution


class _Done:
    def wait(self) -> bool:
        return True


class Recorder:
    """A launch function: keeps each bucket's contents and whether backward was running."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.sent: list[torch.Tensor] = []
        self.in_backward: list[bool] = []
        self.fail_at = fail_at

    def __call__(self, flat: torch.Tensor) -> _Done:
        if self.fail_at is not None and len(self.sent) == self.fail_at:
            self.sent.append(flat.clone())
            raise RuntimeError("Connection closed by peer [127.0.0.1]:1234\nmore")
        self.sent.append(flat.clone())
        self.in_backward.append(torch._C._current_graph_task_id() != -1)
        return _Done()


class WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.unused = nn.Linear(4, 4)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3)
    )


def data(n: int = 24) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))


def expected(params: list[torch.Tensor], layout: list[list[int]], grads, n: int, inv=None):
    """What the path without overlap sends: each bucket's flattened gradients (unscaled in
    place first, as compute_contribution does), times n."""
    out = []
    for indices in layout:
        gs = []
        for j in indices:
            g = grads[j] if grads[j] is not None else torch.zeros_like(params[j])
            gs.append(g.clone() if inv is None else g.clone().mul_(inv))
        out.append(_flatten_dense_tensors(gs).mul_(n))
    return out


def test_layout_is_reverse_order_with_a_small_first_bucket_and_one_dtype_each() -> None:
    tensors = [
        torch.zeros(100),  # 400 B
        torch.zeros(100),
        torch.zeros(50, dtype=torch.float64),  # 400 B, another dtype
        torch.zeros(10),  # 40 B
        torch.zeros(1000),  # 4000 B: larger than any bucket, alone
        torch.zeros(20),
        torch.zeros(20),
    ]
    layout = bucket_layout(tensors, bucket_bytes=1000, first_bucket_bytes=100)
    assert layout == [[6], [5], [4], [3], [2], [1, 0]]
    assert sorted(j for b in layout for j in b) == list(range(len(tensors)))
    assert bucket_layout(tensors, bucket_bytes=10**9, first_bucket_bytes=10**9) == [
        [6, 5, 4, 3],
        [2],
        [1, 0],
    ]
    with pytest.raises(ValueError, match="bucket sizes"):
        bucket_layout(tensors, bucket_bytes=0)


def test_buckets_leave_during_backward_in_order_with_n_times_the_gradient() -> None:
    model = mlp()
    params = list(model.parameters())
    sent = Recorder()
    bucketer = GradientBucketer(
        params, sent, lambda: torch.device("cpu"), bucket_bytes=2048, first_bucket_bytes=64
    )
    assert len(bucketer.layout) >= 4
    contribution = compute_contribution(
        model, nn.CrossEntropyLoss(), data(), torch.arange(24), hooks=bucketer
    )
    assert bucketer.finished
    launched = bucketer.take()
    assert not bucketer.finished and launched.failure is None and launched.n == 24
    # Every bucket but possibly the last (the first layer's, whose gradients come last) left
    # while backward was still running; all in layout order.
    assert len(sent.sent) == len(bucketer.layout)
    assert all(sent.in_backward[:-1]) and sum(sent.in_backward) >= len(bucketer.layout) - 1
    assert [i for i, _ in launched.buckets] == bucketer.layout
    want = expected(params, bucketer.layout, contribution.grads, 24)
    for got, w, (_, flat) in zip(sent.sent, want, launched.buckets, strict=True):
        assert torch.equal(got, w) and torch.equal(flat, w)
    # The contribution itself is untouched by the hooks.
    model2 = mlp()
    plain = compute_contribution(model2, nn.CrossEntropyLoss(), data(), torch.arange(24))
    for a, b in zip(contribution.grads, plain.grads, strict=True):
        assert torch.equal(a, b)
    bucketer.remove()


def test_micro_batches_send_the_accumulated_gradient_once_with_the_loss_scale_undone() -> None:
    model = mlp()
    params = list(model.parameters())
    sent = Recorder()
    bucketer = GradientBucketer(
        params, sent, lambda: torch.device("cpu"), bucket_bytes=2048, first_bucket_bytes=64
    )
    scale = 1024.0
    contribution = compute_contribution(
        model,
        nn.CrossEntropyLoss(),
        data(),
        torch.arange(24),
        max_per_device=7,  # 4 micro-batches: only the last backward sends
        loss_scale=scale,
        hooks=bucketer,
    )
    launched = bucketer.take()
    assert len(sent.sent) == len(bucketer.layout)  # once, from the last backward
    # compute_contribution unscales the gradients in place (g * (1 / scale)) after the hooks
    # copied them; the buckets applied the same multiplication, then n: bit for bit.
    want = expected(params, bucketer.layout, contribution.grads, 24)
    for (_, flat), w in zip(launched.buckets, want, strict=True):
        assert torch.equal(flat, w)
    # And that is the accumulated gradient of the whole share (up to float order).
    ref = mlp()
    x, y = data()[torch.arange(24)]
    nn.CrossEntropyLoss()(ref(x), y).backward()
    for g, p in zip(contribution.grads, ref.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, atol=1e-6, rtol=1e-5)


def test_unused_and_frozen_parameters_are_flushed_at_finish_in_order() -> None:
    torch.manual_seed(0)
    model = WithUnused()
    model.b.bias.requires_grad_(False)
    params = list(model.parameters())
    sent = Recorder()
    bucketer = GradientBucketer(
        params, sent, lambda: torch.device("cpu"), bucket_bytes=300, first_bucket_bytes=16
    )
    layout = bucketer.layout
    unused_bucket = next(b for b, idx in enumerate(layout) if 2 in idx)  # unused.weight
    contribution = compute_contribution(
        model, nn.CrossEntropyLoss(), data(), torch.arange(24), hooks=bucketer
    )
    launched = bucketer.take()
    assert len(sent.sent) == len(layout)
    # The buckets before the unused parameter's left during backward; it and every later
    # one waited for finish() (order keeps the ranks' collectives matched).
    assert sent.in_backward == [b < unused_bucket for b in range(len(layout))]
    assert contribution.grads[2] is None and contribution.grads[3] is None  # unused
    assert contribution.grads[5] is None  # frozen b.bias
    want = expected(params, layout, contribution.grads, 24)
    for (_, flat), w in zip(launched.buckets, want, strict=True):
        assert torch.equal(flat, w)


def test_a_parameter_only_earlier_micro_batches_used_is_sent_with_its_accumulated_gradient():
    class Sometimes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 3)
            self.extra = nn.Linear(8, 3)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            out = self.a(x)
            return out + self.extra(x) if self.calls == 1 else out

    torch.manual_seed(0)
    model = Sometimes()
    params = list(model.parameters())
    sent = Recorder()
    bucketer = GradientBucketer(
        params, sent, lambda: torch.device("cpu"), bucket_bytes=64, first_bucket_bytes=16
    )
    contribution = compute_contribution(
        model, nn.CrossEntropyLoss(), data(), torch.arange(24), max_per_device=12, hooks=bucketer
    )
    launched = bucketer.take()
    assert contribution.grads[2] is not None  # extra.weight: from the first micro-batch only
    want = expected(params, bucketer.layout, contribution.grads, 24)
    for (_, flat), w in zip(launched.buckets, want, strict=True):
        assert torch.equal(flat, w)


def test_an_empty_share_sends_zeros_and_a_failed_launch_is_reported_not_raised() -> None:
    model = mlp()
    params = list(model.parameters())
    sent = Recorder()
    bucketer = GradientBucketer(params, sent, lambda: torch.device("cpu"), bucket_bytes=2048)
    contribution = compute_contribution(
        model, nn.CrossEntropyLoss(), data(), torch.arange(0), hooks=bucketer
    )
    assert contribution.n_samples == 0
    launched = bucketer.take()
    assert launched.n == 0 and len(sent.sent) == len(bucketer.layout)
    assert all(not flat.any() for _, flat in launched.buckets)

    failing = Recorder(fail_at=1)
    bucketer.remove()
    bucketer = GradientBucketer(
        params, failing, lambda: torch.device("cpu"), bucket_bytes=2048, first_bucket_bytes=64
    )
    compute_contribution(model, nn.CrossEntropyLoss(), data(), torch.arange(24), hooks=bucketer)
    launched = bucketer.take()
    assert launched.failure == "Connection closed by peer [127.0.0.1]:1234"
    assert len(failing.sent) == 2 and len(launched.works) == 1  # nothing after the failure


def test_discard_drops_the_iteration_in_flight_and_remove_unhooks() -> None:
    model = mlp()
    params = list(model.parameters())
    sent = Recorder()
    bucketer = GradientBucketer(params, sent, lambda: torch.device("cpu"), first_bucket_bytes=64)
    bucketer.begin()
    bucketer.arm(24, None)
    x, y = data()[torch.arange(24)]
    nn.CrossEntropyLoss()(model(x), y).backward()
    assert sent.sent  # the hooks sent during that backward
    bucketer.discard()  # the group went away
    assert not bucketer.finished
    with pytest.raises(RuntimeError, match="before finish"):
        bucketer.take()
    bucketer.remove()
    count = len(sent.sent)
    bucketer.begin()
    bucketer.arm(24, None)
    model.zero_grad()
    nn.CrossEntropyLoss()(model(x), y).backward()
    assert len(sent.sent) == count  # no hook left on the model


def test_a_share_not_needing_the_hooks_sends_nothing_from_them() -> None:
    # needed() is asked at begin(): in a group of one there is nothing to overlap, so the
    # hooks copy nothing and the gradients leave in sync (finished stays false).
    model = mlp()
    params = list(model.parameters())
    sent = Recorder()
    group = {"world": 1}
    bucketer = GradientBucketer(
        params, sent, lambda: torch.device("cpu"), needed=lambda: group["world"] > 1
    )
    plain = compute_contribution(mlp(), nn.CrossEntropyLoss(), data(), torch.arange(24))
    contribution = compute_contribution(
        model, nn.CrossEntropyLoss(), data(), torch.arange(24), hooks=bucketer
    )
    assert sent.sent == [] and not bucketer.finished
    for a, b in zip(contribution.grads, plain.grads, strict=True):
        assert torch.equal(a, b)
    group["world"] = 2  # grown: the next share's buckets leave from the hooks again
    model.zero_grad()
    compute_contribution(model, nn.CrossEntropyLoss(), data(), torch.arange(24), hooks=bucketer)
    assert bucketer.finished and len(sent.sent) == len(bucketer.layout)
    bucketer.remove()


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_a_backward_with_create_graph_sends_the_same_buckets_outside_the_graph() -> None:
    """The hooks skip ``torch.no_grad()`` where autograd already runs them without grad mode
    (the usual backward); a backward with ``create_graph`` runs them with it, and the copies
    into the buckets must still stay out of the graph: the same bytes, no grad history."""
    model = mlp()
    params = list(model.parameters())
    sent = Recorder()
    bucketer = GradientBucketer(
        params, sent, lambda: torch.device("cpu"), bucket_bytes=2048, first_bucket_bytes=64
    )
    x, y = data().tensors
    modes = []
    probe = params[0].register_post_accumulate_grad_hook(
        lambda p: modes.append(torch.is_grad_enabled())
    )
    bucketer.begin()
    bucketer.arm(24, None)
    loss = nn.CrossEntropyLoss()(model(x), y)
    loss.backward(create_graph=True)
    bucketer.finish()
    probe.remove()
    launched = bucketer.take()
    assert modes == [True]  # the case: the hooks ran with grad mode on
    assert params[0].grad is not None and params[0].grad.requires_grad
    want = expected(params, bucketer.layout, [p.grad.detach() for p in params], 24)
    assert len(sent.sent) == len(want)
    for got, w, (_, flat) in zip(sent.sent, want, launched.buckets, strict=True):
        assert torch.equal(got, w) and torch.equal(flat, w)
        assert not flat.requires_grad and flat.grad_fn is None
    bucketer.remove()
    for p in params:
        p.grad = None  # (the reference cycle create_graph makes)
