"""The copy of a learner's state that an update applied ahead of its commit is taken back from
(``shoal.learner.collective_ahead``, docs/data-plane.md "The vote ahead"): after restore, the
parameters, buffers, the optimizer's state and its groups' settings are bitwise what they were,
whatever the update did to them, and the run continues exactly as if it had never been
applied."""

from __future__ import annotations

import copy

import pytest
import torch

from shoal.learner.collective_ahead import StateCopy, state_bytes


def _model() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    params = [torch.randn(4, 3), torch.randn(3)]
    buffers = [torch.randn(3), torch.tensor(7)]  # a float and an integer buffer
    return params, buffers


def _step(params, buffers, optimizer, seed: int, lr: float) -> None:
    g = torch.Generator().manual_seed(seed)
    for group in optimizer.param_groups:
        group["lr"] = lr
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    optimizer.step()
    for p in params:
        p.grad = None
    buffers[0].add_(1.5)
    buffers[1].add_(1)


def _snapshot(params, buffers, optimizer):
    return (
        [t.clone() for t in (*params, *buffers)],
        copy.deepcopy(optimizer.state_dict()),
    )


def _assert_same(a, b) -> None:
    tensors_a, state_a = a
    tensors_b, state_b = b
    for x, y in zip(tensors_a, tensors_b, strict=True):
        assert torch.equal(x, y)
    assert state_a["param_groups"] == state_b["param_groups"]
    assert state_a["state"].keys() == state_b["state"].keys()
    for key, entries in state_a["state"].items():
        other = state_b["state"][key]
        assert entries.keys() == other.keys()
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other[name]), (key, name)
            else:
                assert value == other[name]


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        lambda ps: torch.optim.Adam(ps, lr=0.01),
        lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    ],
    ids=["sgd-momentum", "adam", "adamw"],
)
def test_an_update_taken_back_leaves_the_state_bitwise_as_it_was(make) -> None:
    params, buffers = _model()
    optimizer = make(params)
    saved = StateCopy(params, buffers, optimizer)
    # The first update creates the optimizer's state: taken back, it is gone again.
    before = _snapshot(params, buffers, optimizer)
    saved.take()
    _step(params, buffers, optimizer, seed=1, lr=0.5)
    saved.restore()
    _assert_same(_snapshot(params, buffers, optimizer), before)
    assert not optimizer.state
    # Later updates: taken back to the state after the committed ones, and a run that goes
    # on from there is the run that never saw the update taken back.
    reference = copy.deepcopy((params, buffers))
    ref_optimizer = make(reference[0])
    for seed in (2, 3):
        _step(params, buffers, optimizer, seed=seed, lr=0.1)
        _step(*reference, ref_optimizer, seed=seed, lr=0.1)
    before = _snapshot(params, buffers, optimizer)
    saved.take()
    _step(params, buffers, optimizer, seed=99, lr=0.7)
    assert not torch.equal(params[0], before[0][0])
    saved.restore()
    _assert_same(_snapshot(params, buffers, optimizer), before)
    _step(params, buffers, optimizer, seed=4, lr=0.1)
    _step(*reference, ref_optimizer, seed=4, lr=0.1)
    _assert_same(_snapshot(params, buffers, optimizer), _snapshot(*reference, ref_optimizer))


def test_the_copy_is_reused_while_the_shapes_hold() -> None:
    params, buffers = _model()
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    _step(params, buffers, optimizer, seed=1, lr=0.1)
    saved = StateCopy(params, buffers, optimizer)
    saved.take()
    kept = [t.data_ptr() for t in saved._saved]
    _step(params, buffers, optimizer, seed=2, lr=0.1)
    saved.take()
    assert [t.data_ptr() for t in saved._saved] == kept
    # params 15 floats, buffers 3 floats + one int64, momentum 15 floats
    assert state_bytes(params, buffers, optimizer) == (15 + 3 + 15) * 4 + 8


class _Replacing(torch.optim.Optimizer):
    """Keeps a running sum of gradients in a state tensor it replaces at every step (a new
    object each time, not an in-place update), of the shape ``shape(p)``."""

    def __init__(self, params, shape=lambda p: p.shape) -> None:
        super().__init__(params, {"lr": 0.1})
        self.shape = shape

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                old = state.get("sum", torch.zeros(self.shape(p)))
                fresh = torch.zeros(self.shape(p))
                fresh.view(-1)[: old.numel()] = old.view(-1)[: fresh.numel()]
                fresh.view(-1)[: p.numel()] += p.grad.view(-1)[: fresh.numel()]
                state["sum"] = fresh
                p.sub_(group["lr"] * p.grad)


def test_state_tensors_replaced_by_the_optimizer_are_copied_and_restored() -> None:
    """The copies are kept for the same tensors (an identity test); an optimizer that puts new
    state tensors in at every step still gets every value back, into copies reused while the
    shapes hold and made anew when they change."""
    params, buffers = _model()
    optimizer = _Replacing(params)
    _step(params, buffers, optimizer, seed=1, lr=0.1)
    saved = StateCopy(params, buffers, optimizer)
    saved.take()
    kept = [t.data_ptr() for t in saved._saved]
    _step(params, buffers, optimizer, seed=2, lr=0.1)  # new state tensors, the same shapes
    before = _snapshot(params, buffers, optimizer)
    saved.take()
    assert [t.data_ptr() for t in saved._saved] == kept
    _step(params, buffers, optimizer, seed=3, lr=0.5)
    saved.restore()
    _assert_same(_snapshot(params, buffers, optimizer), before)
    # The state's shapes change (a sum of twice the size): new copies, still restored.
    optimizer.shape = lambda p: (2 * p.numel(),)
    _step(params, buffers, optimizer, seed=4, lr=0.1)
    before = _snapshot(params, buffers, optimizer)
    saved.take()
    assert [t.data_ptr() for t in saved._saved] != kept
    _step(params, buffers, optimizer, seed=5, lr=0.5)
    saved.restore()
    _assert_same(_snapshot(params, buffers, optimizer), before)
