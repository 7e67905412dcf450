"""The trainer's half of early forward (``shoal.learner.early_forward``) on real PyTorch models:
the answer's tensors arrive from another thread (as the backend's asyncio thread delivers them)
while forward runs; forward pre-hooks load each module's tensors as it is reached, a tied
parameter through whichever owner runs first; the guard catches a parameter read without its
module's hook; a failed answer raises IterationAborted from the waiting hook. Also the switch
and the test faults' names."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from torch import nn

from shoal.contract import faults
from shoal.learner.backend import IterationAborted
from shoal.learner.early_forward import (
    ArrivingTensors,
    EarlyForward,
    early_forward_enabled,
    graph_leaves,
)
from shoal.learner.steps import ModelTensors


class Tied(nn.Module):
    """An embedding whose weight the output layer shares, with a BatchNorm between."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.norm = nn.BatchNorm1d(4)
        self.out = nn.Linear(4, 7, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.embed(x)))


class Functional(nn.Module):
    """Reads ``head``'s weight functionally: ``head`` is never called."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(3, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x)) @ self.head.weight.T


def _setup(model: nn.Module):
    named = list(model.named_parameters())
    tensors = ModelTensors.of(model)
    early = EarlyForward(model, tensors, [n for n, _ in named])
    torch.manual_seed(1)
    sources = [torch.randn_like(t) if t.is_floating_point() else t + 3 for t in
               [*tensors.params, *tensors.buffers]]  # fmt: skip
    snapshot = [torch.zeros_like(b) for b in tensors.buffers]
    return tensors, early, sources, snapshot


def _deliver_when_waited(arriving: ArrivingTensors, *, fail: bool = False) -> threading.Thread:
    """The backend's side: once the trainer first waits, everything arrives (or fails)."""

    def run() -> None:
        assert arriving.waited.wait(30)
        if fail:
            arriving.fail(IterationAborted("shard 1 died while answering"))
        else:
            arriving.done(range(len(arriving._done)))
        arriving.end()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _state(tensors: ModelTensors) -> list[torch.Tensor]:
    return [t.detach().clone() for t in [*tensors.params, *tensors.buffers]]


def test_hooks_load_each_module_as_forward_reaches_it_and_the_result_is_the_whole_answers():
    model = Tied().train()
    tensors, early, sources, snapshot = _setup(model)
    n = len(sources)
    arriving = ArrivingTensors(n)
    arriving.done([1])  # one tensor complete before forward: loaded at once, not by a hook
    early.begin(arriving, sources, snapshot)
    early.before_forward()
    thread = _deliver_when_waited(arriving)
    x = torch.tensor([0, 3, 5, 6])
    loss = model(x).square().mean()
    assert early.check(loss) is False  # settles: the whole answer is in
    thread.join(30)
    assert not early.unsettled
    assert arriving.stats[1] == n - 1 and arriving.stats[2] == n - 1, arriving.stats
    # What forward computed is what the model loaded with the answer first computes, except
    # for the BatchNorm statistics forward itself updated (compared after reloading).
    reference = Tied().train()
    ref_tensors = ModelTensors.of(reference)
    with torch.no_grad():
        for dst, src in zip([*ref_tensors.params, *ref_tensors.buffers], sources, strict=True):
            dst.copy_(src)
    torch.testing.assert_close(reference(x).square().mean(), loss, rtol=0, atol=0)
    torch.testing.assert_close(_state(tensors)[:-3], sources[:-3], rtol=0, atol=0)
    torch.testing.assert_close(snapshot, sources[len(tensors.params) :], rtol=0, atol=0)
    assert all(not m._forward_pre_hooks for m in model.modules())  # removed at settle


