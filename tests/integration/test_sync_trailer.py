"""The SyncStep trailer (``TensorBundleTrailer``) on two in-process shards: a stream that
declares every tensor of a shard's slice and says afterwards which got no gradient (what a
learner overlapping its sends with backward does, ``shoal.learner.ps_overlap``). A tensor the
trailer marks absent counts exactly as one the header left out; a bad trailer is refused
INVALID_ARGUMENT naming the field and the value and changes nothing."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
import torch
from grpc import aio

from shoal.contract.wire import (
    byte_view,
    encode_chunk,
    encode_chunks,
    encode_header,
    header_of,
    pack_layout,
)
from shoal.learner.grpc_backend import stream_methods
from shoal.v1 import parameter_sync_service_pb2 as ps_pb2
from tests.integration.test_param_sync import (
    BY_NAME,
    LAYOUT,
    Cluster,
    cluster,  # noqa: F401 - the fixture
    contribute,
    grads,
    initial,
    merged,
    read_bundle,
    started,
)

BUFFERS = ("bn.running_mean", "bn.num_batches_tracked")


def trailer_message(**fields: Any) -> bytes:
    return ps_pb2.SyncStepRequest(trailer=ps_pb2.TensorBundleTrailer(**fields)).SerializeToString()


async def declared_stream(
    c: Cluster,
    learner: str,
    shard: int,
    a: Any,
    tensors: dict[str, torch.Tensor],
    *,
    n: int,
    tail: list[bytes],
    cut: int | None = None,
) -> tuple[ps_pb2.TensorBundleHeader, dict[str, torch.Tensor]]:
    """A SyncStep declaring every tensor of ``shard``'s slice in reverse layout order (zeros
    for those ``tensors`` lacks), its chunks (only the first ``cut`` when given), then
    ``tail`` (trailers, chunks). The header's loss sum and learning rate are 0."""
    names = [m.name for m in reversed(LAYOUT) if c.slices[m.name] == shard]
    metas, total = pack_layout([BY_NAME[x] for x in names])
    values = [
        tensors.get(x, torch.zeros(BY_NAME[x].shape, dtype=BY_NAME[x].torch_dtype)) for x in names
    ]
    header = header_of(
        job_id="j",
        sender_id=learner,
        metas=metas,
        total_bytes=total,
        generation=a.generation,
        iteration=a.global_iteration,
        num_samples=n,
    )
    chunks = list(encode_chunks(metas, [byte_view(v.contiguous()) for v in values], total, 16))

    async def messages() -> Any:
        yield encode_header(ps_pb2.SyncStepRequest, header)
        for chunk in chunks if cut is None else chunks[:cut]:
            yield chunk
        for message in tail:
            yield message

    streams = stream_methods(c._channel(c.addresses[shard]))
    return await read_bundle(streams["SyncStep"](messages(), metadata=c.md()))


def index_in_stream(c: Cluster, name: str) -> int:
    shard = c.slices[name]
    return [m.name for m in reversed(LAYOUT) if c.slices[m.name] == shard].index(name)


async def test_a_tensor_the_trailer_marks_absent_is_not_stepped_and_the_trailer_sets_loss_and_lr(
    cluster,  # noqa: F811
):
    c = cluster
    [a] = await started(c, "j", ["l1"], batch=4)
    g = grads(1)
    buffers = {k: v for k, v in initial().items() if k in BUFFERS}
    tensors = {**g, **buffers}

    def stream(shard: int) -> Any:
        mine = {k: v for k, v in tensors.items() if c.slices[k] == shard}
        absent = [index_in_stream(c, "w")] if c.slices["w"] == shard else []
        # "w" is declared, its (non-zero) bytes sent, and the trailer says it got none.
        trailer = trailer_message(absent_tensors=absent, loss_sum=6.0, learning_rate=0.25)
        return declared_stream(c, "l1", shard, a, mine, n=4, tail=[trailer])

    results = await asyncio.gather(stream(0), stream(1))
    new = merged(results)
    p0 = initial()
    assert torch.equal(new["w"], p0["w"])  # no gradient: not stepped
    torch.testing.assert_close(new["b"], p0["b"] - 0.25 * g["b"], atol=1e-6, rtol=0)
    assert results[0][0].loss_sum == pytest.approx(6.0)  # the trailer's, not the header's 0


async def test_a_bad_trailer_is_refused_naming_the_field_and_value_and_changes_nothing(
    cluster,  # noqa: F811
):
    c = cluster
    [a] = await started(c, "j", ["l1"], batch=4)
    g = grads(1)
    buffers = {k: v for k, v in initial().items() if k in BUFFERS}
    shard = c.slices["w"]
    mine = {k: v for k, v in {**g, **buffers}.items() if c.slices[k] == shard}
    declared = sum(1 for m in LAYOUT if c.slices[m.name] == shard)
    w = index_in_stream(c, "w")
    buffer_here = [x for x in BUFFERS if c.slices[x] == shard]

    async def refusal(tail: list[bytes], cut: int | None = None) -> str:
        with pytest.raises(aio.AioRpcError) as info:
            await declared_stream(c, "l1", shard, a, mine, n=4, tail=tail, cut=cut)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        return info.value.details()

    text = await refusal([trailer_message(absent_tensors=[declared])])
    assert "trailer.absent_tensors[0]" in text and f"({declared})" in text, text
    text = await refusal([trailer_message(absent_tensors=[w, -1])])
    assert "trailer.absent_tensors[1]" in text and "(-1)" in text, text
    text = await refusal([trailer_message(absent_tensors=[w, w])])
    assert "trailer.absent_tensors[1]" in text and "repeats w" in text, text
    if buffer_here:
        b = index_in_stream(c, buffer_here[0])
        text = await refusal([trailer_message(absent_tensors=[b])])
        assert "trailer.absent_tensors[0]" in text and "buffer" in text, text
    text = await refusal([trailer_message()], cut=1)  # before the last chunk
    assert "trailer" in text and "after 16 bytes" in text, text
    text = await refusal([trailer_message(), trailer_message()])
    assert "trailer" in text and "second" in text, text
    text = await refusal([trailer_message(), encode_chunk(bytes(4))])
    assert "chunk" in text and "trailer" in text, text

    # None of it changed the job: an old-style round (no trailer) gives the exact update.
    progress = await c.call("GetJobProgress", ps_pb2.GetJobProgressRequest(job_id="j"))
    assert progress.progress.completed_iterations == 0
    new = merged(await contribute(c, "j", "l1", a, g, buffers, n=4))
    for k in ("w", "b"):
        torch.testing.assert_close(new[k], initial()[k] - 0.5 * g[k], atol=1e-6, rtol=0)
