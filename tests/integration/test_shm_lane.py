"""The same-host shared-memory lane against a real shard (in this process, real gRPC, auth on)
driven by a hand-written learner, so every offset is the test's choice: a round through the
lane gives exactly the gRPC round's update; out-of-bounds offsets, a lane that does not exist
and another job's learner are refused with a clear error and change nothing; the lane's control
connection carries its SyncSteps and Boundaries as gRPC would (the same answers, the same
refusals, a Boundary sent ahead beside the SyncStep) and speaks for its own lane only; the
segment never has a name, its descriptor is handed once to the right token only (a wrong,
used or expired token gets nothing), a learner whose fetch fails stays on gRPC, and the lane
goes with the job; a job's lanes that ask for it share one read-only answer segment. The lane
under real learner processes is in ``test_shm_lane_processes.py``."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from grpc import aio

from shoal.contract.errors import decode_rpc_error
from shoal.contract.lane_handoff import TOKEN_BYTES, fetch_fd, fetch_fd_keeping
from shoal.contract.shm import PREFIX, SHM_DIR, LaneError, Segment, host_id
from shoal.contract.wire import (
    BundleReceiver,
    TensorMeta,
    byte_view,
    encode_chunks,
    encode_header,
    header_of,
    pack_layout,
)
from shoal.learner.grpc_backend import stream_methods
from shoal.learner.grpc_lane import LaneControl, open_lane
from shoal.param_sync.service import ParameterSyncServicer, ShardOptions
from shoal.runtime.auth import LearnerTokenSigner
from shoal.runtime.server import RunningServer
from shoal.v1 import (
    job_pb2,
    parameter_sync_service_pb2 as ps_pb2,
    parameter_sync_service_pb2_grpc as ps_grpc,
)
from tests.integration.shard_bed import start_shard
from tests.support import async_wait_until, make_tokens

JOB, OTHER = "job-a", "job-b"
STRANGER = "job-z"  # a job this shard does not coordinate (nor hold)
# The lane needs a writable /dev/shm (every Linux host; a container may lack one).
pytestmark = pytest.mark.skipif(
    not os.access(SHM_DIR, os.W_OK), reason=f"{SHM_DIR} is not writable here"
)
LEARNER = f"{JOB}-l1"
LAYOUT, TOTAL = pack_layout([TensorMeta("w", "float32", (4, 2), 0, 32)])
W0 = torch.arange(8, dtype=torch.float32).view(4, 2)
LR = 0.5


@dataclass
class Shard:
    server: RunningServer
    servicer: ParameterSyncServicer
    tokens: dict[str, str]
    channel: aio.Channel

    def md(self, who: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.tokens[who]}"),)

    async def call(self, who: str, method: str, request: Any) -> Any:
        stub = ps_grpc.ParameterSyncServiceStub(self.channel)
        return await getattr(stub, method)(request, metadata=self.md(who), timeout=30)

    async def status(self, who: str, method: str, request: Any) -> tuple[grpc.StatusCode, str]:
        try:
            await self.call(who, method, request)
        except aio.AioRpcError as exc:
            return exc.code(), exc.details() or ""
        return grpc.StatusCode.OK, ""

    async def sync(self, who: str, header: ps_pb2.TensorBundleHeader, chunks: list[bytes]) -> Any:
        """One SyncStep: the header, ``chunks``; returns the answer's frames."""

        async def messages() -> AsyncIterator[bytes]:
            yield encode_header(ps_pb2.SyncStepRequest, header)
            for chunk in chunks:
                yield chunk

        call = stream_methods(self.channel)["SyncStep"](messages(), metadata=self.md(who))
        return [frame async for frame in call]

    async def completed(self) -> int:
        reply = await self.call(
            "service", "GetJobProgress", ps_pb2.GetJobProgressRequest(job_id=JOB)
        )
        return int(reply.progress.completed_iterations)


def lane_request(learner: str = LEARNER, **fields: Any) -> ps_pb2.OpenSharedLaneRequest:
    fields = {"job_id": JOB, "host_id": host_id(), "fetch_fd": True, **fields}
    return ps_pb2.OpenSharedLaneRequest(learner_id=learner, **fields)


def named_segments() -> list[str]:
    """Lane names of this process (the shard's) under /dev/shm: there must never be one."""
    return [n for n in os.listdir(SHM_DIR) if n.startswith(f"{PREFIX}{os.getpid()}-")]


