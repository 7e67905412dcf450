"""The tensor bundle codec: the hand-written chunk encoding is byte-for-byte the protobuf
runtime's, decoding is zero-copy, and bundles of any dtypes round-trip whatever the chunking."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch

from shoal.contract.wire import (
    BundleError,
    BundleReceiver,
    BundleTooLarge,
    TensorMeta,
    byte_view,
    chunk_ranges,
    decode_frame,
    encode_chunk,
    encode_chunks,
    encode_header,
    header_of,
    metas_from_header,
    pack_layout,
    serialize,
    tensors_from_buffer,
    validate_layout,
)
from shoal.v1 import parameter_sync_service_pb2 as ps_pb2

STREAM_MESSAGES = [
    ps_pb2.InitializeParametersRequest,
    ps_pb2.SyncStepRequest,
    ps_pb2.SyncStepResponse,
    ps_pb2.PullParametersResponse,
]
SIZES = [0, 1, 127, 128, 300, 16383, 16384, 2_097_151, 2_097_152, 4 * 1024 * 1024]


@pytest.mark.parametrize("message_cls", STREAM_MESSAGES)
@pytest.mark.parametrize("size", SIZES)
def test_hand_encoded_chunk_is_byte_for_byte_the_runtime_encoding(message_cls, size):
    data = os.urandom(size)
    assert encode_chunk(data) == message_cls(chunk=data).SerializeToString()


def test_a_chunk_encoded_from_several_parts_equals_one_encoded_from_their_concatenation():
    parts = [os.urandom(10), memoryview(os.urandom(300)), np.arange(7, dtype=np.uint8)]
    joined = b"".join(bytes(memoryview(p)) for p in parts)
    assert encode_chunk(*parts) == ps_pb2.SyncStepRequest(chunk=joined).SerializeToString()


@pytest.mark.parametrize("message_cls", STREAM_MESSAGES)
@pytest.mark.parametrize("size", [0, 5, 200, 70_000])
def test_decoding_a_runtime_chunk_gives_a_zero_copy_view_of_its_bytes(message_cls, size):
    data = os.urandom(size)
    wire = message_cls(chunk=data).SerializeToString()
    frame = decode_frame(message_cls, wire)
    assert frame.header is None and frame.chunk is not None
    assert bytes(frame.chunk) == data
    assert frame.chunk.obj is wire  # a view into the received message, not a copy


def test_headers_and_unusual_messages_go_through_the_runtime():
    header = header_of(
        job_id="j",
        sender_id="l",
        metas=[TensorMeta("w", "float32", (2,), 0, 8)],
        total_bytes=8,
        generation=3,
        iteration=7,
        num_samples=5,
        loss_sum=1.5,
        learning_rate=0.1,
    )
    frame = decode_frame(ps_pb2.SyncStepRequest, encode_header(ps_pb2.SyncStepRequest, header))
    assert frame.header == header and frame.chunk is None
    assert metas_from_header(frame.header) == [TensorMeta("w", "float32", (2,), 0, 8)]
    # An empty message sets neither field.
    assert decode_frame(ps_pb2.SyncStepRequest, b"") == decode_frame(
        ps_pb2.SyncStepRequest, ps_pb2.SyncStepRequest().SerializeToString()
    )
    assert decode_frame(ps_pb2.SyncStepRequest, b"").chunk is None
    # Two chunk fields in one message (legal protobuf: the last wins) take the runtime path.
    twice = encode_chunk(b"abc") + encode_chunk(b"xyz")
    assert bytes(decode_frame(ps_pb2.SyncStepRequest, twice).chunk) == b"xyz"


def test_serialize_passes_encoded_bytes_through_and_serializes_messages():
    assert serialize(b"\x12\x00") == b"\x12\x00"
    msg = ps_pb2.SyncStepResponse(chunk=b"ab")
    assert serialize(msg) == msg.SerializeToString()


def _model_tensors() -> list[tuple[str, torch.Tensor, bool]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("fc.weight", torch.randn(17, 5, generator=g), False),
        ("fc.bias", torch.randn(17, generator=g).to(torch.float64), False),
        ("half", torch.randn(9, generator=g).to(torch.float16), False),
        ("bf", torch.randn(3, 3, generator=g).to(torch.bfloat16), False),
        ("bn.num_batches_tracked", torch.tensor(12345678901, dtype=torch.int64), True),
        ("mask", torch.tensor([True, False, True]), True),
        ("empty", torch.empty(0, 4), False),
        ("int8", torch.arange(-5, 6, dtype=torch.int8), True),
    ]


@pytest.mark.parametrize("align", [1, 64])
@pytest.mark.parametrize("chunk_bytes", [16, 40, 1000, 4 * 1024 * 1024])
def test_bundles_of_mixed_dtypes_round_trip_bit_exactly(align, chunk_bytes):
    named = _model_tensors()
    metas, total = pack_layout([TensorMeta.of(n, t, buffer=b) for n, t, b in named], align=align)
    validate_layout(metas, total)
    chunks = list(encode_chunks(metas, [byte_view(t) for _, t, _ in named], total, chunk_bytes))
    out = [torch.zeros_like(t) for _, t, _ in named]
    views = [byte_view(t) if t.numel() else np.empty(0, np.uint8) for t in out]
    seen = []

    def sink(i: int, off: int, seg: memoryview) -> None:
        assert off % metas[i].itemsize == 0 and seg.nbytes % metas[i].itemsize == 0
        seen.append(i)
        views[i][off : off + seg.nbytes] = np.frombuffer(seg, dtype=np.uint8)

    receiver = BundleReceiver(metas, total, sink)
    for wire in chunks:
        frame = decode_frame(ps_pb2.SyncStepRequest, wire)
        assert frame.chunk is not None and frame.chunk.nbytes <= chunk_bytes
        receiver.feed(frame.chunk)
    receiver.finish()
    for (_, t, _), o in zip(named, out, strict=True):
        assert torch.equal(t.view(-1).view(torch.uint8), o.view(-1).view(torch.uint8))


def test_chunk_ranges_cover_the_bundle_and_end_on_element_boundaries():
    metas, total = pack_layout(
        [
            TensorMeta("a", "int8", (7,), 0, 7),
            TensorMeta("b", "float64", (10,), 0, 80),
            TensorMeta("c", "float32", (33,), 0, 132),
        ]
    )
    ranges = chunk_ranges(metas, total, 20)
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    for _, stop in ranges[:-1]:
        m = next(m for m in metas if m.offset <= stop < m.end or m.end == stop)
        assert (stop - m.offset) % m.itemsize == 0


def test_a_sender_that_splits_elements_is_reassembled_exactly():
    t = torch.randn(1000, dtype=torch.float64)
    metas, total = pack_layout([TensorMeta.of("x", t)])
    data = bytes(byte_view(t))
    out = torch.zeros_like(t)
    view = byte_view(out)

    def sink(i: int, off: int, seg: memoryview) -> None:
        assert off % 8 == 0 and seg.nbytes % 8 == 0
        view[off : off + seg.nbytes] = np.frombuffer(seg, dtype=np.uint8)

    receiver = BundleReceiver(metas, total, sink)
    for start in range(0, len(data), 13):  # 13-byte chunks split almost every element
        receiver.feed(memoryview(data)[start : start + 13])
    receiver.finish()
    assert torch.equal(out, t)


def test_more_bytes_than_declared_are_refused_before_reaching_the_sink():
    metas, total = pack_layout([TensorMeta("x", "float32", (4,), 0, 16)])
    got = []
    receiver = BundleReceiver(metas, total, lambda i, off, seg: got.append(seg.nbytes))
    receiver.feed(memoryview(bytes(12)))
    with pytest.raises(BundleTooLarge):
        receiver.feed(memoryview(bytes(8)))
    assert got == [12]
    with pytest.raises(BundleError, match="ended after 12"):
        receiver.finish()


@pytest.mark.parametrize(
    ("metas", "total", "message"),
    [
        ([TensorMeta("x", "float32", (4,), 0, 15)], 16, "nbytes"),
        ([TensorMeta("x", "complex7", (4,), 0, 16)], 16, "dtype"),
        ([TensorMeta("x", "float32", (4,), 0, 16)] * 2, 32, "twice"),
        (
            [TensorMeta("x", "float32", (4,), 0, 16), TensorMeta("y", "float32", (1,), 8, 4)],
            32,
            "overlaps",
        ),
        ([TensorMeta("x", "float32", (4,), 0, 16)], 8, "smaller"),
        ([TensorMeta("", "float32", (4,), 0, 16)], 16, "empty"),
    ],
)
def test_malformed_layouts_are_refused_naming_the_field(metas, total, message):
    with pytest.raises(BundleError, match=message):
        validate_layout(metas, total)


def test_tensors_from_buffer_view_the_buffer_without_copying():
    metas, total = pack_layout(
        [TensorMeta("a", "float32", (2, 2), 0, 16), TensorMeta("b", "int64", (), 0, 8)],
        align=8,
    )
    buffer = bytearray(total)
    a, b = tensors_from_buffer(buffer, metas)
    a.fill_(2.5)
    b.fill_(7)
    assert np.frombuffer(buffer, dtype=np.float32, count=4).tolist() == [2.5] * 4
    assert int.from_bytes(buffer[metas[1].offset : metas[1].end], "little") == 7
