"""The commit's grouped step (shoal.param_sync.shard, no network): stepping a slice group by
group (one optimizer step per group) leaves exactly the bytes one step of the whole slice
leaves, for every optimizer the shard groups, over several iterations, with parameters
without a gradient, buffers, clipping and a learning-rate schedule, with the foreach kernels
the shard uses by default as with torch's single-tensor step; any other optimizer (or one
asking for fused kernels) is stepped whole; and the encoding a commit publishes says which
chunks are stepped."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from shoal.contract.wire import TensorMeta, byte_view, pack_layout
from shoal.param_sync.coordinator import OptimizerConfig
from shoal.param_sync.optimizer import FOREACH_SAME
from shoal.param_sync.shard import PER_PARAMETER_OPTIMIZERS, Contribution, ShardJob
from shoal.param_sync.shard_encoding import Encoded

# Declared (model) order; a buffer and an integer buffer in between; "frozen" never gets a
# gradient, "sometimes" only on odd iterations.
SHAPES = {
    "a.weight": (16, 8),
    "a.bias": (16,),
    "bn.running_mean": (16,),
    "bn.num_batches_tracked": (),
    "frozen": (5,),
    "b.weight": (4, 16),
    "sometimes": (3, 3),
    "b.bias": (4,),
}
BUFFERS = {"bn.running_mean", "bn.num_batches_tracked"}
DTYPES = {"bn.num_batches_tracked": "int64"}

CASES = [
    ("SGD", {"lr": 0.05}),
    ("SGD", {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01, "nesterov": True}),
    ("SGD", {"lr": 0.05, "momentum": 0.9, "dampening": 0.1, "maximize": True}),
    ("Adam", {"lr": 0.01, "weight_decay": 0.01}),
    ("Adam", {"lr": 0.01, "amsgrad": True, "betas": [0.8, 0.99]}),
    ("AdamW", {"lr": 0.01, "weight_decay": 0.1}),
    ("AdamW", {"lr": 0.01, "amsgrad": True}),
    ("Adamax", {"lr": 0.01, "weight_decay": 0.01}),
    ("NAdam", {"lr": 0.01, "weight_decay": 0.01}),
    ("NAdam", {"lr": 0.01, "weight_decay": 0.01, "decoupled_weight_decay": True}),
    ("RAdam", {"lr": 0.01, "weight_decay": 0.01}),
    ("RAdam", {"lr": 0.01, "weight_decay": 0.01, "decoupled_weight_decay": True}),
    ("Adagrad", {"lr": 0.05, "weight_decay": 0.01, "lr_decay": 0.01}),
    ("Adadelta", {"lr": 1.0, "weight_decay": 0.01}),
    ("RMSprop", {"lr": 0.01, "momentum": 0.9, "centered": True, "weight_decay": 0.01}),
    ("RMSprop", {"lr": 0.01}),
    ("Rprop", {"lr": 0.01}),
    ("ASGD", {"lr": 0.01, "weight_decay": 0.01, "t0": 2}),
]


def metas() -> list[TensorMeta]:
    out = []
    for name, shape in SHAPES.items():
        dtype = DTYPES.get(name, "float32")
        numel = 1
        for d in shape:
            numel *= d
        out.append(
            TensorMeta(
                name, dtype, shape, 0, 8 * numel if dtype == "int64" else 4 * numel, name in BUFFERS
            )
        )
    return pack_layout(out)[0]


def contribution(sj: ShardJob, k: int, values: dict[str, torch.Tensor], n: int) -> Contribution:
    layout, total = pack_layout(list(sj.metas))
    flat = bytearray(total)
    for m in layout:
        flat[m.offset : m.end] = byte_view(values[m.name].contiguous()).tobytes()
    c = Contribution("a", 1, k, n, 0.0, 0.0, list(enumerate(layout)), total)
    c.chunks.append(memoryview(bytes(flat)))
    if "sometimes" in values and k % 2 == 0:
        c.absent = frozenset({sj.index["sometimes"], sj.index["frozen"]})
    else:
        c.absent = frozenset({sj.index["frozen"]})
    return c


def values(generator: torch.Generator, scale: float = 1.0) -> dict[str, torch.Tensor]:
    out = {}
    for name, shape in SHAPES.items():
        if DTYPES.get(name) == "int64":
            out[name] = torch.randint(0, 100, shape, generator=generator)
        else:
            out[name] = torch.randn(shape, generator=generator) * scale
    return out


def run(name: str, kwargs: dict, group_bytes: int, *, clip: float, iterations: int = 4) -> bytes:
    config = OptimizerConfig(name, json.dumps(kwargs), clip_grad_norm=clip)
    sj = ShardJob("job-1", 0, metas(), config, step_group_bytes=group_bytes)
    generator = torch.Generator().manual_seed(7)
    sj.initialize(contribution(sj, 0, values(generator), 0))
    for k in range(iterations):
        c = contribution(sj, k, values(generator, 3.0), 3)
        c.learning_rate = kwargs["lr"] * (1 + 0.25 * k)
        assert sj.accumulate(c, frozenset("a"))
        sj.commit(1, k, sj.grad_sq_norm() ** 0.5)
    return bytes(sj.flat.numpy())


@pytest.mark.parametrize(
    ("name", "kwargs"), CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)]
)
def test_a_grouped_step_leaves_the_bytes_of_one_step(name: str, kwargs: dict) -> None:
    whole = run(name, kwargs, 0, clip=0.5)
    assert len(
        ShardJob(
            "j", 0, metas(), OptimizerConfig(name, json.dumps(kwargs)), step_group_bytes=1
        ).step_groups
    ) == len(SHAPES)
    assert run(name, kwargs, 1, clip=0.5) == whole  # a group per tensor
    assert run(name, kwargs, 600, clip=0.5) == whole  # groups of several tensors
    assert run(name, kwargs, 1, clip=0.0) == run(name, kwargs, 0, clip=0.0)
    # The shard's default foreach kernels leave the bytes of torch's single-tensor step
    # (the CPU's default, which a plain loop runs); the other classes' differ in the last
    # bits (so the shard keeps the single-tensor step for them, and steps them whole when a
    # job asks for foreach).
    single = run(name, {**kwargs, "foreach": False}, 0, clip=0.5)
    foreach = run(name, {**kwargs, "foreach": True}, 0, clip=0.5)
    assert single == whole
    assert (foreach == single) == (getattr(torch.optim, name) in FOREACH_SAME)


def test_the_shard_steps_with_foreach_kernels_unless_the_job_says_otherwise() -> None:
    def kernels(kwargs: dict) -> object:
        sj = ShardJob("j", 0, metas(), OptimizerConfig("Adam", json.dumps(kwargs)))
        return sj.optimizer.defaults.get("foreach")

    assert kernels({"lr": 0.1}) is True
    nadam = ShardJob("j", 0, metas(), OptimizerConfig("NAdam", '{"lr": 0.1}'))
    assert not nadam.optimizer.defaults.get("foreach")  # not the same bytes: single-tensor
    foreach = OptimizerConfig("NAdam", '{"lr": 0.1, "foreach": true}')
    assert len(ShardJob("j", 0, metas(), foreach, step_group_bytes=1).step_groups) == 1
    assert kernels({"lr": 0.1, "foreach": False}) is False
    assert kernels({"lr": 0.1, "fused": True}) is None


def test_every_grouped_optimizer_is_covered() -> None:
    assert {getattr(torch.optim, n) for n, _ in CASES} == set(PER_PARAMETER_OPTIMIZERS)


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("Adam", {"lr": 0.1, "fused": True}),
        ("LBFGS", {"lr": 0.1}),
        ("SparseAdam", {"lr": 0.1}),
    ],
)
def test_other_optimizers_step_the_whole_slice_at_once(name: str, kwargs: dict) -> None:
    try:
        sj = ShardJob(
            "j", 0, metas(), OptimizerConfig(name, json.dumps(kwargs)), step_group_bytes=1
        )
    except Exception as exc:  # a class torch refuses on these tensors: not ours
        pytest.skip(f"torch.optim.{name} refuses: {exc}")
    assert len(sj.step_groups) == 1
    assert sj.step_groups[0] == (list(range(len(SHAPES))), sj.total_bytes)


def test_group_watermarks_ascend_to_the_total_and_cover_every_tensor() -> None:
    sj = ShardJob("j", 0, metas(), OptimizerConfig("SGD", '{"lr": 0.1}'), step_group_bytes=300)
    seen = [j for indices, _ in sj.step_groups for j in indices]
    assert seen == list(range(len(SHAPES)))
    marks = [mark for _, mark in sj.step_groups]
    assert marks == sorted(marks) and marks[-1] == sj.total_bytes and len(marks) > 2
    for indices, mark in sj.step_groups:
        assert sj.metas[indices[-1]].end <= mark
        assert all(m.offset >= mark for m in sj.metas[indices[-1] + 1 :])


def test_a_published_encoding_hands_out_a_chunk_only_once_it_is_stepped() -> None:
    """The commit publishes its encoding before it steps; each chunk waits for its bytes."""
    sj = ShardJob(
        "j", 0, metas(), OptimizerConfig("SGD", '{"lr": 0.1}'), chunk_bytes=64, step_group_bytes=300
    )
    generator = torch.Generator().manual_seed(1)
    sj.initialize(contribution(sj, 0, values(generator), 0))
    assert sj.accumulate(contribution(sj, 0, values(generator), 2), frozenset("a"))
    seen: list[int] = []
    published: list[Encoded] = []

    async def main() -> list[tuple[int, int]]:
        loop = asyncio.get_running_loop()
        order: list[tuple[int, int]] = []
        got = asyncio.Event()

        def publish(encoded: Encoded) -> None:
            encoded.bind(loop)
            published.append(encoded)
            loop.call_soon_threadsafe(got.set)
            seen.append(encoded.stepped)
            with pytest.raises(RuntimeError, match="before it was stepped"):
                encoded.chunk(encoded.count - 1)

        async def reader() -> None:
            await got.wait()
            encoded = published[0]
            for i in range(encoded.count):
                await encoded.ready(i)
                assert encoded.ranges[i][1] <= encoded.stepped
                encoded.chunk(i)
                order.append((i, encoded.stepped))

        task = asyncio.ensure_future(reader())
        result = await loop.run_in_executor(None, sj.commit, 1, 0, 0.0, publish)
        await asyncio.wait_for(task, 30)
        assert result is published[0]
        return order

    order = asyncio.run(main())
    assert seen == [0]
    assert [i for i, _ in order] == list(range(published[0].count))
    assert published[0].header.iteration == 0 and published[0].header.num_samples == 2
    # The parameters sent are the stepped ones: the same as a fresh encoding after the commit.
    assert published[0].chunks == sj.current().chunks


def test_a_commit_failing_part_way_fails_the_readers_still_waiting() -> None:
    sj = ShardJob(
        "j", 0, metas(), OptimizerConfig("SGD", '{"lr": 0.1}'), chunk_bytes=64, step_group_bytes=1
    )
    generator = torch.Generator().manual_seed(2)
    sj.initialize(contribution(sj, 0, values(generator), 0))
    assert sj.accumulate(contribution(sj, 0, values(generator), 2), frozenset("a"))
    step = sj.optimizer.step
    calls = []

    def failing_step(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the second group's step broke")
        return step(*args, **kwargs)

    sj.optimizer.step = failing_step  # type: ignore[method-assign]

    async def main() -> tuple[int, BaseException | None]:
        loop = asyncio.get_running_loop()
        published: list[Encoded] = []

        def publish(encoded: Encoded) -> None:
            encoded.bind(loop)
            published.append(encoded)

        with pytest.raises(RuntimeError, match="second group"):
            await loop.run_in_executor(None, sj.commit, 1, 0, 0.0, publish)
        encoded = published[0]
        await encoded.ready(0)  # the first group's bytes were stepped: that chunk may go
        try:
            await asyncio.wait_for(encoded.whole(), 30)
        except RuntimeError as exc:
            return encoded.stepped, exc
        return encoded.stepped, None

    stepped, error = asyncio.run(main())
    assert error is not None and "second group" in str(error)
    assert 0 < stepped < sj.total_bytes
    assert sj.completed == 0 and sj.pending is not None  # not counted as committed
