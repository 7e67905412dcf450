"""The sums a primary replicates to a backup on its host through shared memory
(``shoal.param_sync.replica_lane``): the blob read out of the segment is the primary's
``pending_bytes`` byte for byte, so the replica fed it stays bit-identical to one fed the
gRPC chunks; a stale sequence or a range outside the blob region is refused."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from shoal.contract.shm import LaneError, Segment
from shoal.param_sync.replica_lane import (
    BLOB_OFFSET,
    MEMFD_LABEL,
    RecvLane,
    read_blob,
    write_blob,
)
from tests.unit.test_shard_replication import METAS, assert_same_state, contribution, shard


def backup_of(sender: Segment) -> RecvLane:
    """The backup's mapping of ``sender``'s segment (as it maps a handed descriptor)."""
    fresh = Segment.from_fd(sender.fd, sender.size, sender.nonce)
    empty = np.empty(0, dtype=np.uint8)
    return RecvLane(fresh, [empty, empty])


def test_sums_through_a_segment_are_the_primarys_bytes_and_keep_the_replica_identical() -> None:
    torch.manual_seed(1)
    primary = shard()
    start = [torch.randn(m.shape) for m in METAS]
    primary.initialize(contribution(primary, "init", 0, start, 0))
    via_shm, via_chunks = shard(), shard()
    for replica in (via_shm, via_chunks):
        replica.load_state_bytes(primary.state_bytes(0))
    sender = Segment.create(BLOB_OFFSET + 64 * 1024, label=MEMFD_LABEL)
    try:
        assert os.readlink(f"/proc/self/fd/{sender.fd}").startswith(f"/memfd:{MEMFD_LABEL}")
        backup = backup_of(sender)
        buffers = []
        for k in range(4):
            for learner, n in (("a", 2), ("b", 7)):
                grads = [torch.randn(m.shape) for m in METAS]
                primary.accumulate(contribution(primary, learner, k, grads, n), frozenset("ab"))
            header, views = primary.pending_frames(1, k)
            length = write_blob(sender, k + 1, [header, *views])
            blob = read_blob(backup, BLOB_OFFSET, length, k + 1)
            assert blob.tobytes() == primary.pending_bytes(1, k)
            buffers.append(blob)
            assert via_shm.keep_pending(blob) == via_chunks.keep_pending(
                primary.pending_bytes(1, k)
            )
            primary.commit(1, k)
            via_shm.apply_replicated(1, k, 0.0)
            via_chunks.apply_replicated(1, k, 0.0)
        assert_same_state(via_shm, via_chunks, 4)
        assert_same_state(primary, via_shm, 4)
        # Two buffers, used in turn (no fresh array, so no page faults, per iteration).
        assert np.shares_memory(buffers[0], buffers[2])
        assert not np.shares_memory(buffers[0], buffers[1])
        backup.close()
    finally:
        sender.close()


def test_a_stale_sequence_or_a_range_outside_the_blob_is_refused() -> None:
    sender = Segment.create(BLOB_OFFSET + 4096, label=MEMFD_LABEL)
    try:
        backup = backup_of(sender)
        length = write_blob(sender, 5, [b"x" * 100, memoryview(b"y" * 28)])
        assert length == 128
        assert read_blob(backup, BLOB_OFFSET, length, 5).tobytes() == b"x" * 100 + b"y" * 28
        with pytest.raises(LaneError, match="superseded by a newer send"):
            read_blob(backup, BLOB_OFFSET, length, 4)
        for offset, size in ((0, 16), (BLOB_OFFSET - 8, 8), (BLOB_OFFSET, 4097), (-1, 1)):
            with pytest.raises(LaneError, match="outside"):
                read_blob(backup, offset, size, 5)
        backup.close()
    finally:
        sender.close()
