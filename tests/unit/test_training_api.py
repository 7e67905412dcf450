"""The training script's API: callbacks and their order, the primary learner, default
logging, global gradient clipping and mixed precision equal to a single-process loop."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from shoal.learner import (
    Callback,
    ElasticTrainer,
    LearnerEnv,
    MixedPrecision,
    TrainingPlan,
    TrainingSetup,
)
from shoal.learner.backend import apply_gradient_policy
from tests.unit.test_trainer_standalone import (
    ATOL,
    DATASETS,
    SGD,
    VirtualWorldBackend,
    assert_state_close,
    make_model,
    plain_pytorch_training,
    world_3_2_4,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


class Recorder(Callback):
    """Records every hook call with what the trainer said about the primary learner."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def on_train_begin(self, plan: TrainingPlan, step: int) -> None:
        self.calls.append(("train_begin", plan.total_steps, step))

    def on_rescale(self, old_world: int, new_world: int, assignment: Any) -> None:
        self.calls.append(("rescale", old_world, new_world, assignment.step))

    def on_epoch_begin(self, epoch: int) -> None:
        self.calls.append(("epoch_begin", epoch))

    def on_iteration_end(self, record: Any) -> None:
        self.calls.append(("iteration_end", record.step, record.rank, self.trainer.is_primary))

    def on_epoch_end(self, epoch: int, result: Any) -> None:
        self.calls.append(("epoch_end", epoch, result is not None, self.trainer.is_primary))

    def on_train_end(self, result: Any) -> None:
        self.calls.append(("train_end", result.completed, result.is_primary))


def trainer(model: nn.Module, backend: Any = "local", **kwargs: Any) -> ElasticTrainer:
    return ElasticTrainer(
        model,
        lambda: DATASETS,
        nn.CrossEntropyLoss(),
        kwargs.pop("optimizer", SGD),
        seed=3,
        backend=backend,
        device="cpu",
        env=LearnerEnv(),
        **kwargs,
    )


def reference_loop(
    model: nn.Module,
    *,
    epochs: int = 2,
    batch_size: int = 64,
    seed: int = 3,
    clip: float | None = None,
    amp: str | None = None,
    init_scale: float = 2.0**16,
) -> tuple[list[float], list[bool]]:
    """Plain single-process PyTorch with the usual AMP recipe: autocast, GradScaler (float16),
    unscale_, clip_grad_norm_, scaler.step, scaler.update. Returns the losses and, per
    iteration, whether the scaler skipped the step."""
    x, y = DATASETS[0].tensors
    opt = torch.optim.SGD(model.parameters(), **SGD[1])
    loss_fn = nn.CrossEntropyLoss()
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, enabled=amp == "float16")
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(amp or "", None)
    losses, skipped = [], []
    for epoch in range(epochs):
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed + epoch))
        for start in range(0, len(y), batch_size):
            idx = order[start : start + batch_size]
            opt.zero_grad()
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = loss_fn(model(x[idx]), y[idx])
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            if clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped.append(amp == "float16" and scaler.get_scale() < before)
            losses.append(loss.item())
    return losses, skipped


# --------------------------------------------------------------------------------------------
# Callbacks and the primary learner
# --------------------------------------------------------------------------------------------


def test_callbacks_are_called_in_the_documented_order_standalone() -> None:
    recorder = Recorder()
    t = trainer(make_model(), callbacks=[recorder])
    result = t.train(epochs=2, batch_size=256)
    per_epoch = result.plan.iterations_per_epoch  # 1438 samples / 256 -> 6
    expected: list[tuple[Any, ...]] = [("train_begin", 2 * per_epoch, 0)]
    for epoch in range(2):
        expected.append(("epoch_begin", epoch))
        expected += [("iteration_end", epoch * per_epoch + i, 0, True) for i in range(per_epoch)]
        expected.append(("epoch_end", epoch, True, True))
    expected.append(("train_end", True, True))
    assert recorder.calls == expected
    assert t.is_primary and result.is_primary


