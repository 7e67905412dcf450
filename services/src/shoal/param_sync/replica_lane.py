# mypy: disable-error-code="misc"
# (the parts annotate self as the assembled ParameterSyncServicer, a subclass of each part)
"""Replicating a slice's sums to its backup through shared memory when both shards run on one
host (docs/data-plane.md, "Replicating the sums through shared memory"). Part of the
ParameterSyncService servicer (``service.py``).

Each iteration, before its ShardReady, a primary sends its sums (about its slice's size) to
its backup (``Replicate``, kind SUMS). Across hosts they go as gRPC chunks. On one host (the
same :func:`shoal.contract.shm.host_id`, both with the lane on) the primary writes the blob
into a nameless sealed segment of its own (``shoal.contract.shm``, one per job and backup)
and sends one ``Replicate`` message naming where; the backup fetches the segment's
descriptor once (from the primary's handoff socket, ``shoal.contract.lane_handoff``, with a
one-time token the first such message carries) and maps it. Anything else (another host, the
lane off on either side, an older backup, a segment lost to a restart) sends that
iteration's blob as chunks, as before.

**Answered before it is copied.** The segment has two slots; the primary alternates them,
one send at a time (``shared_memory_deferrable``), so a slot is written again only after the
backup answered the send after it. The backup answers at once (the primary's ShardReady no
longer waits for a 20-odd MiB copy) and its compute thread copies the blob straight from the
slot into the replica's accumulators afterwards (``keep_pending``, in arrival order), checking
the slot's sequence number again after the copy; it answers a send only once it took the one
before, which is what keeps the other slot unwritten until then. The mapping keeps the bytes
even if the primary dies meanwhile. An older primary (one slot, not deferrable) gets the
blob copied out before the answer, as before; an older backup (no ``shared_memory_deferred``
in its answer) keeps the primary on one slot.

Segment layout (the sender's), ``C`` the capacity of a slot::

    [0, 16)                          nonce
    [BLOB_OFFSET - 8, BLOB_OFFSET)   slot 0's send's sequence number (little-endian u64)
    [BLOB_OFFSET, BLOB_OFFSET + C)   slot 0's blob (the safetensors bytes of ``pending_frames``)
    [BLOB_OFFSET + C, + 8)           slot 1's send's sequence number
    [BLOB_OFFSET + C + 8, size)      slot 1's blob

(a blob's sequence number is always the 8 bytes before it: ``shared_memory_offset - 8``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from shoal.contract import faults
from shoal.contract.lane_handoff import take_segment
from shoal.contract.shm import NONCE_BYTES, LaneError, Segment
from shoal.runtime.errors import FailedPrecondition, InvalidField
from shoal.v1 import parameter_sync_service_pb2 as ps_pb2

if TYPE_CHECKING:
    from shoal.param_sync.service import ParameterSyncServicer as _S
    from shoal.param_sync.shard import ShardJob

log = logging.getLogger("shoal.param_sync.service")

BLOB_OFFSET = 64
#: The segments' label in /proc (``/memfd:shoal-sums``), apart from the learners' lanes.
MEMFD_LABEL = "shoal-sums"
_SEQUENCE_AT = BLOB_OFFSET - 8
#: Room left in a new segment beyond the blob it is made for (the blob's JSON header varies
#: a little from one iteration to the next).
SLACK_BYTES = 64 * 1024
#: Seconds the backup has to fetch a new segment's descriptor.
FETCH_WINDOW_S = 30.0
#: The reason a backup gives when the segment holds a newer send than the request's: the
#: primary sent newer sums meanwhile (this iteration was aborted and re-run), which replace
#: these; the older send is dropped, never re-sent as chunks (it would land after them).
SUPERSEDED = "superseded by a newer send"
#: The reason a backup gives when it has no segment of that nonce (it restarted, or the
#: token expired): the sender drops its segment and sends that blob as chunks.
NO_SEGMENT = "no replica segment"

#: A primary sends its backup on this host a snapshot of its slice's state after every
#: SNAPSHOT_EVERY-th commit (when the backup takes them: ``replica_snapshots``).
SNAPSHOT_EVERY = 4
#: A backup keeps at most this many committed iterations' sums unstepped per replica ...
DEFERRED_AT_MOST = 2 * SNAPSHOT_EVERY
#: ... and at most this many bytes of them (a bigger slice steps more of them itself).
DEFERRED_BYTES = 256 * 1024 * 1024

assert NONCE_BYTES <= _SEQUENCE_AT


def deferral_limit(replica: ShardJob) -> int:
    """How many committed iterations' sums ``replica`` may keep unstepped (0: it steps each
    at its commit, and takes no snapshots)."""
    acc_bytes = sum(a.numel() * a.element_size() for a in replica.acc)
    return min(DEFERRED_AT_MOST, DEFERRED_BYTES // max(acc_bytes, 1))


def segment_size(capacity: int) -> int:
    """The size of a segment of two slots of ``capacity`` bytes each."""
    return BLOB_OFFSET + 2 * capacity + 8


def slot_capacity(size: int) -> int:
    """The bytes a slot of a segment of ``size`` bytes holds."""
    return (size - BLOB_OFFSET - 8) // 2


def slot_offset(size: int, slot: int) -> int:
    """Where slot ``slot`` (0 or 1)'s blob starts in a segment of ``size`` bytes."""
    return BLOB_OFFSET + slot * (slot_capacity(size) + 8)