async def take(lane: ps_pb2.OpenSharedLaneResponse, token: bytes | None = None) -> Segment:
    """What the learner does with the reply: fetch the descriptor, map the segment."""
    fd = await asyncio.to_thread(
        fetch_fd, lane.socket_address, lane.token if token is None else token, timeout=30
    )
    try:
        return Segment.from_fd(fd, lane.size, lane.nonce)
    finally:
        os.close(fd)


def grad_header(generation: int, **lane: Any) -> ps_pb2.TensorBundleHeader:
    header = header_of(
        job_id=JOB,
        sender_id=LEARNER,
        metas=LAYOUT,
        total_bytes=TOTAL,
        generation=generation,
        iteration=0,
        num_samples=4,
    )
    for name, value in lane.items():
        setattr(header, name, value)
    return header


def read_answer(frames: list[Any], segment: Segment | None, lane: Any) -> torch.Tensor:
    header = frames[0].header
    out = torch.zeros(4, 2)
    receiver = BundleReceiver(
        [TensorMeta.from_proto(t) for t in header.tensors],
        header.total_bytes,
        lambda i, off, seg: byte_view(out).__setitem__(
            slice(off, off + seg.nbytes), np.frombuffer(seg, np.uint8)
        ),
    )
    if header.shared_memory:
        assert segment is not None and len(frames) == 1
        receiver.feed(
            segment.region(
                header.shared_memory_offset,
                header.total_bytes,
                lo=lane.out_offset,
                hi=lane.size,
                what="answer",
            )
        )
    else:
        for frame in frames[1:]:
            receiver.feed(frame.chunk)
    receiver.finish()
    return out


@pytest.fixture
async def shard(tmp_path: Path) -> AsyncIterator[Shard]:
    tokens = make_tokens(tmp_path / "tokens")
    signer = LearnerTokenSigner.generate()
    bed = await start_shard(
        tmp_path / "tokens", tokens["service"], (tmp_path / "storage").as_uri(), signer=signer
    )
    server, servicer = bed.server, bed.servicer
    tokens = {
        **tokens,
        "learner": signer.mint(job_id=JOB, learner_id=LEARNER),
        "learner-2": signer.mint(job_id=JOB, learner_id=f"{JOB}-l2"),
        "other": signer.mint(job_id=OTHER, learner_id=f"{OTHER}-l1"),
        "stranger": signer.mint(job_id=STRANGER, learner_id=f"{STRANGER}-l1"),
    }
    s = Shard(server, servicer, tokens, aio.insecure_channel(server.address))
    for job in (JOB, OTHER):
        request = ps_pb2.OpenJobRequest(
            job_id=job,
            spec=job_pb2.JobSpec(batch_size=4, epochs=1, seed=1),
            shard_addresses=[server.address],
        )
        await s.call("service", "OpenJob", request)
    join = ps_pb2.JoinRequest(
        job_id=JOB,
        learner_id=LEARNER,
        layout=[m.to_proto() for m in LAYOUT],
        optimizer=ps_pb2.OptimizerSpec(name="SGD", hyperparameters_json=f'{{"lr": {LR}}}'),
        dataset_size=4,
    )
    assert (await s.call("learner", "Join", join)).initialize

    async def upload() -> AsyncIterator[bytes]:
        header = header_of(job_id=JOB, sender_id=LEARNER, metas=LAYOUT, total_bytes=TOTAL)
        yield encode_header(ps_pb2.InitializeParametersRequest, header)
        for chunk in encode_chunks(LAYOUT, [byte_view(W0)], TOTAL):
            yield chunk

    await stream_methods(s.channel)["InitializeParameters"](upload(), metadata=s.md("learner"))
    yield s
    await s.channel.close()
    await bed.stop()