def test_on_rescale_and_is_primary_follow_the_changing_world() -> None:
    recorder = Recorder()
    backend = VirtualWorldBackend(world_3_2_4, make_model, DATASETS[0])
    result = trainer(make_model(), backend=backend, callbacks=[recorder]).train(
        epochs=2, batch_size=64
    )
    rescales = [c for c in recorder.calls if c[0] == "rescale"]
    assert rescales == [("rescale", 3, 2, 9), ("rescale", 2, 4, 17), ("rescale", 4, 3, 30)]
    iterations = [c for c in recorder.calls if c[0] == "iteration_end"]
    # The learner under test is rank step % world: primary exactly where its rank is 0.
    assert all(primary == (rank == 0) for _, _, rank, primary in iterations)
    assert any(primary for *_, primary in iterations) and not all(
        primary for *_, primary in iterations
    )
    # Only the learner of rank 0 at an epoch's end evaluates; the others get None.
    ends = {c[1]: c[2:] for c in recorder.calls if c[0] == "epoch_end"}
    last_rank = {r.epoch: r.rank for r in result.history}
    assert ends == {e: (last_rank[e] == 0, last_rank[e] == 0) for e in (0, 1)}
    assert result.is_primary == (result.history[-1].rank == 0)
    assert recorder.calls[-1] == ("train_end", True, result.is_primary)


def test_bad_callbacks_and_settings_are_refused_naming_the_value() -> None:
    with pytest.raises(ValueError, match=r"callback \(<object"):
        trainer(make_model(), callbacks=[object()])
    with pytest.raises(ValueError, match=r"clip_grad_norm \(-1\.0\)"):
        trainer(make_model(), clip_grad_norm=-1.0)
    with pytest.raises(ValueError, match=r"clip_grad_norm \(nan\)"):
        trainer(make_model(), clip_grad_norm=float("nan"))
    with pytest.raises(ValueError, match=r"amp dtype \('float8'\)"):
        trainer(make_model(), amp="float8")
    with pytest.raises(ValueError, match=r"amp \(torch.float64\)"):
        trainer(make_model(), amp=torch.float64)
    with pytest.raises(ValueError, match=r"growth_interval \(0\)"):
        MixedPrecision("float16", growth_interval=0)


SCRIPT = """
import sys, logging, torch
from torch import nn
from torch.utils.data import TensorDataset
from shoal.learner import ElasticTrainer, LearnerEnv
if sys.argv[1] == "configured":
    logging.basicConfig(level=logging.WARNING)
torch.manual_seed(0)
data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
t = ElasticTrainer(nn.Linear(4, 2), lambda: (data, data), nn.CrossEntropyLoss(), "SGD",
                   device="cpu", env=LearnerEnv())
t.train(epochs=1, batch_size=32)
"""


@pytest.mark.parametrize("mode", ["bare", "configured"])
def test_logging_goes_to_stderr_at_info_only_when_the_script_configured_none(mode: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT), mode],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""
    if mode == "bare":
        assert "INFO shoal.learner: epoch 1/1, train loss" in out.stderr
    else:  # the script's WARNING level wins: nothing at INFO
        assert "epoch 1/1" not in out.stderr


# --------------------------------------------------------------------------------------------
# Clipping and mixed precision: equal to the single-process recipe
# --------------------------------------------------------------------------------------------


def test_global_clipping_standalone_equals_clip_grad_norm_in_a_plain_loop() -> None:
    reference = make_model()
    ref_losses, _ = reference_loop(reference, clip=0.15)
    result = trainer(make_model(), clip_grad_norm=0.15).train(epochs=2, batch_size=64)
    assert_state_close(result.params, reference.state_dict(), ATOL)
    assert result.losses == pytest.approx(ref_losses, abs=ATOL)
    norms = [r.grad_norm for r in result.history]
    assert all(n is not None for n in norms)
    assert sum(n > 0.15 for n in norms) > len(norms) // 2  # the clip was active


def test_global_clipping_in_a_changing_world_equals_the_single_process_loop() -> None:
    # Three, two, four learners' shares reduced, then clipped as one gradient: clipping each
    # share before the reduction would give another result.
    reference = make_model()
    ref_losses, _ = reference_loop(reference, clip=0.15)
    backend = ClippingVirtualWorld(world_3_2_4, make_model, DATASETS[0])
    result = trainer(make_model(), backend=backend, clip_grad_norm=0.15).train(
        epochs=2, batch_size=64
    )
    assert_state_close(result.params, reference.state_dict(), ATOL)
    assert result.losses == pytest.approx(ref_losses, abs=ATOL)


class ClippingVirtualWorld(VirtualWorldBackend):
    """The virtual world of test_trainer_standalone, applying the setup's gradient policy to
    the reduced gradient before its optimizer steps, as the local and collective backends do."""

    def initialize(self, setup: TrainingSetup):
        state = super().initialize(setup)
        step = self.optimizer.step

        def clipped_step() -> None:
            apply_gradient_policy([p.grad for p in self.params], setup)
            step()

        self.optimizer.step = clipped_step  # type: ignore[method-assign]
        return state