@dataclass
class SendLane:
    """A primary's segment for the sums it replicates to one backup of one job."""

    segment: Segment
    token: bytes = b""  # the descriptor's handoff token, until fetched
    sequence: int = 0
    # The backup answers before it copies (``shared_memory_deferred``): the slots alternate.
    deferred: bool = False
    # The backup defers its replica's steps and takes snapshots (``replica_snapshots``).
    snapshots: bool = False
    slot: int = 0
    # One send at a time: the slot written next was answered for (see the module's doc).
    sending: asyncio.Lock = field(default_factory=asyncio.Lock)

    def fetched(self) -> None:
        self.token = b""
        self.segment.release_fd()

    @property
    def capacity(self) -> int:
        return slot_capacity(self.segment.size)


def write_blob(segment: Segment, offset: int, sequence: int, parts: Sequence[Any]) -> int:
    """Write ``parts`` (byte-like) one after the other into the slot at ``offset``, with
    ``sequence`` before them; returns the blob's length (call on the compute thread).
    :class:`LaneError` (nothing written) when they are more than the slot holds."""
    sources = [np.frombuffer(memoryview(part).cast("B"), dtype=np.uint8) for part in parts]
    length = sum(source.size for source in sources)
    blob = segment.region(
        offset, length, lo=offset, hi=offset + slot_capacity(segment.size), what="blob"
    )
    seq = segment.region(offset - 8, 8, lo=_SEQUENCE_AT, hi=segment.size, what="sequence")
    seq[:] = sequence.to_bytes(8, "little")
    target = np.frombuffer(blob, dtype=np.uint8)
    at = 0
    for source in sources:
        target[at : at + source.size] = source
        at += source.size
    return length


@dataclass
class RecvLane:
    """A backup's mapping of a primary's segment. For an older primary's sends (one slot,
    copied out before the answer), two buffers it copies blobs into in turn (reused: a fresh
    20-odd MiB array each iteration costs its page faults again); a blob's buffer is next
    written two sends later, when its ``keep_pending`` has long run: the primary sends the
    next sums only after the commit that follows this one, and the backup's compute thread
    runs ``keep_pending`` (queued at the answer) before that commit."""

    segment: Segment
    buffers: list[np.ndarray]
    newest: int = 0  # the newest send taken in place (an older one is refused)
    # The last send taken in place, until the compute thread has copied it out.
    taking: asyncio.Future[Any] | None = None

    def close(self) -> None:
        self.segment.close()