async def test_a_lane_round_equals_a_grpc_round_and_bad_offsets_change_nothing(shard: Shard):
    s = shard
    boundary = ps_pb2.BoundaryRequest(job_id=JOB, learner_id=LEARNER)
    a = (await s.call("learner", "Boundary", boundary)).assignment
    lane = await s.call("learner", "OpenSharedLane", lane_request())
    assert not lane.refused, lane.refused
    # Before the learner fetched it: the segment has no name, under /dev/shm or anywhere.
    assert named_segments() == [] and not lane.path
    assert lane.socket_address.startswith("@shoal-lane-") and len(lane.token) == TOKEN_BYTES
    assert lane.in_capacity == TOTAL and lane.out_offset >= lane.in_offset + TOTAL
    # A wrong token gets nothing and changes nothing; the right one the descriptor, once.
    wrong = bytes(b ^ 0xFF for b in lane.token)
    with pytest.raises(LaneError, match="handed 0 descriptors"):
        await take(lane, wrong)
    assert s.servicer._lanes[(JOB, LEARNER)].token == lane.token
    segment = await take(lane)
    with pytest.raises(LaneError, match="handed 0 descriptors"):
        await take(lane)  # replayed
    assert s.servicer._handoff.handed == 1 and s.servicer._handoff.refused == 2
    assert s.servicer._lanes[(JOB, LEARNER)].segment.fd == -1  # the shard's descriptor closed

    # Another job's learner, or another learner of the job, gets no lane of this learner.
    for who, job in (("other", JOB), ("learner-2", JOB), ("other", OTHER)):
        request = ps_pb2.OpenSharedLaneRequest(
            job_id=job, learner_id=LEARNER, host_id=host_id(), fetch_fd=True
        )
        code, _ = await s.status(who, "OpenSharedLane", request)
        assert code == grpc.StatusCode.PERMISSION_DENIED, (who, job)
    # Another host gets none either (it streams over gRPC).
    elsewhere = lane_request(f"{JOB}-l2", host_id="elsewhere")
    reply = await s.call("learner-2", "OpenSharedLane", elsewhere)
    assert "is not shard 0's host" in reply.refused and not reply.token

    g = torch.tensor([[1.0, -2.0], [0.5, 4.0], [3.0, 0.0], [-1.0, 2.0]])
    lo, hi = lane.in_offset, lane.in_offset + lane.in_capacity
    bad = {
        "past the in-region": hi - 8,
        "into the out-region": lane.out_offset,
        "before the in-region (the nonce)": 0,
        "negative": -32,
        "far beyond the segment": 2**40,
    }
    for why, offset in bad.items():
        header = grad_header(a.generation, shared_memory=True, shared_memory_offset=offset)
        with pytest.raises(aio.AioRpcError) as info:
            await s.sync("learner", header, [])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, why
        details = info.value.details()
        assert "header.shared_memory_offset" in details and f"[{lo}, {hi})" in details, details
    # Chunks after a lane header; a lane SyncStep by a learner that has no lane.
    header = grad_header(a.generation, shared_memory=True, shared_memory_offset=lo)
    with pytest.raises(aio.AioRpcError) as info:
        await s.sync("learner", header, list(encode_chunks(LAYOUT, [byte_view(g)], TOTAL)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "must not follow a shared_memory header" in info.value.details()
    assert await s.completed() == 0

    # Nothing changed: one round through the lane gives exactly W0 - lr * g.
    region = segment.region(lo, TOTAL, lo=lo, hi=hi, what="bundle")
    region[:] = byte_view(g).tobytes()
    frames = await s.sync("learner", header, [])
    assert frames[0].header.shared_memory and len(frames) == 1
    new = read_answer(frames, segment, lane)
    torch.testing.assert_close(new, W0 - LR * g, atol=0, rtol=0)
    assert await s.completed() == 1
    assert named_segments() == []

    # A learner that synced in generation g and is not a member of a later one (evicted,
    # retired) loses its lane when the shard learns that generation; members keep theirs.
    s.servicer._prune_lanes(JOB, a.generation, frozenset())
    s.servicer._prune_lanes(JOB, a.generation + 1, frozenset({LEARNER}))
    assert (JOB, LEARNER) in s.servicer._lanes
    # The job ends: its lanes go (the segment is only the test's mapping now).
    assert s.servicer._lanes
    await s.call("service", "CloseJob", ps_pb2.CloseJobRequest(job_id=JOB))
    assert not s.servicer._lanes
    segment.close()


async def test_an_evicted_learners_lane_goes_with_the_next_generation(shard: Shard):
    s = shard
    assert not (await s.call("learner", "OpenSharedLane", lane_request())).refused
    s.servicer._lanes[(JOB, LEARNER)].generation = 1  # it synced in generation 1
    s.servicer._prune_lanes(JOB, 2, frozenset({f"{JOB}-l2"}))
    assert not s.servicer._lanes and s.servicer._handoff.offers == 0


async def test_a_lane_off_shard_refuses_and_close_drops_the_lane(shard: Shard):
    s = shard
    lane = await s.call("learner", "OpenSharedLane", lane_request())
    assert lane.token and s.servicer._handoff.offers == 1
    await s.call(
        "learner",
        "OpenSharedLane",
        ps_pb2.OpenSharedLaneRequest(job_id=JOB, learner_id=LEARNER, close=True),
    )
    assert not s.servicer._lanes and s.servicer._handoff.offers == 0
    with pytest.raises(LaneError):
        await take(lane)  # closed before it was fetched: its token fetches nothing
    s.servicer.options = ShardOptions(shard_index=0, storage_uri="", shm_lane=False)
    reply = await s.call("learner", "OpenSharedLane", lane_request())
    assert "--shm-lane off" in reply.refused and not s.servicer._lanes


async def test_a_lane_not_fetched_in_time_is_dropped_and_its_token_gets_nothing(shard: Shard):
    s = shard
    s.servicer.options = dataclasses.replace(s.servicer.options, shm_fetch_window_s=0.3)
    lane = await s.call("learner", "OpenSharedLane", lane_request())
    assert not lane.refused and (JOB, LEARNER) in s.servicer._lanes
    await async_wait_until(
        lambda: (JOB, LEARNER) not in s.servicer._lanes, timeout=30, what="the lane dropped"
    )
    assert s.servicer._handoff.offers == 0
    with pytest.raises(LaneError, match="handed 0 descriptors"):
        await take(lane)
    # A lane SyncStep now finds no lane: the learner would send chunks (and ask again).
    a = (
        await s.call("learner", "Boundary", ps_pb2.BoundaryRequest(job_id=JOB, learner_id=LEARNER))
    ).assignment
    header = grad_header(a.generation, shared_memory=True, shared_memory_offset=64)
    with pytest.raises(aio.AioRpcError) as info:
        await s.sync("learner", header, [])
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no shared-memory lane" in info.value.details()


async def test_a_learner_whose_fetch_fails_stays_on_grpc(shard: Shard, caplog):
    """The learner's own path (``open_lane``): the token expired before it fetched, so it
    gets no lane and logs why; its round then goes through gRPC chunks, exactly."""
    s = shard
    s.servicer.options = dataclasses.replace(s.servicer.options, shm_fetch_window_s=0.0)
    caplog.set_level(logging.INFO, logger="shoal.learner.grpc")
    stub = ps_grpc.ParameterSyncServiceStub(s.channel)
    lane = await open_lane(
        stub, job_id=JOB, learner_id=LEARNER, metadata=s.md("learner"), address="shard-0"
    )
    assert lane is None
    assert any("handed 0 descriptors" in r.getMessage() for r in caplog.records), caplog.text
    a = (
        await s.call("learner", "Boundary", ps_pb2.BoundaryRequest(job_id=JOB, learner_id=LEARNER))
    ).assignment
    g = torch.tensor([[2.0, 1.0], [0.0, -4.0], [1.0, 1.0], [0.5, 0.5]])
    frames = await s.sync(
        "learner", grad_header(a.generation), list(encode_chunks(LAYOUT, [byte_view(g)], TOTAL))
    )
    assert not frames[0].header.shared_memory
    torch.testing.assert_close(read_answer(frames, None, None), W0 - LR * g, atol=0, rtol=0)


async def test_a_jobs_lanes_share_one_read_only_answer_segment(shard: Shard):
    """A learner asking for ``shared_answer`` (``open_lane`` does) gets an empty out-region and
    the descriptor of the job's answer segment, sealed read-only and mapped so; the job's
    other lanes on the shard get the same segment; a round's answer is written there, equal
    to the gRPC round's; the segment goes with the job's last lane."""
    s = shard
    a = (
        await s.call("learner", "Boundary", ps_pb2.BoundaryRequest(job_id=JOB, learner_id=LEARNER))
    ).assignment
    stub = ps_grpc.ParameterSyncServiceStub(s.channel)
    lane = await open_lane(
        stub,
        job_id=JOB,
        learner_id=LEARNER,
        metadata=s.md("learner"),
        address="shard-0",
        control=False,
    )
    assert lane is not None and lane.answers is not None
    assert lane.out_offset == lane.segment.size  # no out-region of its own
    other = await s.call(
        "learner-2", "OpenSharedLane", lane_request(f"{JOB}-l2", shared_answer=True)
    )
    assert other.answer_token and other.answer_nonce == lane.answers.nonce  # the same segment
    assert other.out_offset == other.size and len(s.servicer._shared_answers) == 1
    g = torch.tensor([[1.0, 2.0], [-0.5, 4.0], [3.0, 1.0], [-1.0, 0.0]])
    offset = lane.write(LAYOUT, [byte_view(g)], TOTAL)
    header = grad_header(a.generation, shared_memory=True, shared_memory_offset=offset)
    frames = await s.sync("learner", header, [])
    answer = frames[0].header
    assert answer.shared_memory and answer.shared_memory_offset == lane.answers_offset
    (new,) = lane.answer_views(answer, LAYOUT)
    torch.testing.assert_close(new, W0 - LR * g, atol=0, rtol=0)
    region = lane.answers.region(
        lane.answers_offset, TOTAL, lo=lane.answers_offset, hi=lane.answers.size, what="answer"
    )
    assert region.readonly
    assert s.servicer._shared_answers[JOB].written[1:] == (a.generation, 0)
    # One lane closed: the segment stays for the other; the last closed: it goes.
    for learner, who in ((f"{JOB}-l2", "learner-2"), (LEARNER, "learner")):
        assert JOB in s.servicer._shared_answers
        close = ps_pb2.OpenSharedLaneRequest(job_id=JOB, learner_id=learner, close=True)
        await s.call(who, "OpenSharedLane", close)
    assert JOB not in s.servicer._shared_answers and s.servicer._handoff.offers == 0

    # The job's slice here grows (a takeover re-sliced it): a lane opened then gets a new
    # segment of the new size; the lanes opened before keep theirs until they go, and the
    # new one stays.
    before = await s.call("learner", "OpenSharedLane", lane_request(shared_answer=True))
    old = s.servicer._shared_answers[JOB]
    grown = s.servicer._shared_answer(JOB, TOTAL * 100)
    assert grown is not old and grown.segment.size >= TOTAL * 100
    assert s.servicer._shared_answers[JOB] is grown and old.segment.size == before.answer_size
    assert s.servicer._shared_answer(JOB, TOTAL) is grown  # big enough: kept
    close = ps_pb2.OpenSharedLaneRequest(job_id=JOB, learner_id=LEARNER, close=True)
    await s.call("learner", "OpenSharedLane", close)
    assert s.servicer._shared_answers[JOB] is grown
    await s.call("service", "CloseJob", ps_pb2.CloseJobRequest(job_id=JOB))
    assert JOB not in s.servicer._shared_answers
    torch.testing.assert_close(new, W0 - LR * g, atol=0, rtol=0)  # its mapping stays
    lane.close()


async def test_a_refused_or_failed_shared_lane_leaves_no_answer_segment(shard: Shard, monkeypatch):
    """Another job's learner, or another learner of the job, asking for a learner's lane with
    ``shared_answer`` is refused before anything is made; a lane whose own segment cannot be
    made (no memory) is refused and the answer segment made for it goes too."""
    s = shard
    for who in ("other", "learner-2"):
        code, _ = await s.status(who, "OpenSharedLane", lane_request(shared_answer=True))
        assert code == grpc.StatusCode.PERMISSION_DENIED, who
    assert not s.servicer._shared_answers and not s.servicer._lanes
    made: list[Segment] = []
    create = Segment.create

    def create_then_fail(size: int, **kwargs: Any) -> Segment:
        if not kwargs.get("read_only"):
            raise OSError(12, "Cannot allocate memory")
        made.append(create(size, **kwargs))
        return made[-1]

    monkeypatch.setattr(Segment, "create", create_then_fail)
    reply = await s.call("learner", "OpenSharedLane", lane_request(shared_answer=True))
    assert "no segment" in reply.refused and not reply.answer_token
    assert len(made) == 1 and made[0].fd == -1  # made, then closed
    assert not s.servicer._shared_answers and not s.servicer._lanes
    assert s.servicer._handoff.offers == 0


async def test_an_older_learner_gets_no_lane_and_a_reason(shard: Shard):
    """A learner without ``fetch_fd`` would look for a named segment: the shard says no (it
    uses gRPC streams), and makes no segment."""
    s = shard
    request = ps_pb2.OpenSharedLaneRequest(job_id=JOB, learner_id=LEARNER, host_id=host_id())
    reply = await s.call("learner", "OpenSharedLane", request)
    assert "an older learner" in reply.refused and not reply.path and not reply.token
    assert not s.servicer._lanes and s.servicer._handoff.offers == 0


async def take_with_control(lane: ps_pb2.OpenSharedLaneResponse) -> tuple[Segment, LaneControl]:
    """What the learner does with the reply when it keeps the lane's control connection."""
    fd, sock = await asyncio.to_thread(
        fetch_fd_keeping, lane.socket_address, lane.token, timeout=30
    )
    try:
        segment = Segment.from_fd(fd, lane.size, lane.nonce)
    finally:
        os.close(fd)
    return segment, LaneControl(sock)


async def test_the_lanes_control_carries_its_syncsteps_as_grpc_would(shard: Shard, caplog):
    s = shard
    caplog.set_level(logging.INFO, logger="shoal.param_sync.service")
    boundary = ps_pb2.BoundaryRequest(job_id=JOB, learner_id=LEARNER)
    a = (await s.call("learner", "Boundary", boundary)).assignment
    lane = await s.call("learner", "OpenSharedLane", lane_request())
    segment, control = await take_with_control(lane)
    await async_wait_until(
        lambda: s.servicer._lanes[(JOB, LEARNER)].control is not None,
        timeout=30,
        what="the shard serving the lane's control",
    )
    lo, hi = lane.in_offset, lane.in_offset + lane.in_capacity

    def header(**fields: Any) -> ps_pb2.TensorBundleHeader:
        h = grad_header(a.generation, shared_memory=True, shared_memory_offset=lo)
        for name, value in fields.items():
            setattr(h, name, value)
        return h

    async def refused(h: ps_pb2.TensorBundleHeader) -> aio.AioRpcError:
        with pytest.raises(aio.AioRpcError) as info:
            await control.sync_step(encode_header(ps_pb2.SyncStepRequest, h))
        assert not control.closed  # a refusal leaves the connection open
        return info.value

    # Refused exactly as gRPC refuses the same header (code, details, trailers).
    for why, fields in {
        "past the in-region": {"shared_memory_offset": hi - 8},
        "into the out-region": {"shared_memory_offset": lane.out_offset},
        "another iteration": {"iteration": 7},
        "another generation": {"generation": a.generation + 5},
        "a negative sample count": {"num_samples": -1},
    }.items():
        h = header(**fields)
        over_control = await refused(h)
        with pytest.raises(aio.AioRpcError) as info:
            await s.sync("learner", h, [])
        over_grpc = info.value
        assert over_control.code() == over_grpc.code(), why
        assert over_control.details() == over_grpc.details(), why
        assert decode_rpc_error(over_control) == decode_rpc_error(over_grpc), why
    # It speaks for its lane only: not for another learner of the job, not for another job.
    for fields in ({"sender_id": f"{JOB}-l2"}, {"job_id": OTHER, "sender_id": f"{OTHER}-l1"}):
        exc = await refused(header(**fields))
        assert exc.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "speaks for it only" in exc.details()
    # Not without the lane, not with a bad identifier, not with bytes that do not parse.
    exc = await refused(header(shared_memory=False, shared_memory_offset=0))
    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "header.shared_memory" in exc.details()
    exc = await refused(header(sender_id="no such/learner"))
    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sender_id ('no such/learner')" in exc.details()
    with pytest.raises(aio.AioRpcError) as info:
        await control.sync_step(b"\xff\xff\xff")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not parse" in (info.value.details() or "")
    assert await s.completed() == 0  # nothing changed

    # Its Boundaries too (this shard runs the job's coordinator): the same answer as gRPC's,
    # and for its own learner only.
    assert (await control.boundary(boundary)).assignment == a
    for request in (
        ps_pb2.BoundaryRequest(job_id=JOB, learner_id=f"{JOB}-l2"),
        ps_pb2.BoundaryRequest(job_id=OTHER, learner_id=f"{OTHER}-l1"),
    ):
        with pytest.raises(aio.AioRpcError) as info:
            await control.boundary(request)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "speaks for it only" in (info.value.details() or "")
    assert await s.completed() == 0 and control.calls == 1

    # The round through the control, its next Boundary sent ahead beside it on the same
    # connection (held until the commit): exactly the gRPC round's update, then the answer
    # to the Boundary.
    g = torch.tensor([[1.0, -2.0], [0.5, 4.0], [3.0, 0.0], [-1.0, 2.0]])
    segment.region(lo, TOTAL, lo=lo, hi=hi, what="bundle")[:] = byte_view(g).tobytes()
    ahead = ps_pb2.BoundaryRequest(
        job_id=JOB,
        learner_id=LEARNER,
        generation=a.generation,
        completed_iteration=a.global_iteration,
        loss_sum=1.5,
        num_samples=4,
        ahead=True,
    )
    next_one = asyncio.ensure_future(control.boundary(ahead))
    frame = await control.sync_step(encode_header(ps_pb2.SyncStepRequest, header()))
    assert frame.header is not None and frame.header.shared_memory
    torch.testing.assert_close(read_answer([frame], segment, lane), W0 - LR * g, atol=0, rtol=0)
    reply = await asyncio.wait_for(next_one, 30)  # (the job has one iteration: it is done)
    assert reply.action == ps_pb2.BOUNDARY_ACTION_DONE and reply.completed_iterations == 1
    assert await s.completed() == 1 and control.calls == 3

    # The lane goes with the job, and its control with it: the learner sees it closed.
    await s.call("service", "CloseJob", ps_pb2.CloseJobRequest(job_id=JOB))
    with pytest.raises(LaneError, match="control connection"):
        await control.sync_step(encode_header(ps_pb2.SyncStepRequest, header()))
    assert control.closed
    await async_wait_until(
        lambda: "control of learner job-a-l1's lane closed after" in caplog.text,
        timeout=30,
        what="the control closed",
    )
    segment.close()


async def test_a_control_only_lane_carries_boundaries_and_nothing_else(shard: Shard):
    """A collective-mode learner's lane (``control_only``): no tensor region, its control
    connection carries its Boundaries as gRPC would, a SyncStep on it moves nothing, and only
    the shard that coordinates the job opens one."""
    s = shard
    reply = await s.call(
        "stranger",
        "OpenSharedLane",
        lane_request(f"{STRANGER}-l1", job_id=STRANGER, control_only=True),
    )
    assert reply.refused == f"shard 0 does not coordinate job {STRANGER!r}"
    assert not s.servicer._lanes and s.servicer._handoff.offers == 0

    lane = await s.call("learner", "OpenSharedLane", lane_request(control_only=True))
    assert not lane.refused and not lane.answer_token  # no answer segment either
    assert (lane.in_offset, lane.in_capacity, lane.out_offset) == (lane.size, 0, lane.size)
    assert lane.size == 64  # the nonce only
    segment, control = await take_with_control(lane)
    await async_wait_until(
        lambda: s.servicer._lanes[(JOB, LEARNER)].control is not None,
        timeout=30,
        what="the shard serving the lane's control",
    )
    boundary = ps_pb2.BoundaryRequest(job_id=JOB, learner_id=LEARNER)
    over_grpc = await s.call("learner", "Boundary", boundary)
    assert (await control.boundary(boundary)).assignment == over_grpc.assignment
    with pytest.raises(aio.AioRpcError) as info:
        await control.boundary(ps_pb2.BoundaryRequest(job_id=JOB, learner_id=f"{JOB}-l2"))
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED

    # A SyncStep through it finds no room for a single byte: refused, nothing changes.
    h = grad_header(
        over_grpc.assignment.generation, shared_memory=True, shared_memory_offset=lane.in_offset
    )
    with pytest.raises(aio.AioRpcError) as info:
        await control.sync_step(encode_header(ps_pb2.SyncStepRequest, h))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "header.shared_memory_offset" in (info.value.details() or "")
    assert not control.closed and await s.completed() == 0

    # The learner's end (grpc_lane.open_lane) takes it as such.
    stub = ps_grpc.ParameterSyncServiceStub(s.channel)
    mine = await open_lane(
        stub,
        job_id=JOB,
        learner_id=LEARNER,
        metadata=s.md("learner"),
        address=s.server.address,
        control_only=True,
    )
    # (held for the trainer's thread, which blocks on it: here a thread beside this loop)
    assert mine is not None and mine.direct is not None and mine.control is None
    assert mine.answers is None
    answer = await asyncio.to_thread(mine.direct.boundary, boundary, wait_s=30)
    assert answer.assignment == over_grpc.assignment
    mine.close()
    control.close()
    segment.close()
