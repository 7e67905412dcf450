"""The sums a primary replicates to a backup on its host through shared memory
(``shoal.param_sync.replica_lane``): the blob taken out of the segment is the primary's
``pending_bytes`` byte for byte, so the replica fed it stays bit-identical to one fed the
gRPC chunks; a stale sequence or a range outside the blob region is refused. The segment's two
slots: the backup answers a deferrable send at once and takes it in place afterwards (whole
even if the primary died meanwhile), answers the next only once it took that one, refuses an
older send, and keeps no sums rewritten while it took them; the primary alternates the slots
only for a backup that defers, one send at a time, and copies for an older sender (one slot)
before answering."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from shoal.contract.shm import LaneError, Segment
from shoal.param_sync.replica_lane import (
    BLOB_OFFSET,
    MEMFD_LABEL,
    SUPERSEDED,
    RecvLane,
    ReplicaLaneHandlers,
    SlotSums,
    read_blob,
    segment_size,
    slot_capacity,
    slot_of,
    slot_offset,
    write_blob,
)
from shoal.runtime.errors import FailedPrecondition, InvalidField
from shoal.v1 import parameter_sync_service_pb2 as ps_pb2
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
    in_place, copied, via_chunks = shard(), shard(), shard()
    for replica in (in_place, copied, via_chunks):
        replica.load_state_bytes(primary.state_bytes(0))
    sender = Segment.create(segment_size(64 * 1024), label=MEMFD_LABEL)
    try:
        assert os.readlink(f"/proc/self/fd/{sender.fd}").startswith(f"/memfd:{MEMFD_LABEL}")
        backup = backup_of(sender)
        buffers = []
        for k in range(4):
            for learner, n in (("a", 2), ("b", 7)):
                grads = [torch.randn(m.shape) for m in METAS]
                primary.accumulate(contribution(primary, learner, k, grads, n), frozenset("ab"))
            header, views = primary.pending_frames(1, k)
            sent = primary.pending_bytes(1, k)
            # A deferrable send, in the slots in turn, taken where it lies.
            offset = slot_offset(sender.size, k % 2)
            length = write_blob(sender, offset, k + 1, [header, *views])
            sums = slot_of(backup, offset, length, k + 1)
            assert bytes(sums.view) == sent
            assert in_place.keep_pending(sums.view, sums.still_there) == k
            # An older sender's: one slot, copied out before the answer.
            length = write_blob(sender, BLOB_OFFSET, k + 1, [header, *views])
            blob = read_blob(backup, BLOB_OFFSET, length, k + 1)
            assert blob.tobytes() == sent
            buffers.append(blob)
            assert copied.keep_pending(blob) == via_chunks.keep_pending(sent) == k
            primary.commit(1, k)
            for replica in (in_place, copied, via_chunks):
                replica.apply_replicated(1, k, 0.0)
        for replica in (in_place, copied):
            assert_same_state(replica, via_chunks, 4)
        assert_same_state(primary, in_place, 4)
        # Two buffers, used in turn (no fresh array, so no page faults, per iteration).
        assert np.shares_memory(buffers[0], buffers[2])
        assert not np.shares_memory(buffers[0], buffers[1])
        backup.close()
    finally:
        sender.close()


def test_two_slots_each_with_its_sequence_just_before_it() -> None:
    sender = Segment.create(segment_size(4096), label=MEMFD_LABEL)
    try:
        assert slot_capacity(sender.size) == 4096
        assert slot_offset(sender.size, 0) == BLOB_OFFSET
        assert slot_offset(sender.size, 1) == BLOB_OFFSET + 4096 + 8
        backup = backup_of(sender)
        write_blob(sender, slot_offset(sender.size, 0), 7, [b"a" * 4096])
        write_blob(sender, slot_offset(sender.size, 1), 8, [b"b" * 4096])  # leaves slot 0 be
        assert bytes(slot_of(backup, slot_offset(sender.size, 0), 4096, 7).view) == b"a" * 4096
        assert bytes(slot_of(backup, slot_offset(sender.size, 1), 4096, 8).view) == b"b" * 4096
        with pytest.raises(LaneError, match="outside"):  # a slot holds no more than its room
            write_blob(sender, slot_offset(sender.size, 1), 9, [b"c" * 4097])
        backup.close()
    finally:
        sender.close()


def test_a_stale_sequence_or_a_range_outside_the_blob_is_refused() -> None:
    sender = Segment.create(segment_size(4096), label=MEMFD_LABEL)
    try:
        backup = backup_of(sender)
        length = write_blob(sender, BLOB_OFFSET, 5, [b"x" * 100, memoryview(b"y" * 28)])
        assert length == 128
        assert read_blob(backup, BLOB_OFFSET, length, 5).tobytes() == b"x" * 100 + b"y" * 28
        for read in (read_blob, slot_of):
            with pytest.raises(LaneError, match=SUPERSEDED):
                read(backup, BLOB_OFFSET, length, 4)
        for offset, size in ((0, 16), (BLOB_OFFSET - 8, 8), (BLOB_OFFSET, sender.size), (-1, 1)):
            with pytest.raises(LaneError, match="outside"):
                read_blob(backup, offset, size, 5)
        backup.close()
    finally:
        sender.close()


def test_sums_rewritten_while_taken_leave_the_replica_without_sums() -> None:
    torch.manual_seed(2)
    primary, replica = shard(), shard()
    primary.initialize(contribution(primary, "init", 0, [torch.randn(m.shape) for m in METAS], 0))
    replica.load_state_bytes(primary.state_bytes(0))
    grads = [torch.randn(m.shape) for m in METAS]
    primary.accumulate(contribution(primary, "a", 0, grads, 3), frozenset("a"))
    sent = primary.pending_bytes(1, 0)
    with pytest.raises(FailedPrecondition, match="rewritten in the primary's segment"):
        replica.keep_pending(sent, lambda: False)
    assert replica.pending is None  # nothing half-taken is ever applied
    assert not replica.apply_replicated(1, 0, 0.0)
    assert replica.keep_pending(sent, lambda: True) == 0  # the same sums, whole: kept
    assert replica.apply_replicated(1, 0, 0.0)


# -- the two sides' handlers, with the rest of the servicer faked ------------------------------

JOB, SHARD = "job-1", 1


class FakeBackup:
    """What ``_take_sums_shm`` uses of the backup's servicer: its host, its replica of the
    primary's slice, and its mapping of the primary's segment."""

    def __init__(self, lane: RecvLane) -> None:
        self._host_id = "host-a"
        self.options = SimpleNamespace(shard_index=0)
        self._replica_recv = {(JOB, SHARD): lane}

    def _replica(self, job_id: str, shard_index: int) -> object:
        return object()

    async def take(self, kind: int = ps_pb2.REPLICATE_KIND_SUMS, **fields: Any) -> Any:
        request = ps_pb2.ReplicateRequest(
            job_id=JOB,
            shard_index=SHARD,
            replica=True,
            kind=kind,
            shared_memory=True,
            host_id="host-a",
            segment_nonce=self._replica_recv[(JOB, SHARD)].segment.nonce,
            **fields,
        )
        return await ReplicaLaneHandlers._take_sums_shm(self, request)  # type: ignore[arg-type]


async def test_a_deferrable_send_is_answered_at_once_and_the_next_once_it_was_taken() -> None:
    sender = Segment.create(segment_size(4096), label=MEMFD_LABEL)
    try:
        lane = backup_of(sender)
        backup = FakeBackup(lane)
        slot0, slot1 = slot_offset(sender.size, 0), slot_offset(sender.size, 1)
        write_blob(sender, slot0, 1, [b"one"])
        first = await backup.take(
            shared_memory_offset=slot0,
            shared_memory_length=3,
            sequence=1,
            shared_memory_deferrable=True,
        )
        assert isinstance(first, SlotSums) and bytes(first.view) == b"one"
        # The first is not taken yet (its copy is queued on the compute thread).
        lane.taking = asyncio.get_running_loop().create_future()
        write_blob(sender, slot1, 2, [b"two"])
        second = asyncio.ensure_future(
            backup.take(
                shared_memory_offset=slot1,
                shared_memory_length=3,
                sequence=2,
                shared_memory_deferrable=True,
            )
        )
        for _ in range(20):
            await asyncio.sleep(0)
        assert not second.done()  # answered only once the first was copied out of slot 0
        lane.taking.set_result(0)
        sums = await asyncio.wait_for(second, 5.0)
        assert isinstance(sums, SlotSums) and bytes(sums.view) == b"two" and sums.still_there()
        # An older send than one taken (late, or replayed) is refused, not taken over it.
        with pytest.raises(FailedPrecondition, match=SUPERSEDED):
            await backup.take(
                shared_memory_offset=slot0,
                shared_memory_length=3,
                sequence=1,
                shared_memory_deferrable=True,
            )
        # The slot written again: what was taken in place says it is no longer there.
        write_blob(sender, slot1, 4, [b"new"])
        assert not sums.still_there()
        # An older sender (not deferrable, one slot): copied out before the answer.
        write_blob(sender, slot0, 3, [b"old"])
        copied = await backup.take(shared_memory_offset=slot0, shared_memory_length=3, sequence=3)
        assert isinstance(copied, np.ndarray) and copied.tobytes() == b"old"
        lane.close()
    finally:
        sender.close()


class FakeHandoff:
    started, address = True, "@handoff"

    def offer(self, fd: int, **_: Any) -> bytes:
        return b"token"

    def withdraw(self, token: bytes) -> None:
        pass


class FakePrimary:
    """What ``_replicate_sums_shm`` uses of the primary's servicer; its Replicate calls are
    recorded and answered as a backup that defers (``deferred``) or an older one would."""

    _replicate_sums_shm = ReplicaLaneHandlers._replicate_sums_shm
    _send_sums_shm = ReplicaLaneHandlers._send_sums_shm
    _drop_send_lane = ReplicaLaneHandlers._drop_send_lane

    def __init__(self, deferred: bool) -> None:
        self.snapshots = False  # the answers' replica_snapshots
        self._host_id = "host-a"
        self._replica_no_shm: set[tuple[str, str]] = set()
        self._replica_sends: dict[tuple[str, str], Any] = {}
        self._handoff = FakeHandoff()
        self.deferred = deferred
        self.requests: list[ps_pb2.ReplicateRequest] = []
        self.hold: asyncio.Future[None] | None = None

    async def _compute(self, fn: Any, *args: Any) -> Any:
        return fn(*args)

    async def _replicate_call(self, address: str, messages: list[bytes]) -> Any:
        self.requests.append(ps_pb2.ReplicateRequest.FromString(messages[0]))
        if self.hold is not None:
            await self.hold
        return ps_pb2.ReplicateResponse(
            global_iteration=-1,
            shared_memory_taken=True,
            shared_memory_deferred=self.deferred,
            replica_snapshots=self.snapshots,
        )

    async def send(self, data: bytes) -> bool:
        return await self._replicate_sums_shm(JOB, SHARD, "backup:1", b"", [data])

    async def snapshot(self, data: bytes, still: Any = None) -> bool:
        return await self._replicate_sums_shm(
            JOB, SHARD, "backup:1", b"", [data], kind=ps_pb2.REPLICATE_KIND_STATE, still=still
        )

    def close(self) -> None:
        for lane in self._replica_sends.values():
            lane.segment.close()


async def test_the_primary_alternates_the_slots_only_for_a_backup_that_defers() -> None:
    older, deferring = FakePrimary(deferred=False), FakePrimary(deferred=True)
    try:
        for primary in (older, deferring):
            for k in range(4):
                assert await primary.send(b"sums-%d" % k)
        size = deferring.requests[0].segment_size
        # The first send goes to slot 0 for either: the answer says whether the backup defers.
        assert [r.shared_memory_offset for r in older.requests] == [BLOB_OFFSET] * 4
        assert [r.shared_memory_offset for r in deferring.requests] == [
            slot_offset(size, s) for s in (0, 1, 0, 1)
        ]
        assert [r.sequence for r in deferring.requests] == [1, 2, 3, 4]
        assert all(r.shared_memory_deferrable for r in deferring.requests)
    finally:
        older.close()
        deferring.close()


async def test_the_primary_sends_one_at_a_time_through_a_segment() -> None:
    primary = FakePrimary(deferred=True)
    try:
        assert await primary.send(b"first")
        primary.hold = asyncio.get_running_loop().create_future()
        second = asyncio.ensure_future(primary.send(b"second"))
        third = asyncio.ensure_future(primary.send(b"third!"))
        for _ in range(20):
            await asyncio.sleep(0)
        # The third (an aborted iteration's re-run, say) waits for the second's answer before
        # it writes anything: the slot it would write is the first's, taken only by then.
        assert len(primary.requests) == 2 and not third.done()
        lane = primary._replica_sends[(JOB, "backup:1")]
        first_slot = lane.segment.region(BLOB_OFFSET, 5, lo=0, hi=lane.segment.size, what="x")
        assert bytes(first_slot) == b"first"
        primary.hold.set_result(None)
        assert await asyncio.wait_for(second, 5.0) and await asyncio.wait_for(third, 5.0)
        assert [r.sequence for r in primary.requests] == [1, 2, 3]
        assert bytes(first_slot) == b"third!"[:5]
    finally:
        primary.close()


def test_sums_taken_after_the_primary_died_are_still_whole() -> None:
    """The backup answers before it copies: if the primary dies in between, its descriptor
    and mapping go (what its exit does), and the backup's mapping alone keeps the bytes."""
    torch.manual_seed(3)
    primary, replica, via_chunks = shard(), shard(), shard()
    primary.initialize(contribution(primary, "init", 0, [torch.randn(m.shape) for m in METAS], 0))
    for r in (replica, via_chunks):
        r.load_state_bytes(primary.state_bytes(0))
    primary.accumulate(
        contribution(primary, "a", 0, [torch.randn(m.shape) for m in METAS], 4), frozenset("a")
    )
    header, views = primary.pending_frames(1, 0)
    sender = Segment.create(segment_size(64 * 1024), label=MEMFD_LABEL)
    backup = backup_of(sender)
    length = write_blob(sender, BLOB_OFFSET, 1, [header, *views])
    sums = slot_of(backup, BLOB_OFFSET, length, 1)  # answered here
    sender.close()  # the primary is gone: no descriptor, no mapping of its own
    assert sender.fd == -1
    assert replica.keep_pending(sums.view, sums.still_there) == 0
    via_chunks.keep_pending(primary.pending_bytes(1, 0))
    for r in (replica, via_chunks):
        assert r.apply_replicated(1, 0, 0.0)
    assert_same_state(replica, via_chunks, 1)
    backup.close()