def test_bfloat16_autocast_standalone_equals_autocast_in_a_plain_loop() -> None:
    reference = make_model()
    ref_losses, _ = reference_loop(reference, amp="bfloat16", clip=1.0)
    result = trainer(make_model(), amp="bfloat16", clip_grad_norm=1.0).train(
        epochs=2, batch_size=64
    )
    assert_state_close(result.params, reference.state_dict(), ATOL)
    assert result.losses == pytest.approx(ref_losses, abs=ATOL)
    assert all(r.loss_scale is None and not r.skipped for r in result.history)


def test_float16_loss_scaling_skips_and_backs_off_exactly_as_grad_scaler() -> None:
    # A scale of 2**40 overflows float16 in the backward pass: the first iterations are
    # skipped and the scale halves each time, as GradScaler's are, then training proceeds.
    amp = MixedPrecision("float16", init_scale=2.0**40, growth_interval=5)
    reference = make_model()
    ref_losses, ref_skipped = reference_loop_scaled(reference, amp, clip=0.5)
    result = trainer(make_model(), amp=amp, clip_grad_norm=0.5).train(epochs=2, batch_size=64)
    skipped = [r.skipped for r in result.history]
    assert skipped == ref_skipped
    assert 0 < sum(skipped) < len(skipped) - 10
    assert_state_close(result.params, reference.state_dict(), ATOL)
    assert result.losses == pytest.approx(ref_losses, abs=ATOL)
    scales = [r.loss_scale for r in result.history]
    assert scales[0] == 2.0**40 and scales[1] == 2.0**39


def reference_loop_scaled(
    model: nn.Module, amp: MixedPrecision, *, clip: float
) -> tuple[list[float], list[bool]]:
    x, y = DATASETS[0].tensors
    opt = torch.optim.SGD(model.parameters(), **SGD[1])
    loss_fn = nn.CrossEntropyLoss()
    scaler = torch.amp.GradScaler(
        "cpu", init_scale=amp.init_scale, growth_interval=amp.growth_interval
    )
    losses, skipped = [], []
    for epoch in range(2):
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(3 + epoch))
        for start in range(0, len(y), 64):
            idx = order[start : start + 64]
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(model(x[idx]), y[idx])
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), clip)
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped.append(scaler.get_scale() < before)
            losses.append(loss.item())
    return losses, skipped


# --------------------------------------------------------------------------------------------
# Schedules by name
# --------------------------------------------------------------------------------------------


def test_warmup_cosine_by_name_equals_the_same_schedule_in_a_plain_loop() -> None:
    total = 2 * 23  # 1438 samples in batches of 64, two epochs

    def expected(step: int) -> float:  # written out independently of shoal.learner.schedules
        if step < 5:
            return 0.05 * (step + 1) / 5
        return 0.5 * 0.05 * (1 + math.cos(math.pi * (step - 5) / (total - 5)))

    reference = make_model()
    ref_losses = plain_pytorch_training(
        reference, DATASETS[0], epochs=2, batch_size=64, seed=3, lr_schedule=expected
    )
    result = trainer(make_model(), lr_schedule=("warmup_cosine", {"warmup": 5})).train(
        epochs=2, batch_size=64
    )
    assert [r.lr for r in result.history] == pytest.approx([expected(s) for s in range(total)])
    assert_state_close(result.params, reference.state_dict(), ATOL)
    assert result.losses == pytest.approx(ref_losses, abs=ATOL)


