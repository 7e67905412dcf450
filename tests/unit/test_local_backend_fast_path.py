"""The standalone path's shortcuts keep its behaviour: the local backend steps the model's own
parameters (bit-identical to a plain PyTorch loop), sets the learning rate only when it
changes, and builds its assignments straight from the plan (across epochs and after a
checkpoint restore)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from shoal.learner import (
    Contribution,
    ElasticTrainer,
    LearnerEnv,
    LocalBackend,
    OptimizerSpec,
    TrainingPlan,
    TrainingSetup,
    compute_contribution,
    partition,
)
from shoal.learner.backend import TensorSpec

REPO = Path(__file__).resolve().parents[2]
ADAM = ("Adam", {"lr": 0.01})


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _digits() -> Any:
    spec = importlib.util.spec_from_file_location("digits_train", REPO / "examples/digits/train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


digits = _digits()
TRAIN, TEST = digits.get_datasets()


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return digits.build_model(hidden=32)


def epoch_rate(epoch: int) -> float:
    return 0.01 * 0.5**epoch


def plain_loop(model: nn.Module, epochs: int, batch: int, seed: int) -> list[float]:
    """What bench/bench_overhead.py's plain loop does, with an lr set per epoch."""
    x, y = TRAIN.tensors
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    losses = []
    for epoch in range(epochs):
        for group in opt.param_groups:
            group["lr"] = epoch_rate(epoch)
        order = partition.epoch_order(len(y), seed, epoch)
        for start in range(0, len(y), batch):
            idx = order[start : start + batch]
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


def trainer(model: nn.Module, backend: Any = "local") -> ElasticTrainer:
    return ElasticTrainer(
        model,
        lambda: (TRAIN, TEST),
        nn.CrossEntropyLoss(),
        ADAM,
        lr_schedule=epoch_rate,
        lr_schedule_unit="epoch",
        seed=3,
        backend=backend,
        device="cpu",
        env=LearnerEnv(),
    )


def test_standalone_training_is_bit_identical_to_a_plain_loop() -> None:
    reference = make_model()
    losses = plain_loop(reference, epochs=3, batch=32, seed=3)
    model = make_model()
    result = trainer(model).train(epochs=3, batch_size=32)
    for name, value in reference.state_dict().items():
        assert torch.equal(result.params[name], value), name
    assert result.losses == pytest.approx(losses, rel=1e-12, abs=0)
    assert {(r.epoch, r.lr) for r in result.history} == {(e, epoch_rate(e)) for e in range(3)}
    # The optimizer stepped the model's own parameters: no gradient is left on them.
    assert all(p.grad is None for p in model.parameters())


