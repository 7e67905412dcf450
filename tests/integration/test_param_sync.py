"""The parameter-sync service over gRPC: two shard servers on port 0 (in this process, with auth)
driven by hand-written learners, so every byte on the wire is the test's choice. Covers the
weighted aggregation, optimizers by name, the two-phase commit under eviction, bad input (and
that it leaves the job unchanged), checkpoints with an interrupted one, metrics, and the etcd
registration of a real shard process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from google.protobuf import json_format
from grpc import aio

from shoal.contract.wire import (
    BundleReceiver,
    TensorMeta,
    byte_view,
    encode_chunk,
    encode_chunks,
    encode_header,
    header_of,
    pack_layout,
)
from shoal.learner.grpc_backend import stream_methods
from shoal.param_sync import checkpoint as ckpt
from shoal.param_sync.main import registry_key
from shoal.param_sync.service import ParameterSyncServicer
from shoal.runtime.config import MiB
from shoal.runtime.server import RunningServer
from shoal.v1 import (
    job_pb2,
    parameter_sync_service_pb2 as ps_pb2,
    parameter_sync_service_pb2_grpc as ps_grpc,
)
from tests.integration.shard_bed import InProcessShard, start_shard
from tests.support import async_wait_until, free_port, make_tokens

LAYOUT = pack_layout(
    [
        TensorMeta("w", "float32", (3, 4), 0, 48),
        TensorMeta("b", "float32", (4,), 0, 16),
        TensorMeta("bn.running_mean", "float32", (4,), 0, 16, buffer=True),
        TensorMeta("bn.num_batches_tracked", "int64", (), 0, 8, buffer=True),
    ]
)[0]
BY_NAME = {m.name: m for m in LAYOUT}
MAX_MESSAGE = 2 * MiB


def initial() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3, 4, generator=g),
        "b": torch.randn(4, generator=g),
        "bn.running_mean": torch.zeros(4),
        "bn.num_batches_tracked": torch.tensor(0, dtype=torch.int64),
    }


def grads(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g)}


class Cluster:
    """Two shards (shard 0 coordinates) and the calls of learners and of the scheduler."""

    def __init__(self, tmp: Path, tokens: dict[str, str], tokens_file: Path) -> None:
        self.tmp, self.tokens, self.tokens_file = tmp, tokens, tokens_file
        self.storage_uri = (tmp / "storage").as_uri()
        self.shards: list[InProcessShard] = []
        self.channels: dict[str, aio.Channel] = {}
        self.slices: dict[str, int] = {}

    async def start(self) -> Cluster:
        for i in range(2):
            shard = await start_shard(
                self.tokens_file,
                self.tokens["service"],
                self.storage_uri,
                shard_index=i,
                chunk_bytes=1 * MiB,
                max_message_bytes=MAX_MESSAGE,
            )
            self.shards.append(shard)
        return self

    @property
    def servers(self) -> list[RunningServer]:
        return [s.server for s in self.shards]

    @property
    def servicers(self) -> list[ParameterSyncServicer]:
        return [s.servicer for s in self.shards]

    async def stop(self) -> None:
        for channel in self.channels.values():
            await channel.close()
        self.channels.clear()
        for shard in self.shards:
            await shard.stop()

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.servers]

    def _channel(self, address: str) -> aio.Channel:
        if address not in self.channels:
            options = [("grpc.max_send_message_length", 16 * MiB)]
            self.channels[address] = aio.insecure_channel(address, options=options)
        return self.channels[address]

    def md(self, role: str = "service") -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.tokens[role]}"),) if role else ()

    async def call(self, method: str, request: Any, role: str = "service", shard: int = 0) -> Any:
        stub = ps_grpc.ParameterSyncServiceStub(self._channel(self.addresses[shard]))
        return await getattr(stub, method)(request, metadata=self.md(role), timeout=10)

    async def open_job(self, job: str, *, batch: int = 4, epochs: int = 1, every: int = 0) -> Any:
        spec = job_pb2.JobSpec(batch_size=batch, epochs=epochs, seed=1, checkpoint_every=every)
        request = ps_pb2.OpenJobRequest(job_id=job, spec=spec, shard_addresses=self.addresses)
        return await self.call("OpenJob", request, role="service")

    async def join(
        self,
        job: str,
        learner: str,
        *,
        optimizer: str = "SGD",
        hp: str = '{"lr": 0.5}',
        layout: list[TensorMeta] = LAYOUT,
        dataset_size: int = 8,
    ) -> ps_pb2.JoinResponse:
        request = ps_pb2.JoinRequest(
            job_id=job,
            learner_id=learner,
            layout=[m.to_proto() for m in layout],
            optimizer=ps_pb2.OptimizerSpec(name=optimizer, hyperparameters_json=hp),
            dataset_size=dataset_size,
        )
        reply = await self.call("Join", request)
        for s in reply.shards:
            for name in s.tensor_names:
                self.slices[name] = s.shard_index
        return reply

    def names(self, shard: int) -> list[str]:
        return [m.name for m in LAYOUT if self.slices[m.name] == shard]

    async def upload(self, job: str, learner: str, values: dict[str, torch.Tensor]) -> None:
        for shard in (0, 1):
            names = self.names(shard)
            metas, total = pack_layout([BY_NAME[n] for n in names])
            header = header_of(job_id=job, sender_id=learner, metas=metas, total_bytes=total)

            async def messages(
                header: Any = header, metas: Any = metas, total: int = total, names: Any = names
            ) -> AsyncIterator[bytes]:
                yield encode_header(ps_pb2.InitializeParametersRequest, header)
                for c in encode_chunks(metas, [byte_view(values[n]) for n in names], total):
                    yield c

            streams = stream_methods(self._channel(self.addresses[shard]))
            await streams["InitializeParameters"](messages(), metadata=self.md())

    async def boundary(
        self,
        job: str,
        learner: str,
        *,
        generation: int = 0,
        completed: int = -1,
        loss_sum: float = 0.0,
        n: int = 0,
        ahead: bool = False,
    ) -> ps_pb2.BoundaryResponse:
        request = ps_pb2.BoundaryRequest(
            job_id=job,
            learner_id=learner,
            generation=generation,
            completed_iteration=completed,
            loss_sum=loss_sum,
            num_samples=n,
            ahead=ahead,
        )
        return await self.call("Boundary", request)

    async def sync(
        self,
        job: str,
        learner: str,
        shard: int,
        *,
        generation: int,
        iteration: int,
        tensors: dict[str, torch.Tensor],
        n: int,
        loss_sum: float = 0.0,
        lr: float = 0.0,
        metas: list[TensorMeta] | None = None,
        extra: bytes = b"",
        raw: list[bytes] | None = None,
    ) -> tuple[ps_pb2.TensorBundleHeader, dict[str, torch.Tensor]]:
        """One SyncStep stream: ``tensors`` (this shard's), then the new parameters."""
        if metas is None:
            names = [m.name for m in LAYOUT if m.name in tensors]
            metas, total = pack_layout([BY_NAME[x] for x in names])
        else:
            names = [m.name for m in metas]
            total = max(m.end for m in metas)
        header = header_of(
            job_id=job,
            sender_id=learner,
            metas=metas,
            total_bytes=total,
            generation=generation,
            iteration=iteration,
            num_samples=n,
            loss_sum=loss_sum,
            learning_rate=lr,
        )

        async def messages() -> AsyncIterator[bytes]:
            yield encode_header(ps_pb2.SyncStepRequest, header)
            if raw is not None:
                for message in raw:
                    yield message
                return
            sources = [byte_view(tensors[x].contiguous()) for x in names]
            for c in encode_chunks(metas, sources, total, 16):
                yield c
            if extra:
                yield encode_chunk(extra)

        streams = stream_methods(self._channel(self.addresses[shard]))
        return await read_bundle(streams["SyncStep"](messages(), metadata=self.md()))

    async def pull(self, job: str, shard: int, generation: int = 0, learner: str = "x") -> Any:
        streams = stream_methods(self._channel(self.addresses[shard]))
        request = ps_pb2.PullParametersRequest(
            job_id=job, learner_id=learner, generation=generation
        )
        return (await read_bundle(streams["PullParameters"](request, metadata=self.md())))[1]


async def read_bundle(frames: Any) -> tuple[ps_pb2.TensorBundleHeader, dict[str, torch.Tensor]]:
    header, out, receiver = None, {}, None
    async for frame in frames:
        if header is None:
            header = frame.header
            metas = [TensorMeta.from_proto(t) for t in header.tensors]
            for m in metas:
                out[m.name] = torch.zeros(m.shape, dtype=m.torch_dtype)
            views = [byte_view(out[m.name]) for m in metas]

            def sink(i: int, off: int, seg: memoryview, views: Any = views) -> None:
                views[i][off : off + seg.nbytes] = bytearray(seg)

            receiver = BundleReceiver(metas, header.total_bytes, sink)
        else:
            receiver.feed(frame.chunk)
    receiver.finish()
    return header, out


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    tokens = make_tokens(tmp_path / "tokens")
    c = await Cluster(tmp_path, tokens, tmp_path / "tokens").start()
    try:
        yield c
    finally:
        await c.stop()


async def started(c: Cluster, job: str, learners: list[str], **open_args: Any) -> list[Any]:
    """Open ``job``, join ``learners`` (the first uploads ``initial()``), and return their
    first assignments (all admitted in the first generation)."""
    await c.open_job(job, **open_args)
    replies = [await c.join(job, x) for x in learners]
    assert replies[0].initialize and not any(r.initialize for r in replies[1:])
    await c.upload(job, learners[0], initial())
    answers = await asyncio.gather(*(c.boundary(job, x) for x in learners))
    assert all(a.action == ps_pb2.BOUNDARY_ACTION_RUN for a in answers)
    return [a.assignment for a in answers]


def of_shard(c: Cluster, shard: int, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in values.items() if c.slices[k] == shard}


async def contribute(
    c: Cluster,
    job: str,
    learner: str,
    a: Any,
    g: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    n: int,
    **kw: Any,
) -> list[Any]:
    tensors = {**g, **buffers}
    return await asyncio.gather(
        *(
            c.sync(
                job,
                learner,
                s,
                generation=a.generation,
                iteration=a.global_iteration,
                tensors=of_shard(c, s, tensors),
                n=n,
                **kw,
            )
            for s in (0, 1)
        )
    )


def merged(results: list[Any]) -> dict[str, torch.Tensor]:
    return {k: v for _, out in results for k, v in out.items()}


async def test_a_round_applies_the_sample_weighted_mean_gradient_and_averages_buffers(cluster):
    c = cluster
    a1, a2 = await started(c, "j", ["l1", "l2"], batch=4)
    assert (a1.rank, a2.rank, a1.world_size) == (0, 1, 2)
    assert (a1.sample_end - a1.sample_start, a2.sample_end - a2.sample_start) == (2, 2)
    g1, g2 = grads(1), grads(2)
    b1 = {"bn.running_mean": torch.full((4,), 1.0), "bn.num_batches_tracked": torch.tensor(3)}
    b2 = {"bn.running_mean": torch.full((4,), 5.0), "bn.num_batches_tracked": torch.tensor(7)}
    # Unequal sample counts (1 and 3) to check the weighting, whatever the ranges said.
    r1, r2 = await asyncio.gather(
        contribute(c, "j", "l1", a1, g1, b1, n=1, loss_sum=2.0),
        contribute(c, "j", "l2", a2, g2, b2, n=3, loss_sum=9.0),
    )
    new = merged(r1)
    assert all(torch.equal(new[k], v) for k, v in merged(r2).items())
    p0 = initial()
    mean = {k: (1 * g1[k] + 3 * g2[k]) / 4 for k in g1}
    for k in ("w", "b"):
        torch.testing.assert_close(new[k], p0[k] - 0.5 * mean[k], atol=1e-6, rtol=0)
    torch.testing.assert_close(new["bn.running_mean"], torch.full((4,), 4.0))
    assert int(new["bn.num_batches_tracked"]) == 7  # integer buffers: the maximum
    header = r1[0][0]
    assert header.loss_sum / header.num_samples == pytest.approx(11.0 / 4)


async def test_the_optimizer_is_any_torch_optim_class_by_name_and_the_header_lr_wins(cluster):
    c = cluster
    await c.open_job("adam", batch=2, epochs=1)
    hp = '{"lr": 0.01, "betas": [0.8, 0.99], "weight_decay": 0.1}'
    await c.join("adam", "l", optimizer="AdamW", hp=hp, dataset_size=4)
    await c.upload("adam", "l", initial())
    params = {k: v.clone().requires_grad_() for k, v in initial().items() if k in ("w", "b")}
    reference = torch.optim.AdamW(
        list(params.values()), lr=0.01, betas=(0.8, 0.99), weight_decay=0.1
    )
    buffers = {k: v for k, v in initial().items() if k not in params}
    for step, lr in ((0, 0.0), (1, 0.05)):
        a = (await c.boundary("adam", "l", generation=1, completed=step - 1, n=2)).assignment
        g = grads(10 + step)
        new = merged(await contribute(c, "adam", "l", a, g, buffers, n=2, lr=lr))
        for k, p in params.items():
            p.grad = g[k]
        if lr:
            reference.param_groups[0]["lr"] = lr
        reference.step()
        for k, p in params.items():
            torch.testing.assert_close(new[k], p.detach(), atol=1e-6, rtol=0)


async def test_bad_input_gets_the_right_status_and_leaves_the_job_unchanged(cluster):
    c = cluster
    [a] = await started(c, "j", ["l1"], batch=4)

    async def code_of(coro: Any) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(aio.AioRpcError) as info:
            await coro
        return info.value.code(), info.value.details()

    StatusCode = grpc.StatusCode
    # Unknown job.
    assert (await code_of(c.join("nope", "l")))[0] == StatusCode.NOT_FOUND
    assert (await code_of(c.boundary("nope", "l")))[0] == StatusCode.NOT_FOUND
    assert (await code_of(c.sync("nope", "l", 0, generation=1, iteration=0, tensors={}, n=0)))[
        0
    ] == StatusCode.NOT_FOUND
    # A layout or an optimizer that is not the job's / not torch's.
    other = [BY_NAME["w"], TensorMeta("b", "float32", (5,), 48, 20), *LAYOUT[2:]]
    code, text = await code_of(c.join("j", "l9", layout=other))
    assert code == StatusCode.INVALID_ARGUMENT and "layout[1]" in text
    await c.open_job("j2")
    code, text = await code_of(c.join("j2", "l", optimizer="Lion"))
    assert code == StatusCode.INVALID_ARGUMENT and "'Lion'" in text
    code, text = await code_of(c.join("j2", "l", hp='{"lr": 0.1, "warp": 9}'))
    assert code == StatusCode.INVALID_ARGUMENT and "warp" in text
    # Tensors that are not the shard's slice of the layout.
    g = grads(1)
    buffers = {k: v for k, v in initial().items() if k.startswith("bn.")}
    shard_w = c.slices["w"]
    tensors = of_shard(c, shard_w, {**g, **buffers})
    wrong = {**tensors, "w": torch.zeros(4, 3)}
    wrong_metas = pack_layout(
        [TensorMeta("w", "float32", (4, 3), 0, 48) if x == "w" else BY_NAME[x] for x in tensors]
    )[0]
    kw = {"generation": a.generation, "iteration": 0, "n": 4}
    code, text = await code_of(c.sync("j", "l1", shard_w, tensors=wrong, metas=wrong_metas, **kw))
    assert code == StatusCode.INVALID_ARGUMENT and "[4, 3]" in text, text
    stranger = pack_layout([TensorMeta("ghost", "float32", (1,), 0, 4)])[0]
    code, _ = await code_of(
        c.sync("j", "l1", shard_w, tensors={"ghost": torch.ones(1)}, metas=stranger, **kw)
    )
    assert code == StatusCode.INVALID_ARGUMENT
    # Stale generation, and an iteration that is not the running one.
    code, _ = await code_of(
        c.sync("j", "l1", shard_w, tensors=tensors, n=4, generation=0, iteration=0)
    )
    assert code == StatusCode.FAILED_PRECONDITION
    code, _ = await code_of(
        c.sync("j", "l1", shard_w, tensors=tensors, n=4, generation=a.generation, iteration=3)
    )
    assert code == StatusCode.FAILED_PRECONDITION
    # More bytes than declared; one message over the size limit.
    code, _ = await code_of(c.sync("j", "l1", shard_w, tensors=tensors, extra=b"12345678", **kw))
    assert code == StatusCode.RESOURCE_EXHAUSTED
    huge = [encode_chunk(bytes(MAX_MESSAGE + 1))]
    code, _ = await code_of(c.sync("j", "l1", shard_w, tensors=tensors, raw=huge, **kw))
    assert code == StatusCode.RESOURCE_EXHAUSTED
    # A stream that ends early, and one that sends a second header.
    short = [encode_chunk(bytes(8))]
    code, _ = await code_of(c.sync("j", "l1", shard_w, tensors=tensors, raw=short, **kw))
    assert code == StatusCode.INVALID_ARGUMENT
    header = encode_header(ps_pb2.SyncStepRequest, ps_pb2.TensorBundleHeader(job_id="j"))
    code, _ = await code_of(c.sync("j", "l1", shard_w, tensors=tensors, raw=[header], **kw))
    assert code == StatusCode.INVALID_ARGUMENT
    # Auth: no token, and a user calling what only services may.
    stub = ps_grpc.ParameterSyncServiceStub(c._channel(c.addresses[0]))
    with pytest.raises(aio.AioRpcError) as info:
        await stub.GetJobProgress(ps_pb2.GetJobProgressRequest(job_id="j"))
    assert info.value.code() == StatusCode.UNAUTHENTICATED
    code, _ = await code_of(
        c.call("EvictLearner", ps_pb2.EvictLearnerRequest(job_id="j", learner_id="l1"), role="user")
    )
    assert code == StatusCode.PERMISSION_DENIED

    # None of it changed the job: the round still gives exactly the expected update.
    progress = await c.call("GetJobProgress", ps_pb2.GetJobProgressRequest(job_id="j"))
    assert list(progress.member_learner_ids) == ["l1"]
    assert progress.progress.completed_iterations == 0
    new = merged(await contribute(c, "j", "l1", a, g, buffers, n=4))
    for k in ("w", "b"):
        torch.testing.assert_close(new[k], initial()[k] - 0.5 * g[k], atol=1e-6, rtol=0)


async def test_an_eviction_aborts_the_iteration_on_every_shard_even_a_ready_one(cluster):
    c = cluster
    _a1, _a2 = await started(c, "j", ["l1", "l2"], batch=4)
    g1, g2 = grads(1), grads(2)
    buffers = {k: v for k, v in initial().items() if k.startswith("bn.")}
    both = {**g1, **buffers}
    # l1 contributes to both shards, l2 only to shard 0: shard 0 is ready, shard 1 is not.
    waiting = [
        asyncio.ensure_future(
            c.sync("j", "l1", s, generation=1, iteration=0, tensors=of_shard(c, s, both), n=2)
        )
        for s in (0, 1)
    ]
    l2_on_0 = asyncio.ensure_future(
        c.sync(
            "j", "l2", 0, generation=1, iteration=0, tensors=of_shard(c, 0, {**g2, **buffers}), n=2
        )
    )
    coordinator = c.servicers[0]._coordinated["j"].coord
    await async_wait_until(lambda: coordinator.ready_shards == {0}, what="shard 0 ready")
    before = await c.pull("j", 0)
    reply = await c.call(
        "EvictLearner", ps_pb2.EvictLearnerRequest(job_id="j", learner_id="l2"), role="service"
    )
    assert reply.aborted_iteration == 0
    for future in [*waiting, l2_on_0]:
        with pytest.raises(aio.AioRpcError) as info:
            await future
        assert info.value.code() == grpc.StatusCode.ABORTED
    after = await c.pull("j", 0)
    assert all(torch.equal(before[k], after[k]) for k in before)  # shard 0 never stepped
    # The same iteration is re-issued to the survivor, alone, in a new generation.
    answer = await c.boundary("j", "l1")
    a = answer.assignment
    assert (a.global_iteration, a.generation, a.rank, a.world_size) == (0, 2, 0, 1)
    assert (a.sample_start, a.sample_end) == (0, 4) and not answer.pull_parameters
    new = merged(await contribute(c, "j", "l1", a, g1, buffers, n=4))
    for k in ("w", "b"):
        torch.testing.assert_close(new[k], initial()[k] - 0.5 * g1[k], atol=1e-6, rtol=0)
    # The evicted learner is a zombie now: refused everywhere.
    for coro in (
        c.boundary("j", "l2"),
        c.sync("j", "l2", 0, generation=2, iteration=1, tensors=of_shard(c, 0, both), n=2),
    ):
        with pytest.raises(aio.AioRpcError) as info:
            await coro
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_checkpoints_commit_with_the_manifest_and_an_interrupted_one_never_becomes_latest(
    cluster, monkeypatch, tmp_path
):
    c = cluster
    [a] = await started(c, "j", ["l1"], batch=2, epochs=3)
    buffers = {k: v for k, v in initial().items() if k.startswith("bn.")}
    after_one = merged(await contribute(c, "j", "l1", a, grads(1), buffers, n=2))
    reply = await c.call("CreateCheckpoint", ps_pb2.CreateCheckpointRequest(job_id="j"))
    assert reply.global_iteration == 1 and reply.uri.endswith("/jobs/j/checkpoints/iter-1")
    root = tmp_path / "storage" / "jobs" / "j" / "checkpoints"
    assert (root / "latest").read_text() == "iter-1"
    manifest = json.loads((root / "iter-1" / "manifest.json").read_text())
    assert manifest["iteration"] == 1 and len(manifest["shards"]) == 2
    for entry in manifest["shards"]:
        data = (root / "iter-1" / entry["file"]).read_bytes()
        assert len(data) == entry["size"] and ckpt.sha256_hex(data) == entry["sha256"]

    # The next checkpoint dies between the shard files and the manifest.
    a = (await c.boundary("j", "l1", generation=1, completed=0, n=2)).assignment
    await contribute(c, "j", "l1", a, grads(2), buffers, n=2)

    def crash(directory: str, manifest: dict) -> None:
        raise ckpt.StorageError("disk full")

    monkeypatch.setattr(ckpt, "write_manifest_and_latest", crash)
    with pytest.raises(aio.AioRpcError) as info:
        await c.call("CreateCheckpoint", ps_pb2.CreateCheckpointRequest(job_id="j"))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    # the failed write's shard files are deleted with its directory (no disk leak; a process
    # killed mid-write leaves them, and they are never pointed at: tests/chaos)
    assert not (root / "iter-2").exists()
    assert (root / "latest").read_text() == "iter-1"
    monkeypatch.undo()

    # Every shard restarts: the job resumes from iter-1, not from the partial iter-2.
    await c.stop()
    fresh = await Cluster(tmp_path, c.tokens, c.tokens_file).start()
    try:
        reply = await fresh.open_job("j", batch=2, epochs=3)
        assert reply.resumed and reply.progress.completed_iterations == 1
        await fresh.join("j", "l7")
        answer = await fresh.boundary("j", "l7")
        assert answer.pull_parameters and answer.assignment.global_iteration == 1
        gen = answer.assignment.generation
        pulled = {
            **(await fresh.pull("j", 0, gen, "l7")),
            **(await fresh.pull("j", 1, gen, "l7")),
        }
        for k, v in after_one.items():
            assert torch.equal(pulled[k], v), k
    finally:
        await fresh.stop()


async def test_progress_iteration_metrics_and_epoch_reports_reach_storage(cluster, tmp_path):
    c = cluster
    [a] = await started(c, "j", ["l1"], batch=4, epochs=1)  # 8 samples: 2 iterations
    buffers = {k: v for k, v in initial().items() if k.startswith("bn.")}
    await contribute(c, "j", "l1", a, grads(1), buffers, n=4, loss_sum=8.0)
    a = (await c.boundary("j", "l1", generation=1, completed=0, loss_sum=8.0, n=4)).assignment
    await contribute(c, "j", "l1", a, grads(2), buffers, n=4, loss_sum=4.0)
    done = await c.boundary("j", "l1", generation=1, completed=1, loss_sum=4.0, n=4)
    assert done.action == ps_pb2.BOUNDARY_ACTION_DONE
    await c.call(
        "ReportEpochMetrics",
        ps_pb2.ReportEpochMetricsRequest(
            job_id="j", learner_id="l1", epoch=0, values={"accuracy": 0.5}
        ),
    )
    progress = await c.call("GetJobProgress", ps_pb2.GetJobProgressRequest(job_id="j"))
    assert progress.done and progress.progress.completed_iterations == 2
    assert progress.progress.samples_processed == 8 and progress.progress.last_loss == 1.0
    job = tmp_path / "storage" / "jobs" / "j"
    lines = (job / "metrics" / "iterations.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [(r["global_iteration"], r["loss"]) for r in records] == [(0, 2.0), (1, 1.0)]
    for r in records:  # the scheduler reads them as IterationMetric (protobuf JSON)
        doc = {k: v for k, v in r.items() if k != "time"}
        metric = json_format.ParseDict(doc, job_pb2.IterationMetric(), ignore_unknown_fields=True)
        assert metric.samples == 4 and metric.world_size == 1
    [epoch] = [json.loads(x) for x in (job / "metrics" / "epochs.jsonl").read_text().splitlines()]
    assert epoch["epoch"] == 0 and epoch["values"] == {"accuracy": 0.5}
    model = __import__("safetensors.torch").torch.load_file(job / "model.safetensors")
    assert set(model) == {m.name for m in LAYOUT}


def _shard_process(
    tmp_path: Path, etcd: Any, index: int, *, ttl: str, stdout: int
) -> tuple[subprocess.Popen[bytes], str]:
    """A real shard process (``python -m shoal.param_sync``) registering in ``etcd``."""
    tokens = make_tokens(tmp_path / "tokens")
    address = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shoal.param_sync",
            "--shard-index",
            str(index),
            "--listen",
            address,
            "--tokens-file",
            str(tmp_path / "tokens"),
            "--service-token",
            tokens["service"],
            "--etcd",
            ",".join(etcd.endpoints),
            "--registration-ttl",
            ttl,
        ],
        stdout=stdout,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return proc, address


@pytest.mark.slow
async def test_a_shard_process_registers_its_address_in_etcd_under_a_lease(etcd, tmp_path):
    from shoal.runtime.store import EtcdStore

    proc, address = _shard_process(tmp_path, etcd, 3, ttl="2", stdout=subprocess.DEVNULL)
    try:
        async with EtcdStore(etcd.endpoints, timeout=3.0) as store:
            kv = await async_wait_until(
                lambda: store.get(registry_key(3)), timeout=60, what="registration"
            )
            assert kv.value.decode() == address and kv.lease
            proc.kill()
            proc.wait(timeout=10)
            await async_wait_until(
                lambda: _gone(store, registry_key(3)), timeout=15, what="lease expiry"
            )
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
async def test_sigterm_revokes_a_shard_registration_at_once_and_exits_cleanly(
    etcd, tmp_path: Path
) -> None:
    """On the shared service skeleton (run_service, issue 15) a shard announces LISTENING,
    registers its address, and on SIGTERM revokes the registration at once (long before its
    lease could expire) and exits 0."""
    from shoal.runtime.store import EtcdStore

    # an expiry would take minutes: the key must go by revocation
    proc, address = _shard_process(tmp_path, etcd, 5, ttl="120", stdout=subprocess.PIPE)
    try:
        async with EtcdStore(etcd.endpoints, timeout=3.0) as store:
            kv = await async_wait_until(
                lambda: store.get(registry_key(5)), timeout=60, what="registration"
            )
            assert kv.value.decode() == address and kv.lease
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
            assert proc.stdout is not None
            assert f"LISTENING {address.rsplit(':', 1)[1]}" in proc.stdout.read().decode()
            await async_wait_until(
                lambda: _gone(store, registry_key(5)), timeout=10, what="revocation"
            )
    finally:
        if proc.poll() is None:
            proc.kill()


async def _gone(store: Any, key: str) -> bool:
    return await store.get(key) is None