def test_step_schedule_by_name_per_epoch_equals_torch_step_lr() -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step_lr = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    lrs = []
    for _ in range(3):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        step_lr.step()
    result = trainer(
        make_model(),
        lr_schedule=("step", {"step_size": 1, "gamma": 0.5}),
        lr_schedule_unit="epoch",
    ).train(epochs=3, batch_size=256)
    by_epoch = {r.epoch: r.lr for r in result.history}
    assert [by_epoch[e] for e in range(3)] == pytest.approx(lrs)


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        ("linear", r"lr_schedule \('linear'\) is not one of"),
        (("warmup_cosine", {"warmup": -1}), r"warmup \(-1\) must be an int >= 0"),
        (("step", {"step_size": 0}), r"step_size \(0\) must be an int >= 1"),
        (("step", {"steps": 3}), r"lr_schedule 'step' rejected its arguments"),
    ],
)
def test_bad_schedules_are_refused_naming_the_value(schedule: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        trainer(make_model(), lr_schedule=schedule)


# --------------------------------------------------------------------------------------------
# Parameter groups
# --------------------------------------------------------------------------------------------


def groups_of(model: nn.Module) -> list[dict[str, Any]]:
    """Per-layer rates and no weight decay on biases: what real scripts do."""
    first, biases = [model[0].weight], [p for n, p in model.named_parameters() if "bias" in n]
    return [
        {"params": first, "lr": 0.003},
        {"params": biases, "weight_decay": 0.0},
    ]


def test_param_groups_with_a_schedule_equal_the_same_groups_in_a_plain_loop() -> None:
    adamw = ("AdamW", {"lr": 0.01, "weight_decay": 0.05})
    schedule = ("warmup_cosine", {"warmup": 5})
    total = 2 * 23

    reference = make_model()
    opt = torch.optim.AdamW(groups_of(reference), **adamw[1])
    rest = [
        p
        for p in reference.parameters()
        if all(p is not q for g in opt.param_groups for q in g["params"])
    ]
    opt.add_param_group({"params": rest})
    scale = [g["lr"] / 0.01 for g in opt.param_groups]
    x, y = DATASETS[0].tensors
    step = 0
    for epoch in range(2):
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(3 + epoch))
        for start in range(0, len(y), 64):
            idx = order[start : start + 64]
            base = (
                0.01 * (step + 1) / 5
                if step < 5
                else (0.5 * 0.01 * (1 + math.cos(math.pi * (step - 5) / (total - 5))))
            )
            for g, s in zip(opt.param_groups, scale, strict=True):
                g["lr"] = base * s
            opt.zero_grad()
            nn.CrossEntropyLoss()(reference(x[idx]), y[idx]).backward()
            opt.step()
            step += 1

    t = trainer(make_model(), optimizer=adamw, lr_schedule=schedule, param_groups=groups_of)
    assert t.optimizer_spec.groups == (
        (("0.weight",), {"lr": 0.003}),
        (("0.bias", "2.bias", "4.bias"), {"weight_decay": 0.0}),
    )
    result = t.train(epochs=2, batch_size=64)
    assert_state_close(result.params, reference.state_dict(), ATOL)


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        (lambda m: [{"params": [torch.zeros(3)]}], r"param group 0 holds 'tensor of shape \(3,\)'"),
        (lambda m: [{"lr": 0.1}], r"param group 0 \(\{'lr': 0.1\}\) must be a dict with 'params'"),
        (
            lambda m: [{"params": [m[0].weight]}, {"params": ["0.weight"]}],
            r"parameter '0.weight' is in more than one param group",
        ),
        (lambda m: [{"params": ["0.bias"], "betas": object()}], r"optimizer argument betas"),
    ],
)
def test_bad_param_groups_are_refused_naming_the_group(groups: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        trainer(make_model(), optimizer=("AdamW", {"lr": 0.01}), param_groups=groups)


def test_the_parameter_server_mode_sends_the_param_groups_the_shards_build() -> None:
    # The groups travel by name in the Join's OptimizerSpec; a shard holding every parameter
    # builds the same groups (with the same lr_scale) as the learner's optimizer.
    from shoal.learner.grpc_backend import optimizer_proto
    from shoal.param_sync.servicer_common import _optimizer_config
    from shoal.param_sync.shard import build_optimizer

    model = make_model()
    spec = trainer(make_model(), param_groups=groups_of).optimizer_spec
    setup = TrainingSetup(
        plan=TrainingPlan(epochs=1, batch_size=8, num_samples=16),
        optimizer=spec,
        param_specs=(),
        buffer_specs=(),
        params=[],
        buffers=[],
    )
    proto = optimizer_proto(setup)
    assert json.loads(proto.param_groups_json) == [[list(n), dict(o)] for n, o in spec.groups]
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    on_shard = build_optimizer(_optimizer_config(proto), params, names)
    on_learner = spec.create(params, names)
    assert len(on_shard.param_groups) == len(on_learner.param_groups)
    # (but the kernels: the shard asks for foreach ones, the same bytes: optimizer.py)
    for ours, theirs in zip(on_shard.param_groups, on_learner.param_groups, strict=True):
        assert [id(p) for p in ours["params"]] == [id(p) for p in theirs["params"]]
        assert ours["foreach"] is True
        assert {k: v for k, v in ours.items() if k not in ("params", "foreach")} == {
            k: v for k, v in theirs.items() if k not in ("params", "foreach")
        }
    no_groups = dataclasses.replace(setup, optimizer=dataclasses.replace(spec, groups=()))
    assert optimizer_proto(no_groups).param_groups_json == ""


def test_a_collective_checkpoint_of_grouped_adamw_restores_every_group_and_its_state(
    tmp_path: Path,
) -> None:
    # state_dict() numbers parameters group after group, not in the model's order: the
    # learner-written checkpoint must map them back by name, and restore each group's settings.
    import json

    from shoal.learner.backend import TensorSpec
    from shoal.learner.collective import CollectiveBackend
    from shoal.v1 import parameter_sync_service_pb2 as ps_pb2

    adamw = ("AdamW", {"lr": 0.01, "weight_decay": 0.05})

    def backend_for(model: nn.Module) -> CollectiveBackend:
        spec = trainer(model, optimizer=adamw, param_groups=groups_of).optimizer_spec
        named = list(model.named_parameters())
        params = [p.detach() for _, p in named]
        b = CollectiveBackend.__new__(CollectiveBackend)
        b._setup = TrainingSetup(  # type: ignore[attr-defined]
            plan=TrainingPlan(epochs=1, batch_size=8, num_samples=16),
            optimizer=spec,
            param_specs=tuple(TensorSpec.of(n, p) for n, p in named),
            buffer_specs=(),
            params=params,
            buffers=[],
        )
        b._params, b._buffers, b._pending, b.job_id = params, [], None, "job"
        b._optimizer = spec.create(params, [n for n, _ in named])
        return b

    source = backend_for(make_model(seed=1))
    torch.manual_seed(5)
    for _ in range(3):
        for p in source._params:
            p.grad = torch.randn_like(p)
        source._optimizer.step()
    source._state_step = 3
    reply = ps_pb2.BoundaryResponse(completed_iterations=3, checkpoint_directory=str(tmp_path))
    written = source._write_checkpoint(reply)
    manifest = {
        "iteration": 3,
        "shards": [{"file": written.file, "size": written.size_bytes, "sha256": written.sha256}],
    }
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))

    restored = backend_for(make_model(seed=2))
    restored._load_checkpoint(str(tmp_path), 3)
    for a, b in zip(source._params, restored._params, strict=True):
        assert torch.equal(a, b)
    want, got = source._optimizer.state_dict(), restored._optimizer.state_dict()
    # (JSON in the checkpoint turns tuples such as betas into lists, as before groups.)
    assert json.loads(json.dumps(got["param_groups"])) == json.loads(
        json.dumps(want["param_groups"])
    )
    assert [g["lr_scale"] for g in got["param_groups"]] == pytest.approx([0.3, 1.0, 1.0])
    assert want["state"].keys() == got["state"].keys()
    for index, entry in want["state"].items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(got["state"][index][key]))