async def test_snapshots_go_only_to_a_backup_that_takes_them_and_only_while_the_state_holds():
    """A snapshot goes through the sums' segment, in turn with the sums (the next slot, the
    next sequence number), only once an answer to sums said the backup takes them; a state
    that moved on before it was written is neither written nor sent, and takes no slot."""
    primary = FakePrimary(deferred=True)
    try:
        assert not await primary.snapshot(b"state-0")  # no segment yet
        assert await primary.send(b"sums-0")
        assert not await primary.snapshot(b"state-1")  # the backup did not say it takes them
        primary.snapshots = True
        assert await primary.send(b"sums-1")
        assert await primary.snapshot(b"state-2")
        assert not await primary.snapshot(b"stale", still=lambda: False)
        assert await primary.send(b"sums-3")
        size = primary.requests[0].segment_size
        slot0, slot1 = slot_offset(size, 0), slot_offset(size, 1)
        sums, state = ps_pb2.REPLICATE_KIND_SUMS, ps_pb2.REPLICATE_KIND_STATE
        assert [(r.kind, r.sequence, r.shared_memory_offset) for r in primary.requests] == [
            (sums, 1, slot0),
            (sums, 2, slot1),
            (state, 3, slot0),
            (sums, 4, slot1),
        ]
    finally:
        primary.close()


async def test_a_backup_takes_a_snapshot_in_place_only_from_a_deferrable_send() -> None:
    sender = Segment.create(segment_size(4096), label=MEMFD_LABEL)
    try:
        lane = backup_of(sender)
        backup = FakeBackup(lane)
        slot0 = slot_offset(sender.size, 0)
        write_blob(sender, slot0, 1, [b"state"])
        where = {"shared_memory_offset": slot0, "shared_memory_length": 5, "sequence": 1}
        with pytest.raises(InvalidField, match="shared_memory_deferrable"):
            await backup.take(ps_pb2.REPLICATE_KIND_STATE, **where)
        taken = await backup.take(
            ps_pb2.REPLICATE_KIND_STATE, shared_memory_deferrable=True, **where
        )
        assert isinstance(taken, SlotSums) and bytes(taken.view) == b"state"
        lane.close()
    finally:
        sender.close()
