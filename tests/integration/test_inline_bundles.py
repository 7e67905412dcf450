"""Small bundles as one message each way (``TensorBundleHeader.inline_data``,
docs/data-plane.md, "A small bundle in one message").

Against two in-process shard servers (real gRPC, with auth; ``test_param_sync.Cluster``), a
hand-written client sends what a hostile or broken learner could: inline bytes that are not
``total_bytes``, inline bytes and chunks, inline bytes with ``shared_memory``, a header over
the shard's size limit, a negative ``inline_answer_max_bytes``: each is refused naming the
field and the value, and the job is unchanged (the next round gives exactly the expected
update). An inline round and a chunked round give the same bytes; answers and pulls come as
one message only to a client that asks for them.

With real processes (two shard processes, learner processes of the digits MLP), a learner with
inline bundles (the default ``SHOAL_INLINE_KB``) and one with chunks only
(``SHOAL_INLINE_KB=0``, its gradients streamed during backward) train two jobs to the very
same parameters, equal to single-process training.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import torch
from grpc import aio

from shoal.contract.wire import (
    MAX_INLINE_BYTES,
    TensorMeta,
    byte_view,
    encode_chunk,
    encode_header,
    header_of,
    inline_bytes,
    pack_layout,
    tensors_from_buffer,
)
from shoal.learner.grpc_backend import stream_methods
from shoal.v1 import parameter_sync_service_pb2 as ps_pb2
from tests.integration._param_sync_cluster import (
    DataPlane,
    reference_training,
    release,
    running_plane,
)
from tests.integration.test_elastic_training import ATOL, BATCH, iterations_per_epoch
from tests.integration.test_param_sync import (
    BY_NAME,
    LAYOUT,
    Cluster,
    cluster,  # noqa: F401 - the fixture
    contribute,
    grads,
    initial,
    merged,
    of_shard,
    started,
)


async def raw_sync(c: Cluster, shard: int, messages: list[bytes]) -> list[Any]:
    """A SyncStep of exactly ``messages`` (pre-encoded); the answer's frames."""
    streams = stream_methods(c._channel(c.addresses[shard]))

    async def requests() -> AsyncIterator[bytes]:
        for m in messages:
            yield m

    return [frame async for frame in streams["SyncStep"](requests(), metadata=c.md())]


def inline_header(
    a: Any, learner: str, tensors: dict[str, torch.Tensor], n: int, **fields: Any
) -> tuple[ps_pb2.TensorBundleHeader, list[TensorMeta], int]:
    names = [m.name for m in LAYOUT if m.name in tensors]
    metas, total = pack_layout([BY_NAME[x] for x in names])
    header = header_of(
        job_id="j",
        sender_id=learner,
        metas=metas,
        total_bytes=total,
        generation=a.generation,
        iteration=a.global_iteration,
        num_samples=n,
    )
    header.inline_data = inline_bytes(
        metas, [byte_view(tensors[x].contiguous()) for x in names], total
    )
    for name, value in fields.items():
        setattr(header, name, value)
    return header, metas, total


