"""A small bundle in one message (``TensorBundleHeader.inline_data``): the codec's inline bytes
are exactly the chunks' payload; the checks a receiver makes (``inline_of``) and a shard makes
(``ShardJob.check_stream``, ``_collect``): inline bytes that are not ``total_bytes``, inline
bytes with ``shared_memory``, over the most a header carries or over the shard's limit, a chunk
after an inline header; each refused naming the field and the value, nothing kept. The
learner's ``SHOAL_INLINE_KB`` is refused out of range naming the variable and the value."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest
import torch

from shoal.contract.wire import (
    MAX_INLINE_BYTES,
    BundleError,
    BundleTooLarge,
    Frame,
    TensorMeta,
    byte_view,
    decode_frame,
    encode_chunks,
    encode_header,
    header_of,
    inline_bytes,
    inline_of,
    pack_layout,
)
from shoal.learner.grpc_calls import DEFAULT_INLINE_KB, inline_bytes_from_env
from shoal.param_sync.coordinator import OptimizerConfig
from shoal.param_sync.servicer_common import _collect
from shoal.param_sync.shard import Contribution, ShardJob
from shoal.runtime.errors import InvalidField, TooLarge
from shoal.v1 import parameter_sync_service_pb2 as ps_pb2


def bundle() -> tuple[list[TensorMeta], list[np.ndarray], int, list[torch.Tensor]]:
    tensors = [torch.arange(6, dtype=torch.float32).view(2, 3), torch.tensor([7, 8]), torch.ones(1)]
    metas, total = pack_layout([TensorMeta.of(f"t{i}", t) for i, t in enumerate(tensors)], align=64)
    return metas, [byte_view(t) for t in tensors], total, tensors


def test_inline_bytes_are_the_chunks_payload_gaps_zero():
    metas, views, total, _ = bundle()
    data = inline_bytes(metas, views, total)
    chunks = b"".join(
        bytes(decode_frame(ps_pb2.SyncStepRequest, c).chunk)
        for c in encode_chunks(metas, views, total, 16)
    )
    assert data == chunks and len(data) == total
    assert data[metas[0].end : metas[1].offset] == bytes(metas[1].offset - metas[0].end)
    with pytest.raises(ValueError, match="exceeds"):
        inline_bytes(metas, views, MAX_INLINE_BYTES + 1)


def test_an_inline_header_round_trips_through_the_decoder():
    metas, views, total, _ = bundle()
    header = header_of(job_id="j", sender_id="l", metas=metas, total_bytes=total)
    header.inline_data = inline_bytes(metas, views, total)
    frame = decode_frame(ps_pb2.SyncStepResponse, encode_header(ps_pb2.SyncStepResponse, header))
    assert frame.header is not None and frame.chunk is None
    got = inline_of(frame.header)
    assert got is not None and bytes(got) == header.inline_data
    assert inline_of(header_of(job_id="j", sender_id="l", metas=metas, total_bytes=total)) is None


@pytest.mark.parametrize("delta", [-1, 1])
def test_inline_bytes_must_be_exactly_total_bytes(delta: int):
    metas, views, total, _ = bundle()
    header = header_of(job_id="j", sender_id="l", metas=metas, total_bytes=total)
    header.inline_data = inline_bytes(metas, views, total)[: total + delta] + bytes(max(delta, 0))
    with pytest.raises(BundleError, match=rf"header\.inline_data \({total + delta} bytes\)"):
        inline_of(header)


def test_inline_bytes_never_with_shared_memory_nor_over_the_most_a_header_carries():
    metas, views, total, _ = bundle()
    header = header_of(job_id="j", sender_id="l", metas=metas, total_bytes=total)
    header.inline_data = inline_bytes(metas, views, total)
    header.shared_memory = True
    with pytest.raises(BundleError, match=r"header\.shared_memory"):
        inline_of(header)
    over = ps_pb2.TensorBundleHeader(
        total_bytes=MAX_INLINE_BYTES + 1, inline_data=bytes(MAX_INLINE_BYTES + 1)
    )
    with pytest.raises(BundleTooLarge, match=rf"\({MAX_INLINE_BYTES + 1} bytes\)"):
        inline_of(over)


# -- the shard's checks --------------------------------------------------------------------


def shard_job() -> ShardJob:
    _, _, _, tensors = bundle()
    layout = pack_layout([TensorMeta.of(f"t{i}", t) for i, t in enumerate(tensors)])[0]
    return ShardJob("j", 0, layout, OptimizerConfig("SGD", '{"lr": 0.1}'))


def gradient_header(sj: ShardJob) -> ps_pb2.TensorBundleHeader:
    metas, total = pack_layout(list(sj.job_metas))
    _, _, _, tensors = bundle()
    header = header_of(
        job_id="j", sender_id="l", metas=metas, total_bytes=total, generation=1, num_samples=2
    )
    header.inline_data = inline_bytes(metas, [byte_view(t) for t in tensors], total)
    return header


def contribution_of(sj: ShardJob, header: ps_pb2.TensorBundleHeader) -> Contribution:
    matched = sj.check_stream(header, everything=False, max_bytes=1 << 30)
    return Contribution("l", 1, 0, header.num_samples, 0.0, 0.0, matched, header.total_bytes)


async def frames(*items: Frame) -> AsyncIterator[Frame]:
    for item in items:
        yield item


def collect(sj: ShardJob, c: Contribution, header: ps_pb2.TensorBundleHeader, *items: Frame):
    return asyncio.run(_collect(frames(*items), sj, c, header, trailer=True))


def test_the_shard_keeps_inline_bytes_and_takes_a_trailer_after_them():
    sj = shard_job()
    header = gradient_header(sj)
    c = contribution_of(sj, header)
    trailer = ps_pb2.TensorBundleTrailer(absent_tensors=[2], loss_sum=1.5)
    collect(sj, c, header, Frame(trailer=trailer))
    assert b"".join(bytes(x) for x in c.chunks) == header.inline_data
    assert c.loss_sum == 1.5 and c.absent == frozenset({2})


def test_the_shard_refuses_a_chunk_after_inline_bytes_and_keeps_nothing_applied():
    sj = shard_job()
    header = gradient_header(sj)
    c = contribution_of(sj, header)
    with pytest.raises(InvalidField, match="must not follow a header with inline_data"):
        collect(sj, c, header, Frame(chunk=memoryview(b"\0" * 4)))
    assert sj.pending is None  # nothing was summed: a contribution is added only once checked


def test_the_shard_refuses_bad_inline_headers_naming_the_field():
    sj = shard_job()
    header = gradient_header(sj)
    header.inline_data = header.inline_data[:-4]
    with pytest.raises(InvalidField, match=r"header\.inline_data.*must be header\.total_bytes"):
        contribution_of(sj, header)
    header = gradient_header(sj)
    header.shared_memory = True
    with pytest.raises(InvalidField, match="shared_memory"):
        contribution_of(sj, header)
    # Over the shard's limit for its slice: refused as chunks would be, before any byte is kept.
    header = gradient_header(sj)
    big = sj.total_bytes + 64 * 8
    header.total_bytes, header.inline_data = big, bytes(big)
    with pytest.raises(TooLarge, match=r"header\.total_bytes"):
        contribution_of(sj, header)
    # Over the most a header may carry, even where the slice would take it.
    header = gradient_header(sj)
    over = MAX_INLINE_BYTES + 1
    header.total_bytes, header.inline_data = over, bytes(over)
    with pytest.raises(TooLarge):
        sj.check_stream(header, everything=False, max_bytes=1 << 40)


# -- the learner's flag --------------------------------------------------------------------


def test_shoal_inline_kb_default_range_and_refusals(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("SHOAL_INLINE_KB", raising=False)
    assert inline_bytes_from_env() == DEFAULT_INLINE_KB * 1024 == 256 * 1024
    for raw, expected in (("0", 0), ("4096", MAX_INLINE_BYTES), (" 64 ", 64 * 1024)):
        monkeypatch.setenv("SHOAL_INLINE_KB", raw)
        assert inline_bytes_from_env() == expected
    for raw in ("-1", "4097", "1.5", "lots", ""):
        monkeypatch.setenv("SHOAL_INLINE_KB", raw)
        with pytest.raises(ValueError, match="SHOAL_INLINE_KB") as info:
            inline_bytes_from_env()
        assert repr(raw.strip()) in str(info.value) or raw.strip() in str(info.value)


# -- the learner's checks of an answer -------------------------------------------------------


def learner_receive(header: ps_pb2.TensorBundleHeader, *more: Frame) -> list[torch.Tensor]:
    """``GrpcBackend._receive`` of one shard's answer ``header`` (then ``more``) into the
    learner's receive tensors (a backend that never connects: no call is made)."""
    from shoal.learner.grpc_backend import GrpcBackend
    from shoal.learner.grpc_calls import _Shard

    _, _, _, tensors = bundle()
    backend = GrpcBackend(job_id="j", learner_id="l", coordinator="127.0.0.1:9")
    try:
        metas = [TensorMeta.of(f"t{i}", t) for i, t in enumerate(tensors)]
        backend._layout = pack_layout(metas)[0]
        backend._recv = [torch.zeros_like(t) for t in tensors]
        backend._recv_bytes = [byte_view(t) for t in backend._recv]
        backend._recv_source = [None] * len(backend._recv)
        shard = _Shard(0, "shard-0", [0, 1, 2])

        async def answer() -> AsyncIterator[Frame]:
            yield Frame(header=header)
            for frame in more:
                yield frame

        asyncio.run(backend._receive(shard, answer()))
        return backend._recv
    finally:
        backend.close()


def shard_answer() -> ps_pb2.TensorBundleHeader:
    metas, views, total, _ = bundle()  # 64-byte aligned, as a shard lays its slice out
    header = header_of(job_id="j", sender_id="shard-0", metas=metas, total_bytes=total)
    header.inline_data = inline_bytes(metas, views, total)
    return header


def test_the_learner_reads_an_inline_answer_and_refuses_bad_ones():
    _, _, _, tensors = bundle()
    got = learner_receive(shard_answer())
    assert all(torch.equal(a, b) for a, b in zip(got, tensors, strict=True))
    with pytest.raises(RuntimeError, match="chunk after a header with inline_data"):
        learner_receive(shard_answer(), Frame(chunk=memoryview(bytes(4))))
    short = shard_answer()
    short.inline_data = short.inline_data[:-1]
    with pytest.raises(RuntimeError, match=r"shard-0: header\.inline_data"):
        learner_receive(short)
    lane = shard_answer()
    lane.shared_memory = True
    with pytest.raises(RuntimeError, match="shared_memory"):
        learner_receive(lane)
