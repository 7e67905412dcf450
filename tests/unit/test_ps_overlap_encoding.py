"""The pieces of parameter-server overlap (``shoal.learner.ps_overlap``) that need no shard:
the order a stream declares a slice in, and that streaming a bundle tensor run by tensor run
puts exactly the bytes of the one-shot encoding on the wire (the shard cannot tell them
apart, so its sums are the same)."""

from __future__ import annotations

import torch

from shoal.contract.wire import BundleReceiver, TensorMeta, byte_view, encode_chunks, pack_layout
from shoal.learner.ps_overlap import _encode_run, declared_order


def test_a_slice_is_declared_parameters_in_reverse_then_buffers_in_order():
    # Layout: 5 parameters (0-4), then 3 buffers (5-7); a shard holding some of each.
    assert declared_order([0, 2, 3, 5, 7], n_params=5) == [3, 2, 0, 5, 7]
    assert declared_order([6], n_params=5) == [6]
    assert declared_order([], n_params=5) == []


def _payload(chunks: list[bytes]) -> bytes:
    out = bytearray()
    for message in chunks:
        assert message[0] == 0x12  # one chunk field
        size, shift, pos = 0, 0, 1
        while True:
            byte = message[pos]
            pos += 1
            size |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        assert len(message) - pos == size
        out += message[pos:]
    return bytes(out)


def test_streaming_tensor_runs_sends_the_bytes_of_the_one_shot_encoding():
    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(33, generator=g),  # 132 bytes
        torch.randn(7, generator=g).to(torch.float16),  # 14 bytes: later ones start unaligned
        torch.randn(5, 9, generator=g, dtype=torch.float64),
        torch.empty(0),
        torch.arange(3),  # int64
    ]
    metas, total = pack_layout([TensorMeta.of(f"t{i}", t) for i, t in enumerate(tensors)])
    whole = _payload(list(encode_chunks(metas, [byte_view(t) for t in tensors], total, 64)))
    # The hooks hand tensors over in runs as they become ready: [0], [1, 2], [3, 4].
    runs = [[0], [1, 2], [3, 4]]
    streamed = b"".join(
        _payload(_encode_run(metas, [(i, tensors[i]) for i in run], 64)) for run in runs
    )
    assert streamed == whole and len(whole) == total
    # And a receiver routes them to the same tensors, element by element.
    out = [torch.zeros_like(t) for t in tensors]
    views = [byte_view(t) if t.numel() else None for t in out]

    def sink(i: int, off: int, seg: memoryview) -> None:
        views[i][off : off + seg.nbytes] = bytearray(seg)

    receiver = BundleReceiver(metas, total, sink)
    for run in runs:
        for message in _encode_run(metas, [(i, tensors[i]) for i in run], 64):
            receiver.feed(memoryview(_payload([message])))
    receiver.finish()
    assert all(torch.equal(a, b) for a, b in zip(out, tensors, strict=True))
