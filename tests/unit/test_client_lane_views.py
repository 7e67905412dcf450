"""The learner reads a shard's lane answer without a copy (``ClientLane.answer_views``): its
receive tensors view the lane's out-region, equal the bytes the shard wrote there bit for
bit (float32, bfloat16, int64, bool, an empty tensor), and an answer outside the out-region
or with a malformed layout is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shoal.contract.shm import LaneError, Segment
from shoal.contract.wire import TensorMeta, byte_view, header_of, pack_layout
from shoal.learner.grpc_lane import ClientLane

TENSORS = {
    "w": torch.randn(3, 5, generator=torch.Generator().manual_seed(3)),
    "h": torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16),
    "n": torch.tensor(7, dtype=torch.int64),
    "mask": torch.tensor([True, False, True]),
    "empty": torch.empty(0, 4),
}


def lane_with_answer() -> tuple[ClientLane, list[TensorMeta], int]:
    metas, total = pack_layout([TensorMeta.of(n, t) for n, t in TENSORS.items()], align=64)
    in_offset, out_offset = 64, 64 + 256
    segment = Segment.create(out_offset + total + 64)
    lane = ClientLane(segment, in_offset, 256, out_offset)
    out = np.frombuffer(
        segment.region(out_offset, total, lo=out_offset, hi=segment.size, what="answer"),
        dtype=np.uint8,
    )
    for m, t in zip(metas, TENSORS.values(), strict=True):
        if m.nbytes:
            out[m.offset : m.end] = byte_view(t)
    return lane, metas, total


def test_the_answer_is_viewed_in_place_bit_for_bit() -> None:
    lane, metas, total = lane_with_answer()
    try:
        header = header_of(job_id="j", sender_id="shard-0", metas=metas, total_bytes=total)
        header.shared_memory, header.shared_memory_offset = True, lane.out_offset
        views = lane.answer_views(header, metas)
        for view, (name, t) in zip(views, TENSORS.items(), strict=True):
            assert view.dtype == t.dtype and view.shape == t.shape, name
            assert (
                view.numpy().tobytes() == t.numpy().tobytes()
                if t.dtype != torch.bfloat16
                else torch.equal(view, t)
            ), name
        # The same memory: the shard's next answer shows through (no copy was made).
        w = views[0]
        out = lane.segment.region(
            lane.out_offset, 4, lo=lane.out_offset, hi=lane.segment.size, what="w"
        )
        out[:] = np.float32(42.0).tobytes()
        assert w[0, 0].item() == 42.0
        assert lane.rounds == 1
    finally:
        lane.close()


def test_an_answer_outside_the_out_region_or_malformed_is_refused() -> None:
    lane, metas, total = lane_with_answer()
    try:
        header = header_of(job_id="j", sender_id="shard-0", metas=metas, total_bytes=total)
        header.shared_memory = True
        for offset in (lane.in_offset, lane.out_offset - 8, lane.segment.size - total + 8, -1):
            header.shared_memory_offset = offset
            with pytest.raises(LaneError, match="outside the lane region"):
                lane.answer_views(header, metas)
        header.shared_memory_offset = lane.out_offset
        overlapping = [metas[0], TensorMeta("x", "float32", (2,), metas[0].offset, 8)]
        with pytest.raises(LaneError):
            lane.answer_views(header, overlapping)
        assert lane.rounds == 0
    finally:
        lane.close()


def test_the_receive_tensors_follow_a_new_lane_with_the_same_layout() -> None:
    """A lane closed (its shard restarted) and a new one at the same offsets: the backend's
    receive tensors view the new segment. They are keyed by the segment's nonce, not the lane
    object's id, which a new lane may reuse once the old one is freed."""
    from shoal.learner.grpc_backend import GrpcBackend

    backend = GrpcBackend.__new__(GrpcBackend)  # only the receive lists are used
    first, metas, total = lane_with_answer()
    second, _, _ = lane_with_answer()
    try:
        header = header_of(job_id="j", sender_id="shard-0", metas=metas, total_bytes=total)
        header.shared_memory, header.shared_memory_offset = True, first.out_offset
        targets = list(range(len(metas)))
        backend._recv = [torch.empty(0)] * len(metas)
        backend._recv_bytes = [np.empty(0, dtype=np.uint8)] * len(metas)
        backend._recv_source = [None] * len(metas)
        backend._view_lane_answer(first, header, metas, targets)
        out = second.segment.region(
            second.out_offset, 4, lo=second.out_offset, hi=second.segment.size, what="w"
        )
        out[:] = np.float32(7.0).tobytes()  # only the second lane's answer says 7
        backend._view_lane_answer(second, header, metas, targets)
        assert backend._recv[0][0, 0].item() == 7.0
        backend._view_lane_answer(second, header, metas, targets)  # the same lane: kept
        assert backend._recv[0][0, 0].item() == 7.0 and second.rounds == 2
        assert {src[0] for src in backend._recv_source} == {second.segment.nonce}
    finally:
        first.close()
        second.close()


def test_a_shared_read_only_answer_is_viewed_and_a_chunked_answer_after_it_gets_own_memory() -> (
    None
):
    """The job's answer segment (mapped read-only): the receive tensors view it, keyed by its
    nonce; an answer that then comes as chunks (the lane went) is copied into new memory of
    the receive tensors', never into the read-only mapping (which would fault)."""
    from shoal.learner.grpc_backend import GrpcBackend

    metas, total = pack_layout([TensorMeta.of(n, t) for n, t in TENSORS.items()], align=64)
    shard = Segment.create(64 + total, label="shoal-answer", read_only=True)
    out = np.frombuffer(shard.region(64, total, lo=64, hi=shard.size, what="a"), np.uint8)
    for m, t in zip(metas, TENSORS.values(), strict=True):
        if m.nbytes:
            out[m.offset : m.end] = byte_view(t)
    lane = ClientLane(Segment.create(64 + 256), 64, 256, 64 + 256)
    lane.answers = Segment.from_fd(shard.fd, shard.size, shard.nonce, read_only=True)
    lane.answers_offset = 64
    backend = GrpcBackend.__new__(GrpcBackend)  # only the receive lists are used
    backend._layout = metas
    try:
        header = header_of(job_id="j", sender_id="shard-0", metas=metas, total_bytes=total)
        header.shared_memory, header.shared_memory_offset = True, 64
        targets = list(range(len(metas)))
        backend._recv = [torch.empty(0)] * len(metas)
        backend._recv_bytes = [np.empty(0, dtype=np.uint8)] * len(metas)
        backend._recv_source = [None] * len(metas)
        backend._view_lane_answer(lane, header, metas, targets)
        assert torch.equal(backend._recv[0], TENSORS["w"])
        assert {src[0] for src in backend._recv_source} == {shard.nonce}
        # (torch knows no read-only memory: a write through these views would fault)
        viewed = [t.data_ptr() for t in backend._recv]
        backend._own_receive(targets)
        assert all(src is None for src in backend._recv_source)
        assert not {t.data_ptr() for t in backend._recv if t.numel()} & set(viewed)
        for j, m in enumerate(metas):
            assert backend._recv[j].shape == m.shape and backend._recv[j].dtype == m.torch_dtype
            if m.nbytes:
                backend._recv_bytes[j][:] = 1  # its own memory: writable
        assert torch.equal(
            torch.from_numpy(out[metas[0].offset : metas[0].end].copy()).view(torch.float32),
            TENSORS["w"].reshape(-1),
        )  # the segment is untouched
    finally:
        lane.close()
        shard.close()
