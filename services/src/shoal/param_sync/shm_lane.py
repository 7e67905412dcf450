# mypy: disable-error-code="misc"
# (the parts annotate self as the assembled ParameterSyncServicer, a subclass of each part)
"""The shard's side of the same-host shared-memory lane (docs/data-plane.md, "The same-host
lane"). Part of the ParameterSyncService servicer (``service.py``).

A learner on this shard's host asks for its lane (``OpenSharedLane``); the shard creates one
nameless segment per (job, learner) (``shoal.contract.shm``: a sealed memfd) sized from *its
own* slice, never from the learner's numbers:

    [0, 16)                     nonce
    [in_offset, + in_capacity)  the learner's SyncStep bytes (its gradients and buffers)
    [out_offset, size)          the shard's answer (the new parameters and buffers)

and offers its descriptor on the process's handoff socket (``shoal.contract.lane_handoff``)
against a one-time token the reply carries: the learner fetches it once, within
``shm_fetch_window_s`` (else the lane is dropped), and the shard closes its own descriptor
once it is handed (the mapping stays).

A learner that asks for ``shared_answer`` gets an empty out-region instead and reads its
answers from the job's *answer segment* on this shard (:class:`SharedAnswer`): one per job,
shared by the job's learners on this host, its descriptor fetched like the lane's (its own
one-time token) and sealed with ``READ_ONLY_SEAL``, so the learners can only map it
read-only. The shard writes each commit's answer into it once, however many learners read
it (docs/data-plane.md, "One answer per shard"). It is safe to overwrite in place because
the commit of iteration k+1 needs every member's contribution to it, and a learner
contributes only after it copied answer k into its model; a learner that is not a member
any more is refused, and starts again from PullParameters.

A learner that asks for ``control_only`` (a collective-mode learner on the host of the shard
that coordinates its job; no other shard opens one) gets a segment that holds the nonce only
(no in-region, no answer): the lane is there for the control connection its handoff leaves
open (lane_control.py), which then carries the learner's Boundaries instead of gRPC.

A SyncStep whose header says ``shared_memory`` brings no chunk: the shard takes
``total_bytes`` from ``shared_memory_offset`` of the *calling learner's* lane (looked up by the
authenticated job and learner, so a learner can only ever name offsets in its own segment),
after checking the range lies inside the in-region; the answer is written to the out-region
and its header names where. Lanes are dropped by OpenSharedLane(close), when a generation the
learner was a member of is superseded by one without it (evicted, retired), at CloseJob, when
the descriptor was not fetched in time, and when the shard exits.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from shoal.contract.shm import NONCE_BYTES, LaneError, Segment
from shoal.contract.wire import Frame, encode_header
from shoal.param_sync.authz import authorize
from shoal.param_sync.servicer_common import _nothing, _silence
from shoal.param_sync.shard import Contribution, ShardJob
from shoal.param_sync.shard_encoding import Encoded
from shoal.runtime.auth import current_principal
from shoal.runtime.errors import FailedPrecondition, InvalidField
from shoal.v1 import parameter_sync_service_pb2 as ps_pb2

if TYPE_CHECKING:
    from shoal.param_sync.service import ParameterSyncServicer as _S

log = logging.getLogger("shoal.param_sync.service")

_ALIGN = 64
#: What ``/proc/<pid>/fd`` and ``maps`` show of a job's answer segment (a label, no name).
ANSWER_LABEL = "shoal-answer"


def _up(value: int) -> int:
    return -(-value // _ALIGN) * _ALIGN


@dataclass
class Lane:
    """One learner's segment on this shard."""

    segment: Segment
    in_offset: int
    in_capacity: int
    out_offset: int
    token: bytes = b""  # of its descriptor's handoff, until fetched or expired
    timer: asyncio.TimerHandle | None = None
    generation: int = -1  # of its last SyncStep (-1: none yet)
    # Serving its control connection (lane_control.py), once the descriptor went.
    control: asyncio.Task[None] | None = None
    # The job's answer segment its answers go to (None: its own out-region), and the token
    # of that segment's descriptor for this learner until fetched or expired.
    shared: SharedAnswer | None = None
    answer_token: bytes = b""

    def fetched(self) -> None:
        """The learner has the descriptor: the shard's own can go (the mapping stays)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.token = b""
        self.segment.release_fd()

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.control is not None:  # (it closes the connection as it ends)
            self.control.cancel()
        self.segment.close()


@dataclass
class SharedAnswer:
    """A job's answer segment on this shard: ``[offset, offset + the slice's bytes)`` holds
    the answer of commit ``written`` (the slice's ``id``, generation, iteration: a slice
    replaced by a takeover never passes for the old one), which every lane of the job that
    asked for it reads. The shard keeps its descriptor (to hand it to the job's next
    learners) until the segment goes."""

    segment: Segment
    offset: int
    written: tuple[int, int, int] | None = None
    # The copy in progress and the commit it writes (one for all the commit's answers).
    writing: asyncio.Future[None] | None = None
    writing_key: tuple[int, int, int] | None = None

    async def write(
        self, key: tuple[int, int, int], copy: Callable[[memoryview], Awaitable[None]], total: int
    ) -> None:
        """Have commit ``key``'s answer (``total`` bytes) in the segment: the first of its
        answers starts ``copy`` into the region (the others wait for that same copy)."""
        if self.written == key:
            return
        if self.writing_key != key or self.writing is None:
            region = self.segment.region(
                self.offset, total, lo=self.offset, hi=self.segment.size, what="answer"
            )
            self.written, self.writing_key = None, key
            self.writing = asyncio.ensure_future(copy(region))
            self.writing.add_done_callback(_silence)  # (each waiting answer raises it)
        writing = self.writing
        try:
            await asyncio.shield(writing)  # (an answer whose call is cancelled leaves the copy)
        except Exception:
            if self.writing is writing:  # the next answer of this commit tries again
                self.writing, self.writing_key = None, None
            raise
        if self.writing is writing:
            self.written = key

    def write_now(
        self, key: tuple[int, int, int], copy: Callable[[memoryview], None], total: int
    ) -> bool:
        """Have commit ``key``'s answer in the segment, copied by ``copy`` on this thread,
        unless a copy started by :meth:`write` is still in flight (then False: wait with
        :meth:`write`). Nothing awaits in between, so no other answer sees a copy half made."""
        if self.written == key:
            return True
        if self.writing is not None and not self.writing.done():
            return False
        region = self.segment.region(
            self.offset, total, lo=self.offset, hi=self.segment.size, what="answer"
        )
        self.written, self.writing, self.writing_key = None, None, None
        copy(region)
        self.written = key
        return True

    def close(self) -> None:
        self.segment.close()


class LaneHandlers:
    """Part of :class:`~shoal.param_sync.service.ParameterSyncServicer` (see there)."""

    async def OpenSharedLane(
        self: _S, request: ps_pb2.OpenSharedLaneRequest, context: Any
    ) -> ps_pb2.OpenSharedLaneResponse:
        authorize(
            current_principal(),
            "OpenSharedLane",
            job_id=request.job_id,
            learner_id=request.learner_id,
        )
        if not request.learner_id:
            raise InvalidField("learner_id", "", "must not be empty")
        key = (request.job_id, request.learner_id)
        self._drop_lane(key)  # one lane per learner: a new one replaces the old
        if request.close:
            return ps_pb2.OpenSharedLaneResponse(refused="closed on request")
        shard = self.options.shard_index
        if not self.options.shm_lane:
            return ps_pb2.OpenSharedLaneResponse(
                refused=f"the shared-memory lane is off on shard {shard} (--shm-lane off)"
            )
        if not request.host_id or request.host_id != self._host_id:
            return ps_pb2.OpenSharedLaneResponse(
                refused=f"host_id ({request.host_id!r}) is not shard {shard}'s host"
            )
        control_only = request.control_only
        if control_only:
            # A collective-mode learner's Boundaries: only where they are handled.
            if request.job_id not in self._coordinated:
                return ps_pb2.OpenSharedLaneResponse(
                    refused=f"shard {shard} does not coordinate job {request.job_id!r}"
                )
            in_capacity = answer_bytes = 0
        else:
            sj = self._slice(request.job_id).job
            in_capacity = sum(m.nbytes for m in sj.metas)  # the learner packs without gaps
            if in_capacity == 0:
                return ps_pb2.OpenSharedLaneResponse(refused=f"shard {shard} holds no tensor")
            answer_bytes = sj.total_bytes
        if not request.fetch_fd:
            return ps_pb2.OpenSharedLaneResponse(
                refused="this learner looks for a named segment (an older learner): shard "
                f"{shard} hands a descriptor (fetch_fd), so use gRPC streams"
            )
        in_offset = _ALIGN
        out_offset = in_offset + _up(in_capacity)
        shared = request.shared_answer and not control_only
        size = out_offset + (0 if shared else _up(answer_bytes))
        answers = None
        try:
            if not self._handoff.started:
                self._handoff.start()
            # In the loop, not a thread: nothing can cancel between its creation and its
            # lane (a cancelled RPC would leak it); memfd_create, ftruncate and mmap take
            # microseconds whatever the size (no page is touched but the nonce's).
            answers = self._shared_answer(request.job_id, answer_bytes) if shared else None
            segment = Segment.create(size)
        except OSError as exc:
            if answers is not None:  # (it goes unless another lane reads it)
                self._release_shared_answer(request.job_id, answers)
            return ps_pb2.OpenSharedLaneResponse(refused=f"no segment: {exc}")
        lane = Lane(segment, in_offset, in_capacity, out_offset, shared=answers)
        loop = asyncio.get_running_loop()
        window = self.options.shm_fetch_window_s
        lane.token = self._handoff.offer(
            segment.fd,
            window_s=window,
            on_sent=lane.fetched,
            what=f"job {request.job_id}: lane of learner {request.learner_id}",
            keep=self._lane_control_keeper(key, lane, current_principal()),
        )
        lane.timer = loop.call_later(window, self._lane_unfetched, key, lane)
        self._lanes[key] = lane
        log.info(
            "job %s: shared-memory lane of learner %s opened (%d bytes%s)",
            request.job_id,
            request.learner_id,
            size,
            ": its control connection only" if control_only else "",
        )
        reply = ps_pb2.OpenSharedLaneResponse(
            size=size,
            nonce=segment.nonce,
            in_offset=in_offset,
            in_capacity=in_capacity,
            out_offset=out_offset,
            socket_address=self._handoff.address,
            token=lane.token,
        )
        if answers is not None:
            lane.answer_token = self._handoff.offer(
                answers.segment.fd,
                window_s=window,
                on_sent=_nothing,  # (the shard keeps it for the job's next learners)
                what=f"job {request.job_id}: answer segment, for learner {request.learner_id}",
            )
            reply.answer_token = lane.answer_token
            reply.answer_size = answers.segment.size
            reply.answer_nonce = answers.segment.nonce
            reply.answer_offset = answers.offset
        return reply

    def _shared_answer(self: _S, job_id: str, total_bytes: int) -> SharedAnswer:
        """The job's answer segment on this shard (made by the first lane that asks, and made
        again when the job's slice here outgrew it: a takeover re-sliced the job; the lanes
        opened before keep the old one until they go)."""
        size = _ALIGN + _up(total_bytes)
        answers = self._shared_answers.get(job_id)
        if answers is None or answers.segment.size < size:
            segment = Segment.create(size, label=ANSWER_LABEL, read_only=True)
            if answers is not None:
                self._release_shared_answer(job_id, answers)
            answers = self._shared_answers[job_id] = SharedAnswer(segment, _ALIGN)
            log.info(
                "job %s: answer segment opened (%d bytes), shared by the job's lanes",
                job_id,
                segment.size,
            )
        return answers

    def _lane_unfetched(self: _S, key: tuple[str, str], lane: Lane) -> None:
        """The window to fetch the lane's descriptor ended: a lane never fetched goes."""
        if self._lanes.get(key) is lane and lane.token:
            log.info(
                "job %s: the lane of learner %s was not fetched within %.0f s",
                *key,
                self.options.shm_fetch_window_s,
            )
            self._drop_lane(key)

    # -- used by SyncStep ---------------------------------------------------------------------

    def _lane_of(self: _S, job_id: str, learner: str) -> Lane:
        lane = self._lanes.get((job_id, learner))
        if lane is None:
            raise FailedPrecondition(
                f"no shared-memory lane of learner {learner!r} for job {job_id!r} on shard "
                f"{self.options.shard_index}: open one (OpenSharedLane) or send chunks"
            )
        return lane

    async def _lane_collect(
        self: _S,
        frames: AsyncIterator[Frame],
        header: ps_pb2.TensorBundleHeader,
        sj: ShardJob,
        contribution: Contribution,
    ) -> Lane:
        """Take a lane SyncStep's bytes (a view: no copy) after checking their range against
        the learner's in-region; nothing may follow the header."""
        lane = self._lane_of(header.job_id, header.sender_id)
        try:
            view = lane.segment.region(
                header.shared_memory_offset,
                header.total_bytes,
                lo=lane.in_offset,
                hi=lane.in_offset + lane.in_capacity,
                what="header.shared_memory_offset",
            )
        except LaneError as exc:
            raise InvalidField(
                "header.shared_memory_offset", header.shared_memory_offset, str(exc)
            ) from None
        async for _ in frames:
            raise InvalidField("chunk", "...", "must not follow a shared_memory header")
        sj.take_chunk(contribution, view)
        sj.check_complete(contribution)
        lane.generation = header.generation
        self.metrics.lane_stream(header.job_id)
        return lane

    async def _lane_answer(
        self: _S, lane: Lane, sj: ShardJob, encoded: Encoded, key: tuple[int, int, int]
    ) -> bytes:
        """Write the new parameters of commit ``key`` (``id(sj)``, generation, iteration) into
        the lane's out-region, or once into the job's answer segment for all its lanes that
        share it; the header that says where."""
        await encoded.whole()  # the lane's answer is written whole, after the commit
        total = int(encoded.header.total_bytes)
        source = sj.flat.numpy()[:total]

        def copy_now(out: memoryview) -> None:
            np.copyto(np.frombuffer(out, dtype=np.uint8), source)

        async def copy(out: memoryview) -> None:
            await self._compute_small(total, copy_now, out)

        if lane.shared is not None:
            # A small answer is copied right here, with no hop through the event loop: it
            # leaves before the Boundary sent beside its SyncStep is handled (the learner
            # takes the parameters in meanwhile), not after.
            shared = lane.shared
            if not (self._inline_compute(total) and shared.write_now(key, copy_now, total)):
                await shared.write(key, copy, total)
            offset = shared.offset
        else:
            offset = lane.out_offset
            region = lane.segment.region(
                offset, total, lo=offset, hi=lane.segment.size, what="answer"
            )
            await copy(region)
        header = ps_pb2.TensorBundleHeader()
        header.CopyFrom(encoded.header)
        header.shared_memory = True
        header.shared_memory_offset = offset
        return encode_header(ps_pb2.SyncStepResponse, header)

    # -- cleanup ------------------------------------------------------------------------------

    def _drop_lane(self: _S, key: tuple[str, str]) -> None:
        lane = self._lanes.pop(key, None)
        if lane is not None:
            self._handoff.withdraw(lane.token)
            self._handoff.withdraw(lane.answer_token)
            lane.close()
            log.info("job %s: shared-memory lane of learner %s closed", *key)
            if lane.shared is not None:
                self._release_shared_answer(key[0], lane.shared)

    def _release_shared_answer(self: _S, job_id: str, answers: SharedAnswer) -> None:
        """``answers`` (a segment of ``job_id``) goes once no lane reads it any more (the
        learners' mappings stay until they unmap), and the job's answer segment, made later,
        stays."""
        if any(lane.shared is answers for lane in self._lanes.values()):
            return
        if self._shared_answers.get(job_id) is answers:
            del self._shared_answers[job_id]
        answers.close()
        log.info("job %s: answer segment closed", job_id)

    def _drop_lanes(self: _S, job_id: str | None = None) -> None:
        """Every lane of ``job_id`` (None: of every job), the replica segments included."""
        for key in [k for k in self._lanes if job_id is None or k[0] == job_id]:
            self._drop_lane(key)
        self._drop_replica_lanes(job_id)
        for job in [j for j in self._shared_answers if job_id is None or j == job_id]:
            self._release_shared_answer(job, self._shared_answers[job])
        for answers in [k for k in self._lane_answers if job_id is None or k[0] == job_id]:
            del self._lane_answers[answers]  # (their handlers end with the job)

    def _prune_lanes(self: _S, job_id: str, generation: int, members: frozenset[str]) -> None:
        """Generation ``generation`` of the job has ``members``: the lanes of learners that
        synced in an older generation and are not members any more go."""
        for key, lane in list(self._lanes.items()):
            if key[0] == job_id and 0 <= lane.generation < generation and key[1] not in members:
                self._drop_lane(key)


assert NONCE_BYTES <= _ALIGN  # the nonce lies before the in-region