def test_the_guard_catches_a_parameter_read_without_its_modules_hook():
    model = Functional()
    tensors, early, sources, snapshot = _setup(model)
    arriving = ArrivingTensors(len(sources))
    early.begin(arriving, sources, snapshot)
    early.before_forward()
    thread = _deliver_when_waited(arriving)
    loss = model(torch.ones(2, 3)).sum()
    assert id(model.head.weight) in graph_leaves(loss.grad_fn)
    logs = logging.getLogger("shoal.learner.early_forward")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logs.addHandler(handler)
    try:
        assert early.check(loss) is True  # read stale: run that forward again
    finally:
        logs.removeHandler(handler)
    thread.join(30)
    assert not early.enabled
    assert len(records) == 1 and "'head.weight'" in records[0].getMessage()
    assert "'head.bias'" not in records[0].getMessage()  # not read at all: not named
    torch.testing.assert_close(_state(tensors), sources, rtol=0, atol=0)
    # Off: the next answer is loaded whole before forward (no hook).
    arriving = ArrivingTensors(len(sources))
    early.begin(arriving, [s + 1 for s in sources], snapshot)
    _deliver_when_waited(arriving)
    early.before_forward()
    assert not early.unsettled
    torch.testing.assert_close(_state(tensors), [s + 1 for s in sources], rtol=0, atol=0)


def test_an_answer_failing_after_its_header_raises_iteration_aborted_from_the_hook():
    model = Tied()
    _tensors, early, sources, snapshot = _setup(model)
    arriving = ArrivingTensors(len(sources))
    early.begin(arriving, sources, snapshot)
    early.before_forward()
    thread = _deliver_when_waited(arriving, fail=True)
    with pytest.raises(IterationAborted, match="died while answering"):
        model(torch.tensor([1, 2]))
    early.abandon()
    thread.join(30)
    assert not early.unsettled
    assert all(not m._forward_pre_hooks for m in model.modules())
    assert isinstance(arriving.wait_ended(), IterationAborted)


def test_the_switch_and_the_faults(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("SHOAL_PS_EARLY_FORWARD", raising=False)
    assert early_forward_enabled() is False
    monkeypatch.setenv("SHOAL_PS_EARLY_FORWARD", " On ")
    assert early_forward_enabled() is True
    monkeypatch.setenv("SHOAL_PS_EARLY_FORWARD", "yes")
    with pytest.raises(ValueError, match=r"SHOAL_PS_EARLY_FORWARD \('yes'\)"):
        early_forward_enabled()
    assert faults.parse("hold-answer@3") == ("hold-answer", 3)
    assert faults.parse("drop-answer@0") == ("drop-answer", 0)
    with pytest.raises(ValueError, match="SHOAL_TEST_FAULT"):
        faults.parse("drop-answer@x")


class ReadsAround(nn.Module):
    """Reads a buffer under no_grad from a module it never calls, and its Linear's weight
    before calling that Linear: neither has a gradient path the graph walk could use."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(3)
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            shift = self.norm.running_mean.clone()
        return self.lin((x - shift) * self.lin.weight.detach().sum())


def test_a_read_outside_the_hooks_without_a_gradient_is_caught_through_the_poisoned_values():
    from torch.utils.data import TensorDataset

    from shoal.learner.steps import compute_contribution

    model = ReadsAround()
    _tensors, early, sources, snapshot = _setup(model)
    arriving = ArrivingTensors(len(sources))
    early.begin(arriving, sources, snapshot)
    early.before_forward()
    thread = _deliver_when_waited(arriving)
    torch.manual_seed(2)
    data = TensorDataset(torch.randn(8, 3), torch.randint(0, 2, (8,)))
    loss_fn = nn.CrossEntropyLoss()
    contribution = compute_contribution(
        model, loss_fn, data, torch.arange(8), max_per_device=4, forward_check=early.check
    )
    thread.join(30)
    assert not early.enabled and not early.unsettled
    # Equal to the same model loaded whole before its forward.
    reference = ReadsAround()
    ref_tensors = ModelTensors.of(reference)
    with torch.no_grad():
        for dst, src in zip([*ref_tensors.params, *ref_tensors.buffers], sources, strict=True):
            dst.copy_(src)
    expected = compute_contribution(reference, loss_fn, data, torch.arange(8), max_per_device=4)
    assert contribution.loss_sum == pytest.approx(expected.loss_sum, rel=1e-12)
    for got, want in zip(contribution.grads, expected.grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
