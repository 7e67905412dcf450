"""Parameter groups on the parameter-server shards (shoal.param_sync.shard, no network): the
job's groups (per-group learning rates and weight decay) split over two slices step exactly
as one torch optimizer with the same groups over the whole model, a schedule's rate keeps
the groups' ratios, and a slice's state survives a round trip (the optimizer numbers its
parameters group after group, the files name them)."""

from __future__ import annotations

import json

import pytest
import torch

from shoal.contract.wire import TensorMeta, byte_view, pack_layout
from shoal.param_sync.coordinator import OptimizerConfig
from shoal.param_sync.shard import Contribution, ShardJob, build_optimizer
from shoal.runtime.errors import InvalidField

SHAPES = {"l0.weight": (4, 3), "l0.bias": (4,), "l1.weight": (2, 4), "l1.bias": (2,)}
GROUPS = [[["l0.weight"], {"lr": 0.02}], [["l0.bias", "l1.bias"], {"weight_decay": 0.0}]]
CONFIG = OptimizerConfig(
    "SGD",
    json.dumps({"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}),
    param_groups_json=json.dumps(GROUPS),
)
# Two slices that cut through the groups: each holds part of two groups.
SLICES = [["l0.weight", "l1.bias"], ["l0.bias", "l1.weight"]]


def metas(names: list[str]) -> list[TensorMeta]:
    out = []
    for name in names:
        numel = 1
        for d in SHAPES[name]:
            numel *= d
        out.append(TensorMeta(name, "float32", SHAPES[name], 0, 4 * numel))
    return pack_layout(out)[0]


def contribution(sj: ShardJob, k: int, values: dict[str, torch.Tensor], n: int) -> Contribution:
    layout, total = pack_layout(list(sj.metas))
    flat = bytearray(total)
    for m in layout:
        flat[m.offset : m.end] = byte_view(values[m.name].contiguous()).tobytes()
    c = Contribution("a", 1, k, n, 0.0, 0.0, list(enumerate(layout)), total)
    c.chunks.append(memoryview(bytes(flat)))
    return c


def reference_optimizer(params: dict[str, torch.Tensor]) -> torch.optim.Optimizer:
    groups = [{"params": [params[n] for n in names], **o} for names, o in GROUPS]
    listed = {n for names, _ in GROUPS for n in names}
    groups.append({"params": [p for n, p in params.items() if n not in listed]})
    return torch.optim.SGD(groups, lr=0.05, momentum=0.9, weight_decay=0.01)


@pytest.mark.parametrize("schedule", [False, True])
def test_groups_split_over_two_slices_step_as_one_optimizer_with_the_same_groups(
    schedule: bool,
) -> None:
    torch.manual_seed(0)
    start = {n: torch.randn(s) for n, s in SHAPES.items()}
    reference = {n: t.clone().requires_grad_(True) for n, t in start.items()}
    optimizer = reference_optimizer(reference)
    base = [g["lr"] / 0.05 for g in optimizer.param_groups]
    shards = [ShardJob("job-1", i, metas(names), CONFIG) for i, names in enumerate(SLICES)]
    for sj in shards:
        sj.initialize(contribution(sj, 0, start, 0))
    for k in range(5):
        grads = {n: torch.randn(s) for n, s in SHAPES.items()}
        lr = 0.05 * (0.5 + 0.1 * k) if schedule else 0.0
        for sj in shards:
            c = contribution(sj, k, grads, 3)
            c.learning_rate = lr
            assert sj.accumulate(c, frozenset("a"))
            sj.commit(1, k)
        for name, p in reference.items():
            p.grad = grads[name].clone()
        if schedule:
            for g, scale in zip(optimizer.param_groups, base, strict=True):
                g["lr"] = lr * scale
        optimizer.step()
        for sj in shards:
            for name, value in sj.named_tensors().items():
                torch.testing.assert_close(value, reference[name].detach(), rtol=0, atol=1e-6)
    # The first group's slower rate is in effect (not the optimizer's 0.05 everywhere).
    scales = {round(g["lr_scale"], 9) for sj in shards for g in sj.optimizer.param_groups}
    assert scales == {0.4, 1.0}


def test_a_grouped_slice_survives_a_state_round_trip_and_keeps_stepping_alike() -> None:
    torch.manual_seed(1)
    start = {n: torch.randn(s) for n, s in SHAPES.items()}
    sj = ShardJob("job-1", 0, metas(SLICES[0]), CONFIG)
    sj.initialize(contribution(sj, 0, start, 0))
    for k in range(2):
        sj.accumulate(
            contribution(sj, k, {n: torch.randn(s) for n, s in SHAPES.items()}, 1), frozenset("a")
        )
        sj.commit(1, k)
    copy = ShardJob("job-1", 0, metas(SLICES[0]), CONFIG)
    assert copy.load_state_bytes(sj.state_bytes(2)) == 2
    grads = {n: torch.randn(s) for n, s in SHAPES.items()}
    for target in (sj, copy):
        target.accumulate(contribution(target, 2, grads, 1), frozenset("a"))
        target.commit(1, 2)
    for name, value in sj.named_tensors().items():
        assert torch.equal(value, copy.named_tensors()[name]), name
    assert [g["lr"] for g in copy.optimizer.param_groups] == [
        g["lr"] for g in sj.optimizer.param_groups
    ]


@pytest.mark.parametrize(
    "groups",
    [
        "not json",
        '{"a": 1}',
        '[["l0.weight"]]',
        '[[["l0.weight"], {"params": []}]]',
        '[[["l0.weight"], {}], [["l0.weight"], {"lr": 1}]]',
        "[[[1], {}]]",
    ],
)
def test_malformed_groups_are_refused_naming_the_field(groups: str) -> None:
    config = OptimizerConfig("SGD", '{"lr": 0.1}', param_groups_json=groups)
    with pytest.raises(InvalidField, match=r"optimizer\.param_groups_json"):
        build_optimizer(config, [])