@dataclass
class SlotSums:
    """A send's blob to take in place, from the sender's slot: ``view`` and the slot's
    sequence number, to check again once it is copied (:meth:`still_there`)."""

    view: memoryview
    sequence_view: memoryview
    sequence: int

    def still_there(self) -> bool:
        return int.from_bytes(self.sequence_view, "little") == self.sequence


def slot_of(lane: RecvLane, offset: int, length: int, sequence: int) -> SlotSums:
    """The blob ``[offset, offset + length)`` (inside the blob region) where it lies, checked
    to be the one of ``sequence``; :class:`LaneError` otherwise."""
    segment = lane.segment
    seq = segment.region(offset - 8, 8, lo=_SEQUENCE_AT, hi=segment.size, what="sequence")
    view = segment.region(
        offset, length, lo=BLOB_OFFSET, hi=segment.size, what="shared_memory_offset"
    )
    sums = SlotSums(view, seq, sequence)
    if not sums.still_there():
        raise LaneError(f"{SUPERSEDED}: the segment holds another send than sequence {sequence}")
    return sums


def read_blob(lane: RecvLane, offset: int, length: int, sequence: int) -> np.ndarray:
    """A copy of the blob ``[offset, offset + length)`` (inside the blob region), checked to be
    the one of ``sequence`` both before and after the copy (the sender wrote no newer one
    meanwhile); :class:`LaneError` otherwise. (For an older sender, one slot, not
    deferrable.)"""
    sums = slot_of(lane, offset, length, sequence)
    slot = sequence % 2
    if lane.buffers[slot].size < length:
        lane.buffers[slot] = np.empty(length, dtype=np.uint8)
    out = lane.buffers[slot][:length]
    np.copyto(out, np.frombuffer(sums.view, dtype=np.uint8))
    if not sums.still_there():
        raise LaneError(f"{SUPERSEDED}: the segment was rewritten while {sequence} was read")
    return out