async def code_of(coro: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(aio.AioRpcError) as info:
        await coro
    return info.value.code(), info.value.details() or ""


async def test_hostile_inline_headers_are_refused_naming_the_field_and_change_nothing(cluster):  # noqa: F811
    c = cluster
    [a] = await started(c, "j", ["l1"], batch=4)
    g = grads(1)
    buffers = {k: v for k, v in initial().items() if k.startswith("bn.")}
    shard = c.slices["w"]
    tensors = of_shard(c, shard, {**g, **buffers})
    StatusCode = grpc.StatusCode

    def req(header: ps_pb2.TensorBundleHeader) -> bytes:
        return encode_header(ps_pb2.SyncStepRequest, header)

    # Inline bytes one short of total_bytes, and one more.
    header, _, total = inline_header(a, "l1", tensors, 4)
    header.inline_data = header.inline_data[:-1]
    code, text = await code_of(raw_sync(c, shard, [req(header)]))
    assert code == StatusCode.INVALID_ARGUMENT, text
    assert "header.inline_data" in text and f"({total - 1} bytes)" in text, text
    header, _, total = inline_header(a, "l1", tensors, 4)
    header.inline_data += b"\0"
    code, text = await code_of(raw_sync(c, shard, [req(header)]))
    assert code == StatusCode.INVALID_ARGUMENT and "header.inline_data" in text, text
    # Inline bytes and then a chunk (of the declared size: the bundle twice over).
    header, _, total = inline_header(a, "l1", tensors, 4)
    code, text = await code_of(raw_sync(c, shard, [req(header), encode_chunk(bytes(total))]))
    assert code == StatusCode.INVALID_ARGUMENT, text
    assert "must not follow a header with inline_data" in text, text
    # Inline bytes and the shared-memory lane.
    header, _, _ = inline_header(a, "l1", tensors, 4, shared_memory=True)
    code, text = await code_of(raw_sync(c, shard, [req(header)]))
    assert code == StatusCode.INVALID_ARGUMENT and "shared_memory" in text, text
    # More bytes than the shard takes for its slice (as for chunks: RESOURCE_EXHAUSTED),
    # declared in a layout that is otherwise the shard's own.
    header, _, total = inline_header(a, "l1", tensors, 4)
    big = total + 64 * 16
    header.total_bytes = big
    header.inline_data = bytes(big)
    code, text = await code_of(raw_sync(c, shard, [req(header)]))
    assert code == StatusCode.RESOURCE_EXHAUSTED and "header.total_bytes" in text, text
    # Over the most a header may carry (the server's message limit refuses it first here).
    header, _, _ = inline_header(a, "l1", tensors, 4)
    header.total_bytes = MAX_INLINE_BYTES + 1
    header.inline_data = bytes(MAX_INLINE_BYTES + 1)
    code, _ = await code_of(raw_sync(c, shard, [req(header)]))
    assert code == StatusCode.RESOURCE_EXHAUSTED
    # A negative answer limit.
    header, _, _ = inline_header(a, "l1", tensors, 4, inline_answer_max_bytes=-1)
    code, text = await code_of(raw_sync(c, shard, [req(header)]))
    assert code == StatusCode.INVALID_ARGUMENT, text
    assert "header.inline_answer_max_bytes (-1)" in text, text

    # None of it changed the job: the round gives exactly the expected update.
    progress = await c.call("GetJobProgress", ps_pb2.GetJobProgressRequest(job_id="j"))
    assert progress.progress.completed_iterations == 0
    new = merged(await contribute(c, "j", "l1", a, g, buffers, n=4))
    for k in ("w", "b"):
        torch.testing.assert_close(new[k], initial()[k] - 0.5 * g[k], atol=1e-6, rtol=0)


async def test_an_inline_round_equals_a_chunked_one_and_answers_inline_only_when_asked(cluster):  # noqa: F811
    c = cluster
    [a] = await started(c, "j", ["l1"], batch=4)
    g = grads(3)
    buffers = {"bn.running_mean": torch.full((4,), 2.0), "bn.num_batches_tracked": torch.tensor(5)}
    everything = {**g, **buffers}

    async def inline_round(shard: int) -> tuple[ps_pb2.TensorBundleHeader, dict[str, Any]]:
        tensors = of_shard(c, shard, everything)
        header, _, _ = inline_header(
            a, "l1", tensors, 4, loss_sum=3.0, inline_answer_max_bytes=1 << 20
        )
        # One request message, the end of the stream with it (as the learner sends it).
        streams = stream_methods(c._channel(c.addresses[shard]))
        call = streams["SyncStepOnce"](
            encode_header(ps_pb2.SyncStepRequest, header), metadata=c.md()
        )
        frames = [frame async for frame in call]
        assert len(frames) == 1 and frames[0].header is not None  # the answer: one message
        assert len(frames[0].header.inline_data) == frames[0].header.total_bytes > 0
        return read_inline(frames)

    results = await asyncio.gather(*(inline_round(s) for s in (0, 1)))
    new = merged(results)
    for k in ("w", "b"):
        torch.testing.assert_close(new[k], initial()[k] - 0.5 * g[k], atol=1e-6, rtol=0)
    assert torch.equal(new["bn.running_mean"], buffers["bn.running_mean"])
    assert results[0][0].loss_sum == 3.0 and results[0][0].num_samples == 4

    # Pulls: inline when asked, chunks otherwise; the same bytes.
    for shard in (0, 1):
        streams = stream_methods(c._channel(c.addresses[shard]))
        asked = ps_pb2.PullParametersRequest(
            job_id="j", learner_id="x", inline_answer_max_bytes=1 << 20
        )
        frames = [f async for f in streams["PullParameters"](asked, metadata=c.md())]
        assert len(frames) == 1 and frames[0].header.inline_data
        plain = ps_pb2.PullParametersRequest(job_id="j", learner_id="x")
        chunked = [f async for f in streams["PullParameters"](plain, metadata=c.md())]
        assert len(chunked) > 1 and not chunked[0].header.inline_data
        assert frames[0].header.inline_data == b"".join(bytes(f.chunk) for f in chunked[1:])
        tiny = ps_pb2.PullParametersRequest(job_id="j", learner_id="x", inline_answer_max_bytes=8)
        small = [f async for f in streams["PullParameters"](tiny, metadata=c.md())]
        assert len(small) > 1 and not small[0].header.inline_data  # too big for 8 bytes
        bad = ps_pb2.PullParametersRequest(job_id="j", learner_id="x", inline_answer_max_bytes=-5)
        code, text = await code_of(
            _drain(streams["PullParameters"](bad, metadata=c.md()))  # type: ignore[arg-type]
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "inline_answer_max_bytes (-5)" in text, text
        for name, value in read_inline(frames)[1].items():
            assert torch.equal(value, new[name]), name


async def _drain(frames: Any) -> None:
    async for _ in frames:
        pass


def read_inline(frames: list[Any]) -> tuple[ps_pb2.TensorBundleHeader, dict[str, torch.Tensor]]:
    """An answer that is one header carrying its bytes: the header and its tensors."""
    assert len(frames) == 1, frames
    header = frames[0].header
    assert header.inline_data
    metas = [TensorMeta.from_proto(t) for t in header.tensors]
    values = tensors_from_buffer(bytearray(header.inline_data), metas)
    return header, {m.name: v.clone() for m, v in zip(metas, values, strict=True)}


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory):
    yield from running_plane(tmp_path_factory, "inline-bundles")


@pytest.mark.slow
def test_a_learner_with_inline_bundles_trains_exactly_as_one_with_chunks(plane: DataPlane):
    epochs = 1
    total = epochs * iterations_per_epoch()
    jobs = {"inline": {}, "chunks": {"SHOAL_INLINE_KB": "0"}}
    gate = plane.tmp / "inline.gate"
    procs = {}
    for job, env in jobs.items():
        plane.open_job(job, batch=BATCH, epochs=epochs)
        procs[job] = plane.start_learner(
            job,
            f"{job}-l0",
            epochs=epochs,
            batch=BATCH,
            gate=gate,
            env={"SHOAL_SHM_LANE": "off", **env},
        )
    release(list(procs.values()), gate)
    for proc in procs.values():
        assert proc.wait(timeout=240) == 0, proc.text()[-3000:]
    inline, chunks = plane.final_model("inline"), plane.final_model("chunks")
    assert set(inline) == set(chunks)
    for name, value in chunks.items():
        assert torch.equal(inline[name], value), name  # bit for bit
    reference, _ = reference_training(epochs, BATCH)
    for name, value in reference.items():
        torch.testing.assert_close(inline[name], value, atol=ATOL, rtol=0, msg=name)
    shards_with_params = len(plane.addresses)  # the MLP's tensors span both shards
    h_inline, h_chunks = plane.history("inline-l0"), plane.history("chunks-l0")
    assert len(h_inline["history"]) == total
    # Every gradient bundle went as one message, every answer came as one; none streamed.
    assert h_inline["inline_bundles"] == [total * shards_with_params] * 2, h_inline
    assert h_inline["tensors_sent"] == [0, 0]
    # Chunks only: gradients streamed during backward (the overlap), nothing inline.
    assert h_chunks["inline_bundles"] == [0, 0]
    assert h_chunks["tensors_sent"][0] > 0
