"""ElasticTrainer in one process: equivalence with plain PyTorch, elastic weighting math,
micro-batches, backend protocol (retire, abort, pull), checkpoints, registry and env."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import math
import weakref
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import Subset, TensorDataset

from shoal.learner import (
    Assignment,
    Contribution,
    ElasticTrainer,
    InitialState,
    IterationAborted,
    LearnerEnv,
    LocalBackend,
    ModelState,
    OptimizerSpec,
    SyncBackend,
    SyncResult,
    TrainingPlan,
    TrainingSetup,
    compute_contribution,
    create_backend,
    env,
    get_backend,
    partition,
    reduce_contributions,
    register_backend,
)

REPO = Path(__file__).resolve().parents[2]
SGD = ("SGD", {"lr": 0.05, "momentum": 0.9})

# Tolerance of the float32 comparisons below: the elastic and micro-batched runs compute the
# same mean gradient as one batch, but sum the per-sample terms in a different order (per share
# or micro-batch, then weighted by sample counts). Each step then differs by a few float32 ulps
# (~1e-7 relative); over the ~50 SGD steps of these runs the drift stays well under 1e-5.
ATOL = 1e-5


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        f"{name}_train", REPO / "examples" / name / "train.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


digits = _load_example("digits")
DATASETS = digits.get_datasets()


def get_datasets() -> tuple[TensorDataset, TensorDataset]:
    return DATASETS


def make_model(seed: int = 0, batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    if not batchnorm:
        return digits.build_model(hidden=32)
    return nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))


def plain_pytorch_training(
    model: nn.Module,
    train_set: TensorDataset,
    *,
    epochs: int,
    batch_size: int,
    seed: int,
    optimizer: tuple[str, dict[str, Any]] = SGD,
    lr_schedule: Callable[[int], float] | None = None,
) -> list[float]:
    """The reference: one process, the protocol's order, batch B, mean-reduced loss."""
    x, y = train_set.tensors
    opt = getattr(torch.optim, optimizer[0])(model.parameters(), **optimizer[1])
    loss_fn = nn.CrossEntropyLoss()
    losses, step = [], 0
    for epoch in range(epochs):
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed + epoch))
        for start in range(0, len(y), batch_size):
            idx = order[start : start + batch_size]
            if lr_schedule is not None:
                for group in opt.param_groups:
                    group["lr"] = lr_schedule(step)
            loss = loss_fn(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            step += 1
    return losses


def assert_state_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key].double(), b[key].double(), atol=atol, rtol=0), key


def train(model: nn.Module, backend: SyncBackend | str = "local", **kwargs: Any):
    trainer_kwargs = {
        k: kwargs.pop(k)
        for k in ("max_batch_per_device", "lr_schedule", "lr_schedule_unit", "env")
        if k in kwargs
    }
    trainer_kwargs.setdefault("env", LearnerEnv())
    datasets = kwargs.pop("datasets", get_datasets)
    trainer = ElasticTrainer(
        model,
        datasets,
        nn.CrossEntropyLoss(),
        kwargs.pop("optimizer", SGD),
        seed=kwargs.pop("seed", 3),
        backend=backend,
        device="cpu",
        **trainer_kwargs,
    )
    return trainer.train(**{"epochs": 2, "batch_size": 64, **kwargs})


# --------------------------------------------------------------------------------------------
# Equivalence with plain PyTorch
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batchnorm", [False, True], ids=["mlp", "mlp-batchnorm"])
def test_local_backend_training_equals_a_plain_pytorch_loop(batchnorm: bool) -> None:
    reference = make_model(batchnorm=batchnorm)
    ref_losses = plain_pytorch_training(reference, DATASETS[0], epochs=2, batch_size=64, seed=3)

    result = train(make_model(batchnorm=batchnorm))

    # Same tensors, same operations, same order: in practice bit-identical; ATOL leaves room
    # for a BLAS that picks another kernel for the copied master parameters.
    assert_state_close(result.params, reference.state_dict(), ATOL)
    assert result.completed and not result.retired
    assert len(result.history) == 2 * partition.iterations_per_epoch(len(DATASETS[0]), 64)
    assert result.losses == pytest.approx(ref_losses, abs=ATOL)
    assert [e.epoch for e in result.epochs] == [0, 1]
    assert all(0.0 <= e.metrics["accuracy"] <= 1.0 for e in result.epochs)