class ReplicaLaneHandlers:
    """Part of :class:`~shoal.param_sync.service.ParameterSyncServicer` (see there)."""

    # -- the primary's side -------------------------------------------------------------------

    async def _replicate_sums_shm(
        self: _S,
        job_id: str,
        shard_index: int,
        address: str,
        header: bytes,
        views: list[Any],
        *,
        kind: int = ps_pb2.REPLICATE_KIND_SUMS,
        still: Callable[[], bool] | None = None,
    ) -> bool:
        """Send the sums blob (``header`` and ``views``) to the backup at ``address`` through
        shared memory; False when it must go as chunks (not on one host, the backup does not
        take it). Raises what the call raised otherwise. ``kind`` STATE: a snapshot, sent only
        through a segment whose backup takes them, and only if ``still()`` (asked on the
        compute thread before the write) says the views still hold the state they were made
        of; False otherwise (it is not sent as chunks)."""
        key = (job_id, address)
        if not self._host_id or key in self._replica_no_shm:
            return False
        if kind == ps_pb2.REPLICATE_KIND_STATE:
            current = self._replica_sends.get(key)
            if current is None or not current.snapshots:
                return False
        for other in [k for k in self._replica_sends if k[0] == job_id and k != key]:
            self._drop_send_lane(other)  # the job's backup moved
        total = len(header) + sum(memoryview(v).nbytes for v in views)
        while True:
            lane = self._replica_sends.get(key)
            if lane is None or lane.capacity < total:
                self._drop_send_lane(key)
                if not self._handoff.started:
                    self._handoff.start()
                try:
                    segment = Segment.create(segment_size(total + SLACK_BYTES), label=MEMFD_LABEL)
                except OSError as exc:
                    log.info("job %s: sums to %s as chunks (no segment: %s)", job_id, address, exc)
                    self._replica_no_shm.add(key)
                    return False
                lane = SendLane(segment)
                lane.token = self._handoff.offer(
                    segment.fd,
                    window_s=FETCH_WINDOW_S,
                    on_sent=lane.fetched,
                    what=f"job {job_id}: sums of shard {shard_index} for its backup",
                )
                self._replica_sends[key] = lane
            async with lane.sending:
                if self._replica_sends.get(key) is lane:  # else dropped meanwhile: anew
                    return await self._send_sums_shm(
                        lane, key, job_id, shard_index, [header, *views], kind, still
                    )

    async def _send_sums_shm(
        self: _S,
        lane: SendLane,
        key: tuple[str, str],
        job_id: str,
        shard_index: int,
        parts: list[Any],
        kind: int,
        still: Callable[[], bool] | None,
    ) -> bool:
        """One send through ``lane`` (its ``sending`` lock held), as
        :meth:`_replicate_sums_shm` says."""
        address = key[1]
        # The other slot when the backup answers before it copies: the send there was taken
        # (the last answer says so).
        slot = 1 - lane.slot if lane.deferred else lane.slot
        offset = slot_offset(lane.segment.size, slot)
        sequence = lane.sequence + 1

        def write() -> int | None:
            if still is not None and not still():
                return None  # the state moved on: nothing written, nothing sent
            return write_blob(lane.segment, offset, sequence, parts)

        length = await self._compute(write)
        if length is None:
            return False
        lane.slot, lane.sequence = slot, sequence
        request = ps_pb2.ReplicateRequest(
            job_id=job_id,
            shard_index=shard_index,
            replica=True,
            kind=kind,
            shared_memory=True,
            shared_memory_offset=offset,
            shared_memory_length=length,
            host_id=self._host_id,
            segment_size=lane.segment.size,
            segment_nonce=lane.segment.nonce,
            socket_address=self._handoff.address if lane.token else "",
            token=lane.token,
            sequence=lane.sequence,
            shared_memory_deferrable=True,
        )
        try:
            reply = await self._replicate_call(address, [request.SerializeToString()])
        except FailedPrecondition as exc:
            if SUPERSEDED in str(exc):  # newer sums went through this segment meanwhile
                raise
            self._drop_send_lane(key)
            if NO_SEGMENT not in str(exc):  # another host, the lane off there
                self._replica_no_shm.add(key)
            log.info("job %s: sums to %s as chunks: %s", job_id, address, exc)
            return False
        except BaseException:
            self._drop_send_lane(key)
            raise
        if not reply.shared_memory_taken:  # an older backup: it ignored the segment
            self._drop_send_lane(key)
            self._replica_no_shm.add(key)
            log.info("job %s: sums to %s as chunks (it reads no shared memory)", job_id, address)
            return False
        lane.deferred = reply.shared_memory_deferred
        if kind == ps_pb2.REPLICATE_KIND_SUMS:
            lane.snapshots = reply.replica_snapshots
        return True

    def _snapshot_to_backup(self: _S, job_id: str) -> None:
        """After a commit: send the slice's state to its backup on this host as a snapshot
        (in the background), when the backup takes them; it then drops the sums it kept
        unstepped (docs/data-plane.md, "The replica's steps deferred")."""
        part = self._slices.get(job_id)
        if part is None or not part.backup_address:
            return
        lane = self._replica_sends.get((job_id, part.backup_address))
        if lane is None or not lane.snapshots:
            return
        sj, address = part.job, part.backup_address

        def frames() -> tuple[bytes, list[Any], Callable[[], bool], int]:
            completed, restores = sj.completed, sj.restores
            header, views = sj.state_frames(completed)

            def still() -> bool:
                current = self._slices.get(job_id)
                return (
                    current is not None
                    and current.job is sj
                    and (sj.completed, sj.restores) == (completed, restores)
                )

            return header, views, still, completed

        async def send() -> None:
            header, views, still, completed = await self._compute(frames)
            sent = await self._replicate_sums_shm(
                job_id,
                sj.shard_index,
                address,
                header,
                views,
                kind=ps_pb2.REPLICATE_KIND_STATE,
                still=still,
            )
            if sent and faults.armed_from("snapshot-sent", completed):
                faults.die("snapshot-sent")

        self._in_background(send(), f"job {job_id}: no snapshot sent to the backup {address}")

    def _drop_send_lane(self: _S, key: tuple[str, str]) -> None:
        lane = self._replica_sends.pop(key, None)
        if lane is not None:
            self._handoff.withdraw(lane.token)
            lane.segment.close()

    # -- the backup's side --------------------------------------------------------------------

    async def _take_sums_shm(self: _S, first: ps_pb2.ReplicateRequest) -> np.ndarray | SlotSums:
        """The blob a shared-memory Replicate names: where it lies in the sender's segment
        (a deferrable send, taken in place once answered: :meth:`_taking`), or copied out of
        it (an older sender's)."""
        if not first.replica or first.kind not in (
            ps_pb2.REPLICATE_KIND_SUMS,
            ps_pb2.REPLICATE_KIND_STATE,
        ):
            raise InvalidField("shared_memory", True, "only for SUMS or STATE to a replica")
        if first.kind == ps_pb2.REPLICATE_KIND_STATE and not first.shared_memory_deferrable:
            raise InvalidField("shared_memory_deferrable", False, "must be set for STATE")
        if not self._host_id or first.host_id != self._host_id:
            raise FailedPrecondition(
                f"shard {self.options.shard_index} takes no shared memory from host_id "
                f"{first.host_id!r} (another host, or its lane is off)"
            )
        key = (first.job_id, first.shard_index)
        self._replica(first.job_id, first.shard_index)  # NotFound when not configured
        lane = self._replica_recv.get(key)
        if lane is None or lane.segment.nonce != first.segment_nonce:
            if not first.token:
                raise FailedPrecondition(
                    f"{NO_SEGMENT} of shard {first.shard_index} of job {first.job_id!r} on "
                    f"shard {self.options.shard_index}"
                )
            try:
                fresh = await asyncio.to_thread(
                    take_segment,
                    first.socket_address,
                    first.token,
                    first.segment_size,
                    first.segment_nonce,
                )
            except (OSError, LaneError) as exc:
                raise FailedPrecondition(f"{NO_SEGMENT}: its descriptor: {exc}") from None
            old = self._replica_recv.pop(key, None)
            if old is not None:
                old.close()
            empty = np.empty(0, dtype=np.uint8)
            self._replica_recv[key] = lane = RecvLane(fresh, [empty, empty])
        where = (first.shared_memory_offset, first.shared_memory_length, first.sequence)
        try:
            if not first.shared_memory_deferrable:
                return await asyncio.to_thread(read_blob, lane, *where)
            if first.sequence <= lane.newest:
                raise LaneError(f"{SUPERSEDED}: sequence {first.sequence} after {lane.newest}")
            lane.newest = first.sequence
            sums = slot_of(lane, *where)
        except LaneError as exc:
            raise FailedPrecondition(f"{NO_SEGMENT} to read: {exc}") from None
        # The send before is copied out before this one is answered: the sender writes its
        # slot next.
        if lane.taking is not None and not lane.taking.done():
            await asyncio.wait([lane.taking])
        return sums

    def _taking(self: _S, job_id: str, shard_index: int, taking: asyncio.Future[Any]) -> None:
        """``taking`` copies the last in-place send of the replica lane of (``job_id``,
        ``shard_index``) out of its slot: the next send is answered once it is done."""
        lane = self._replica_recv.get((job_id, shard_index))
        if lane is not None:
            lane.taking = taking

    def _drop_replica_lanes(self: _S, job_id: str | None = None) -> None:
        """The replica segments (sent and received) of ``job_id`` (None: of every job)."""
        for key in [k for k in self._replica_sends if job_id is None or k[0] == job_id]:
            self._drop_send_lane(key)
        for rkey in [k for k in self._replica_recv if job_id is None or k[0] == job_id]:
            self._replica_recv.pop(rkey).close()
        self._replica_no_shm = {
            k for k in self._replica_no_shm if job_id is not None and k[0] != job_id
        }