def test_every_field_of_the_iteration_record_is_the_right_one() -> None:
    """The trainer builds its records positionally: each field is checked by name here."""
    result = trainer(make_model()).train(epochs=2, batch_size=500)
    ipe = -(-len(TRAIN) // 500)  # the last batch partial
    assert len(result.history) == 2 * ipe
    for step, record in enumerate(result.history):
        epoch, iteration = divmod(step, ipe)
        n = min(500, len(TRAIN) - iteration * 500)
        assert (record.step, record.epoch, record.iteration) == (step, epoch, iteration)
        assert (record.generation, record.rank, record.world_size) == (0, 0, 1)
        assert (record.batch_size, record.n_samples) == (n, n)  # (the last batch partial)
        assert record.loss == record.share_loss and math.isfinite(record.loss)
        assert record.lr == epoch_rate(epoch)
        assert (record.grad_norm, record.skipped, record.loss_scale) == (None, False, None)
        assert record.metrics == {}


def test_a_resumed_run_gets_each_epochs_rate_and_ends_bit_identical(tmp_path: Path) -> None:
    straight = trainer(make_model()).train(epochs=3, batch_size=64)
    storage = str(tmp_path / "job")
    trainer(make_model(), LocalBackend(storage_uri=storage)).train(epochs=1, batch_size=64)
    resumed = trainer(make_model(), LocalBackend(storage_uri=storage)).train(
        epochs=3, batch_size=64
    )
    assert {(r.epoch, r.lr) for r in resumed.history} == {(1, 0.005), (2, 0.0025)}
    for name, value in straight.params.items():
        assert torch.equal(resumed.params[name], value), name


def _backend(plan: TrainingPlan, model: nn.Module, optimizer: Any = ADAM, **kw: Any):
    named = list(model.named_parameters())
    backend = LocalBackend(**kw)
    backend.initialize(
        TrainingSetup(
            plan=plan,
            optimizer=optimizer
            if isinstance(optimizer, OptimizerSpec)
            else OptimizerSpec.parse(optimizer),
            param_specs=tuple(TensorSpec.of(n, p) for n, p in named),
            buffer_specs=(),
            params=[p for _, p in named],
            buffers=[],
        )
    )
    return backend


def _contribution(model: nn.Module, plan: TrainingPlan, step: int) -> Contribution:
    epoch, iteration = plan.position(step)
    indices = partition.learner_indices(
        plan.num_samples, plan.batch_size, plan.seed, epoch, iteration, 0, 1
    )
    return compute_contribution(model, nn.CrossEntropyLoss(), TRAIN, indices)


def test_the_rate_set_only_when_it_changes_still_takes_effect_on_every_group() -> None:
    model = make_model()
    plan = TrainingPlan(epochs=1, batch_size=100, num_samples=len(TRAIN))
    spec = OptimizerSpec.parse(ADAM)
    spec = OptimizerSpec(spec.name, spec.kwargs, ((("0.weight",), {"lr": 0.02}),))
    backend = _backend(plan, model, spec)
    groups = backend._optimizer.param_groups  # type: ignore[union-attr]
    for lr, expected in [(0.1, 0.1), (0.1, 0.1), (None, 0.1), (0.05, 0.05), (0.1, 0.1)]:
        a = backend.next_assignment()
        assert a is not None
        backend.sync(a, _contribution(model, plan, a.step), lr=lr)
        # The group with its own lr keeps its ratio (x2) to the schedule's rate.
        assert [g["lr"] for g in groups] == pytest.approx([2 * expected, expected])


def test_the_assignments_are_the_plans_across_epochs_and_after_a_restore(tmp_path: Path) -> None:
    plan = TrainingPlan(
        epochs=3, batch_size=300, num_samples=len(TRAIN), seed=1, checkpoint_every=1
    )
    storage = str(tmp_path / "job")
    model = make_model()
    backend = _backend(plan, model, storage_uri=storage)
    seen = []
    for _ in range(plan.iterations_per_epoch + 2):  # into the second epoch
        a = backend.next_assignment()
        assert a is not None
        epoch, iteration = divmod(a.step, plan.iterations_per_epoch)
        start = iteration * plan.batch_size
        assert (a.epoch, a.iteration, a.batch_start, a.batch_stop) == (
            epoch,
            iteration,
            start,
            min(start + plan.batch_size, plan.num_samples),
        )
        assert (a.generation, a.rank, a.world_size) == (0, 0, 1)
        plan.check_assignment(a)
        seen.append(a.step)
        backend.sync(a, _contribution(model, plan, a.step))
    assert seen == list(range(plan.iterations_per_epoch + 2))
    # The checkpoint at the first epoch's end: a fresh backend resumes at its next step.
    resumed = _backend(plan, make_model(), storage_uri=storage)
    a = resumed.next_assignment()
    assert a == plan.assignment(plan.iterations_per_epoch)
    assert (a.epoch, a.iteration) == (1, 0)
    steps = [a.step]
    while a is not None:
        resumed.sync(a, _contribution(model, plan, a.step))
        a = resumed.next_assignment()
        if a is not None:
            steps.append(a.step)
    assert steps == list(range(plan.iterations_per_epoch, plan.total_steps))


def test_the_plans_batch_range_refuses_what_partition_refuses() -> None:
    plan = TrainingPlan(epochs=2, batch_size=32, num_samples=100)
    assert [plan.batch_range(i) for i in range(4)] == [
        partition.batch_range(i, 32, 100) for i in range(4)
    ]
    for bad in (4, -1, 1.0, True):
        with pytest.raises(ValueError, match="iteration") as expected:
            partition.batch_range(bad, 32, 100)  # type: ignore[arg-type]
        with pytest.raises(ValueError) as got:
            plan.batch_range(bad)  # type: ignore[arg-type]
        assert str(got.value) == str(expected.value)


def test_gradients_not_the_parameters_own_are_lent_for_the_step_and_taken_back() -> None:
    plan = TrainingPlan(epochs=1, batch_size=100, num_samples=len(TRAIN))
    own_model, lent_model = make_model(), make_model()
    own, lent = _backend(plan, own_model), _backend(plan, lent_model)
    for _ in range(3):
        a = own.next_assignment()
        assert a is not None
        mine = _contribution(own_model, plan, a.step)
        own.sync(a, mine)
        # The trainer's case: the gradients are the parameters' own, used as they are.
        assert all(p.grad is g for p, g in zip(own_model.parameters(), mine.grads, strict=True))
        theirs = _contribution(lent_model, plan, a.step)
        copies = Contribution([g.clone() for g in theirs.grads], 100, 1.0, [])
        lent_model.zero_grad(set_to_none=True)
        lent.sync(lent.next_assignment(), copies)  # type: ignore[arg-type]
        assert all(p.grad is None for p in lent_model.parameters())
    for a, b in zip(own_model.parameters(), lent_model.parameters(), strict=True):
        assert torch.equal(a, b)