def test_the_last_gradients_are_freed_before_the_next_forward() -> None:
    """As in a plain loop (``zero_grad`` before backward), an iteration's gradients are gone
    when the next one's forward starts: nothing of the trainer keeps them, so the peak holds
    one set of gradients, not two."""
    model = make_model()
    made: list[weakref.ref[torch.Tensor]] = []
    alive_at_forward: list[int] = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda q: made.append(weakref.ref(q.grad)))

    def before_forward(module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():  # (training, not the epoch's evaluation)
            alive_at_forward.append(sum(r() is not None for r in made))
            made.clear()

    model.register_forward_pre_hook(before_forward)
    result = train(model, epochs=1)
    assert result.completed and len(alive_at_forward) == len(result.history)
    assert alive_at_forward == [0] * len(alive_at_forward)


def test_micro_batches_accumulate_to_the_same_gradient_as_one_batch() -> None:
    model = make_model()
    indices = partition.learner_indices(len(DATASETS[0]), 100, 0, 0, 0, 0, 1)
    whole = compute_contribution(model, nn.CrossEntropyLoss(), DATASETS[0], indices)
    whole_grads = [g.clone() for g in whole.grads]
    micro = compute_contribution(
        model, nn.CrossEntropyLoss(), DATASETS[0], indices, max_per_device=7
    )
    assert micro.n_samples == whole.n_samples == 100
    assert micro.loss_sum == pytest.approx(whole.loss_sum, rel=1e-6)
    for a, b in zip(whole_grads, micro.grads, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)


def test_training_with_micro_batches_matches_a_plain_pytorch_loop() -> None:
    reference = make_model()
    plain_pytorch_training(reference, DATASETS[0], epochs=2, batch_size=64, seed=3)
    result = train(make_model(), max_batch_per_device=10)
    assert_state_close(result.params, reference.state_dict(), ATOL)


def test_lr_schedule_is_applied_per_iteration() -> None:
    schedule = lambda step: 0.1 / (1 + step)  # noqa: E731
    reference = make_model()
    plain_pytorch_training(
        reference, DATASETS[0], epochs=1, batch_size=64, seed=3, lr_schedule=schedule
    )
    result = train(make_model(), epochs=1, lr_schedule=schedule)
    assert [r.lr for r in result.history] == [schedule(s) for s in range(len(result.history))]
    assert_state_close(result.params, reference.state_dict(), ATOL)


def test_lr_schedule_by_epoch_gets_the_epoch_index() -> None:
    result = train(make_model(), lr_schedule=lambda e: 0.1 * 0.5**e, lr_schedule_unit="epoch")
    assert {(r.epoch, r.lr) for r in result.history} == {(0, 0.1), (1, 0.05)}


# --------------------------------------------------------------------------------------------
# A changing world, simulated in one process
# --------------------------------------------------------------------------------------------


class VirtualWorldBackend(SyncBackend):
    """Runs W "virtual learners" per iteration, W changing with the step. The trainer under
    test is one of them (rank ``step % W``); the backend computes the others' contributions
    on a scratch model holding the same parameters, combines all of them with
    ``reduce_contributions`` (the shards' weighting rule) and steps the real optimizer."""

    def __init__(
        self, world_at: Callable[[int], int], model_factory: Callable[[], nn.Module], dataset
    ) -> None:
        self.world_at = world_at
        self.scratch = model_factory()
        self.dataset = dataset
        self.step = 0
        self.shares: dict[int, list[int]] = {}
        self.worlds: list[int] = []

    def initialize(self, setup: TrainingSetup) -> InitialState:
        self.plan = setup.plan
        self.params = [p.detach().clone() for p in setup.params]
        self.buffers = [b.detach().clone() for b in setup.buffers]
        self.optimizer = setup.optimizer.create(self.params)
        return InitialState(self.plan, self.params, self.buffers)

    def next_assignment(self) -> Assignment | None:
        if self.step >= self.plan.total_steps:
            return None
        world = self.world_at(self.step)
        return self.plan.assignment(self.step, rank=self.step % world, world_size=world)

    def sync(self, assignment: Assignment, contribution: Contribution, *, lr=None) -> SyncResult:
        with torch.no_grad():
            for dst, src in zip(self.scratch.parameters(), self.params, strict=True):
                dst.copy_(src)
            for dst, src in zip(self.scratch.buffers(), self.buffers, strict=True):
                dst.copy_(src)
        order = partition.epoch_order(self.plan.num_samples, self.plan.seed, assignment.epoch)
        contributions, shares = [], []
        for rank in range(assignment.world_size):
            start, stop = partition.shard_range(
                assignment.iteration,
                self.plan.batch_size,
                self.plan.num_samples,
                rank,
                assignment.world_size,
            )
            shares.append(stop - start)
            if rank == assignment.rank:
                contributions.append(contribution)
                continue
            scratch = copy.deepcopy(self.scratch)  # each virtual learner starts from the state
            c = compute_contribution(
                scratch, nn.CrossEntropyLoss(), self.dataset, order[start:stop]
            )
            contributions.append(c)
        assert contribution.n_samples == shares[assignment.rank]
        total = reduce_contributions(contributions)
        assert total.n_samples == assignment.batch_size
        for p, g in zip(self.params, total.grads, strict=True):
            p.grad = g
        self.optimizer.step()
        with torch.no_grad():
            for dst, src in zip(self.buffers, total.buffers, strict=True):
                dst.copy_(src)
        self.shares[self.step] = shares
        self.worlds.append(assignment.world_size)
        self.step += 1
        return SyncResult(
            self.params, self.buffers, self.step - 1, total.loss_sum / total.n_samples
        )


def world_3_2_4(step: int) -> int:
    # Epoch 0 has 23 iterations of B=64 (1438 samples): the world changes mid-epoch twice, and
    # again across the epoch boundary.
    return 3 if step < 9 else 2 if step < 17 else 4 if step < 30 else 3


def test_a_world_changing_3_2_4_mid_epoch_trains_like_a_single_process() -> None:
    reference = make_model()
    ref_losses = plain_pytorch_training(reference, DATASETS[0], epochs=2, batch_size=64, seed=3)

    backend = VirtualWorldBackend(world_3_2_4, make_model, DATASETS[0])
    result = train(make_model(), backend=backend)

    assert backend.worlds[7:11] == [3, 3, 2, 2] and backend.worlds[15:19] == [2, 2, 4, 4]
    assert {r.rank for r in result.history} == {0, 1, 2, 3}
    assert_state_close(result.params, reference.state_dict(), ATOL)
    assert result.losses == pytest.approx(ref_losses, abs=ATOL)


def test_empty_shares_contribute_nothing_when_the_batch_is_smaller_than_the_world() -> None:
    # 129 samples in batches of 64: the last batch holds one sample, and in a world of 4 three
    # learners (including, at step 2, the trainer under test as rank 2) get an empty share.
    train_set = Subset(DATASETS[0], range(129))
    sub = TensorDataset(*(t[:129] for t in DATASETS[0].tensors))
    reference = make_model()
    plain_pytorch_training(reference, sub, epochs=1, batch_size=64, seed=3)

    backend = VirtualWorldBackend(lambda step: [3, 2, 4][step], make_model, train_set)
    result = train(make_model(), backend=backend, epochs=1, datasets=lambda: (train_set, None))

    assert backend.shares[2] == [0, 0, 0, 1]
    assert result.history[2].n_samples == 0
    assert result.epochs == [], "the epoch ended with this learner at rank 2: rank 0 evaluates"
    assert_state_close(result.params, reference.state_dict(), ATOL)


def test_without_a_test_set_the_epoch_reports_only_the_training_loss() -> None:
    result = train(make_model(), epochs=1, datasets=lambda: (DATASETS[0], None))
    [epoch] = result.epochs
    assert math.isnan(epoch.test_loss) and epoch.metrics == {}
    assert epoch.train_loss == pytest.approx(
        sum(r.loss * r.batch_size for r in result.history) / len(DATASETS[0])
    )


# --------------------------------------------------------------------------------------------
# The backend protocol: join/pull, retire, abort
# --------------------------------------------------------------------------------------------


class DeferredPullBackend(LocalBackend):
    """A joiner admitted to a running job: ``initialize`` returns no state, and the job's
    parameters (not the learner's own) arrive through ``pull_parameters`` at the first
    boundary. At ``restore_at`` the job's state is replaced (as a restore from a checkpoint
    does) and the assignment says ``pull_parameters`` again."""

    def __init__(self, job_model: nn.Module, restore_at: int | None = None) -> None:
        super().__init__()
        self.job_model = job_model
        self.restore_at = restore_at
        self.pulls: list[int] = []
        self.sync_loss_known = True

    def initialize(self, setup: TrainingSetup) -> InitialState:
        super().initialize(setup)
        with torch.no_grad():
            for dst, src in zip(self._params, self.job_model.parameters(), strict=True):
                dst.copy_(src)
        return InitialState(setup.plan, None, None)

    def next_assignment(self) -> Assignment | None:
        a = super().next_assignment()
        if a is not None and a.step == self.restore_at:
            with torch.no_grad():
                for p in self._params:
                    p.mul_(0.5)
            return dataclasses.replace(a, pull_parameters=True)
        return a

    def pull_parameters(self) -> ModelState:
        self.pulls.append(self.step)
        return super().pull_parameters()

    def sync(self, assignment, contribution, *, lr=None) -> SyncResult:
        result = super().sync(assignment, contribution, lr=lr)
        # As on the cluster, the global loss is learned by the coordinator, not the learner.
        return dataclasses.replace(result, loss=None)


def test_a_joining_learner_trains_from_the_parameters_it_pulls() -> None:
    job_model = make_model(seed=42)
    reference = copy.deepcopy(job_model)
    ref_losses = plain_pytorch_training(reference, DATASETS[0], epochs=1, batch_size=64, seed=3)

    backend = DeferredPullBackend(job_model)
    result = train(make_model(seed=0), backend=backend, epochs=1)
    assert backend.pulls == [0], "pulled once, before the first iteration"
    assert_state_close(result.params, reference.state_dict(), ATOL)
    # Without a global loss from the backend, the history falls back to the share's loss
    # (the whole batch here, in a world of one).
    assert all(r.loss is None for r in result.history)
    assert result.losses == pytest.approx(ref_losses, abs=ATOL)
    assert not math.isnan(result.epochs[0].train_loss)


def test_an_assignment_that_says_pull_parameters_replaces_the_model_state() -> None:
    backend = DeferredPullBackend(make_model(seed=42), restore_at=5)
    result = train(make_model(seed=0), backend=backend, epochs=1)
    assert backend.pulls == [0, 5]

    reference = make_model(seed=42)
    losses = plain_pytorch_training(reference, DATASETS[0], epochs=1, batch_size=64, seed=3)
    # The restored (halved) parameters change everything from step 5 on.
    assert result.losses[:5] == pytest.approx(losses[:5], abs=ATOL)
    assert abs(result.losses[5] - losses[5]) > 1e-3


class RetiringBackend(LocalBackend):
    def __init__(self, retire_at: int) -> None:
        super().__init__()
        self.retire_at = retire_at

    def next_assignment(self) -> Assignment | None:
        if self.step == self.retire_at:
            return Assignment.retirement(generation=1, step=self.step)
        return super().next_assignment()


def test_a_retired_learner_stops_at_the_boundary_after_its_sync() -> None:
    result = train(make_model(), backend=RetiringBackend(retire_at=5))
    assert result.retired and not result.completed
    assert [r.step for r in result.history] == [0, 1, 2, 3, 4]
    assert result.epochs == []


class AbortingBackend(LocalBackend):
    """Aborts step ``abort_at`` once, as the coordinator does when a member dies."""

    def __init__(self, abort_at: int) -> None:
        super().__init__()
        self.abort_at = abort_at
        self.aborted = 0

    def sync(self, assignment, contribution, *, lr=None) -> SyncResult:
        if assignment.step == self.abort_at and not self.aborted:
            self.aborted += 1
            raise IterationAborted(f"member lost in step {assignment.step}")
        return super().sync(assignment, contribution, lr=lr)


def test_an_aborted_iteration_is_rerun_from_the_same_parameters_and_buffers() -> None:
    clean = train(make_model(batchnorm=True), epochs=1)
    backend = AbortingBackend(abort_at=4)
    result = train(make_model(batchnorm=True), backend=backend, epochs=1)
    assert backend.aborted == 1
    assert [r.step for r in result.history] == list(range(len(clean.history)))
    # The aborted forward pass moved the BatchNorm running statistics; the trainer restores
    # them, so the re-run is bit-identical to a run without the abort.
    for key, value in clean.params.items():
        assert torch.equal(value, result.params[key]), key


# --------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------


def test_local_backend_checkpoints_and_resumes_exactly(tmp_path: Path) -> None:
    straight = train(make_model(), epochs=2)

    storage = str(tmp_path / "job")
    first = train(make_model(), backend=LocalBackend(storage_uri=storage), epochs=1)
    assert first.completed
    assert (tmp_path / "job" / "checkpoints" / "latest").read_text() == "step-0000000023"
    assert (tmp_path / "job" / "final" / "model.safetensors").is_file()
    assert (tmp_path / "job" / "metrics" / "epochs.json").is_file()

    # A fresh process with a freshly initialized model continues from the checkpoint,
    # including the optimizer's momentum, and ends where uninterrupted training ends.
    resumed = train(make_model(seed=9), backend=LocalBackend(storage_uri=storage), epochs=2)
    assert [r.step for r in resumed.history] == list(range(23, 46))
    for key, value in straight.params.items():
        assert torch.equal(value, resumed.params[key]), key
    assert (tmp_path / "job" / "checkpoints" / "latest").read_text() == "step-0000000046"


def test_resuming_with_a_different_batch_size_is_refused(tmp_path: Path) -> None:
    storage = str(tmp_path / "job")
    train(make_model(), backend=LocalBackend(storage_uri=storage), epochs=1, batch_size=128)
    with pytest.raises(ValueError, match=r"batch_size \(64\) differs from the checkpoint's"):
        train(make_model(), backend=LocalBackend(storage_uri=storage), epochs=1)


def test_checkpoint_every_writes_at_epoch_ends() -> None:
    plan = TrainingPlan(epochs=4, batch_size=10, num_samples=25, checkpoint_every=2)
    due = [s for s in range(plan.total_steps) if plan.is_checkpoint_step(s)]
    assert due == [5, 11]  # end of epoch 2 and end of the job (epoch 4)
    assert [s for s in range(3) if TrainingPlan(1, 10, 25).is_checkpoint_step(s)] == [2]


# --------------------------------------------------------------------------------------------
# Weighting rule, optimizer spec, registry, environment
# --------------------------------------------------------------------------------------------


def test_reduce_contributions_weights_gradients_and_buffers_by_sample_count() -> None:
    a = Contribution(
        [torch.tensor([1.0, 2.0]), None], 1, 3.0, [torch.tensor([0.0]), torch.tensor(4)]
    )
    b = Contribution(
        [torch.tensor([4.0, 5.0]), None], 3, 6.0, [torch.tensor([4.0]), torch.tensor(7)]
    )
    empty = Contribution([None, None], 0, 0.0, [torch.tensor([100.0]), torch.tensor(99)])
    total = reduce_contributions([a, empty, b])
    assert total.n_samples == 4 and total.loss_sum == 9.0
    assert torch.allclose(total.grads[0], torch.tensor([13 / 4, 17 / 4]))
    assert total.grads[1] is None, "no member had a gradient: the optimizer skips it"
    assert torch.allclose(total.buffers[0], torch.tensor([3.0]))
    assert int(total.buffers[1]) == 7, "integer buffers take the maximum"
    with pytest.raises(ValueError, match="contributions"):
        reduce_contributions([])


@pytest.mark.parametrize(
    ("given", "name", "kwargs"),
    [
        (("SGD", {"lr": 0.1, "momentum": 0.9}), "SGD", {"lr": 0.1, "momentum": 0.9}),
        (
            (torch.optim.AdamW, {"lr": 1e-3, "betas": [0.9, 0.99]}),
            "AdamW",
            {"lr": 1e-3, "betas": (0.9, 0.99)},
        ),
        ("Adam", "Adam", {}),
        (torch.optim.RMSprop, "RMSprop", {}),
        (OptimizerSpec("SGD", {"lr": 1.0}), "SGD", {"lr": 1.0}),
    ],
)
def test_optimizer_spec_accepts_the_documented_forms(given, name: str, kwargs) -> None:
    spec = OptimizerSpec.parse(given)
    assert (spec.name, dict(spec.kwargs)) == (name, kwargs)
    assert OptimizerSpec.from_dict(spec.to_dict()) == spec
    assert isinstance(spec.create([nn.Parameter(torch.zeros(2))]), torch.optim.Optimizer)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ("NoSuchOpt", r"optimizer \('NoSuchOpt'\) is not a torch.optim.Optimizer"),
        (("SGD", {"lr": 0.1, "nope": 1}), r"optimizer SGD rejected its arguments"),
        (("SGD", {"lr": torch.tensor(0.1)}), r"optimizer argument lr \(tensor\(0.1000\)\)"),
        ((nn.Linear, {}), r"is not a torch.optim.Optimizer subclass"),
        (("SGD",), r"must be \(name or class, kwargs\)"),
        (("no.such.module:Opt", {}), r"optimizer \('no.such.module:Opt'\) cannot be imported"),
    ],
)
def test_bad_optimizers_raise_value_error_naming_them(given, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OptimizerSpec.parse(given)


def test_backends_are_chosen_by_name_from_the_registry() -> None:
    assert isinstance(create_backend("local", LearnerEnv()), LocalBackend)
    assert isinstance(create_backend(env=LearnerEnv()), LocalBackend)
    with pytest.raises(ValueError, match=r"sync backend \('nope'\) is not registered"):
        get_backend("nope")
    with pytest.raises(ValueError, match=r"backend name \('local'\) is already registered"):
        register_backend("local", LocalBackend.from_env)
    register_backend("test-local", lambda e: LocalBackend(storage_uri=e.storage_uri), replace=True)
    result = train(make_model(), backend="test-local", epochs=1)
    assert result.completed


def test_environment_contract_defaults_and_parsing() -> None:
    assert LearnerEnv.from_environ({}) == LearnerEnv()
    assert env.sync_backend({}) == "local"
    assert env.sync_backend({"SHOAL_JOB_ID": "job-1"}) == "parameter_server"
    assert (
        env.sync_backend({"SHOAL_JOB_ID": "j", "SHOAL_SYNC_BACKEND": "collective"}) == "collective"
    )
    full = LearnerEnv.from_environ(
        {
            "SHOAL_JOB_ID": "job-1",
            "SHOAL_LEARNER_ID": "l-3",
            "SHOAL_GENERATION": "4",
            "SHOAL_SYNC_ENDPOINTS": "10.0.0.1:7001, 10.0.0.2:7001",
            "SHOAL_MAX_BATCH_PER_DEVICE": "32",
            "SHOAL_STORAGE_URI": "file:///tmp/x",
            "SHOAL_TOKEN": "t",
            "TRACEPARENT": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "SHOAL_EPOCHS": "5",
            "SHOAL_BATCH_SIZE": "256",
            "SHOAL_SEED": "7",
        }
    )
    assert full.sync_endpoints == ("10.0.0.1:7001", "10.0.0.2:7001")
    assert full.coordinator == "10.0.0.1:7001", "defaults to the first shard"
    assert (full.generation, full.max_batch_per_device) == (4, 32)
    assert (full.epochs, full.batch_size, full.seed) == (5, 256, 7)
    assert not full.standalone and LearnerEnv().standalone
    with pytest.raises(ValueError, match=r"SHOAL_GENERATION \('x'\) must be an integer"):
        env.generation({"SHOAL_GENERATION": "x"})
    with pytest.raises(ValueError, match=r"SHOAL_BATCH_SIZE \(0\) must be >= 1"):
        env.batch_size({"SHOAL_BATCH_SIZE": "0"})
    with pytest.raises(ValueError, match=r"SHOAL_SYNC_ENDPOINTS \('a:1,'\) has an empty entry"):
        env.sync_endpoints({"SHOAL_SYNC_ENDPOINTS": "a:1,"})
    with pytest.raises(ValueError, match=r"SHOAL_COORDINATOR \('nohost'\) must be host:port"):
        env.coordinator({"SHOAL_COORDINATOR": "nohost"})


def test_job_settings_from_the_environment_win_over_the_script() -> None:
    result = train(
        make_model(), epochs=5, batch_size=64, env=LearnerEnv(epochs=1, batch_size=100, seed=1)
    )
    assert (result.plan.epochs, result.plan.batch_size, result.plan.seed) == (1, 100, 1)
    assert len(result.history) == math.ceil(len(DATASETS[0]) / 100)


def test_trainer_rejects_bad_arguments_naming_them() -> None:
    with pytest.raises(ValueError, match=r"model \(int\) must be a torch.nn.Module"):
        ElasticTrainer(3, get_datasets, nn.CrossEntropyLoss(), SGD)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"seed \(-1\) must be an int >= 0"):
        ElasticTrainer(make_model(), get_datasets, nn.CrossEntropyLoss(), SGD, seed=-1)
    with pytest.raises(ValueError, match=r"epochs \(0\) must be an int >= 1"):
        train(make_model(), epochs=0)
    with pytest.raises(ValueError, match=r"rank \(2\) must be in \[0, world_size \(2\)\)"):
        Assignment(0, 0, 0, 0, 2, 2, 0, 10)