# --------------------------------------------------------------------------------------------
# Workers for slow datasets
# --------------------------------------------------------------------------------------------


class SlowDataset(torch.utils.data.Dataset):
    """Items one at a time, each after a short wait (decoding, augmentation, file reads)."""

    def __init__(self, base: torch.utils.data.TensorDataset, wait: float = 0.0005) -> None:
        self.x, self.y = base.tensors
        self.wait = wait

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        import time

        time.sleep(self.wait)
        return self.x[i], self.y[i]


def test_worker_processes_fetch_the_same_samples_and_train_the_same_model() -> None:
    slow = (SlowDataset(DATASETS[0]), DATASETS[1])
    results = [
        ElasticTrainer(
            make_model(),
            lambda: slow,
            nn.CrossEntropyLoss(),
            SGD,
            seed=3,
            device="cpu",
            env=LearnerEnv(),
            num_workers=workers,
            max_batch_per_device=24,
        ).train(epochs=1, batch_size=64)
        for workers in (0, 3)
    ]
    plain, parallel = (r.params for r in results)
    assert all(torch.equal(plain[k], parallel[k]) for k in plain)
    assert [r.loss for r in results[0].history] == [r.loss for r in results[1].history]


def test_bad_num_workers_is_refused_naming_the_value() -> None:
    with pytest.raises(ValueError, match=r"num_workers \(-1\) must be an int >= 0"):
        trainer(make_model(), num_workers=-1)
