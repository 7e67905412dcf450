"""What a shard does with the sums it holds when a coordinator tells it where the job's
coordinator is (SetCoordinator), on the servicer's local path and the pure rule
(``shoal.param_sync.takeover.pending_on_move``), without servers.

The regression of issue 12's livelock: after a takeover, the new coordinator's deposer reached
the restarted old coordinator's shard once that shard's slice had been restored from its
replica and an iteration was running; the shard dropped the running iteration's sums and raised
its generation floor above it, without the coordinator knowing. Every SyncStep of that
iteration was then refused as stale at once, the coordinator re-issued it unchanged, and the
learners looped ~50 times a second for ever."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from shoal.contract.wire import TensorMeta, byte_view, pack_layout
from shoal.param_sync.coordinator import OptimizerConfig
from shoal.param_sync.service import ParameterSyncServicer, ShardOptions
from shoal.param_sync.servicer_common import _ShardSlice
from shoal.param_sync.shard import Contribution, ShardJob
from shoal.param_sync.takeover import PendingAction, pending_on_move
from shoal.runtime.errors import Aborted, JobNotFound, StaleGeneration, Unavailable
from shoal.v1 import parameter_sync_service_pb2 as ps_pb2

JOB = "job-0123456789ab"
SHARD_0 = "127.0.0.1:7300"  # the successor coordinator
EPOCH = 1
FLOOR = EPOCH << 32  # the successor's first generation
METAS = [TensorMeta("w", "float32", (4, 3), 0, 48), TensorMeta("b", "float32", (4,), 0, 16)]


@pytest.mark.parametrize(
    ("pending", "keep", "expected"),
    [
        (None, False, PendingAction.NONE),
        (None, True, PendingAction.NONE),
        (FLOOR + 3, True, PendingAction.KEEP_FOR_SUCCESSOR),  # TakeOverJob resolves them
        (FLOOR - 1, False, PendingAction.ABORT),  # an older coordinator's, never committed
        (FLOOR, False, PendingAction.KEEP),  # the telling coordinator's own iteration
        (FLOOR + 3, False, PendingAction.KEEP),
    ],
)
def test_only_sums_of_an_older_coordinators_generation_are_dropped(pending, keep, expected):
    assert pending_on_move(pending, keep=keep, min_generation=FLOOR) is expected


def _slice(servicer: ParameterSyncServicer) -> ShardJob:
    layout, _ = pack_layout(METAS)
    sj = ShardJob(JOB, 1, layout, OptimizerConfig("SGD", '{"lr": 0.1}'), active_shards=2)
    sj.coordinator_address = SHARD_0
    sj.initialized = True  # as restored from its replica (load_state_bytes)
    sj.completed = 840
    servicer._slices[JOB] = _ShardSlice(sj)
    return sj


def _contribution(sj: ShardJob, learner: str, generation: int) -> Contribution:
    metas, total = pack_layout(list(sj.metas))
    flat = bytearray(total)
    for m in metas:
        flat[m.offset : m.end] = byte_view(torch.ones(m.shape)).tobytes()
    c = Contribution(learner, generation, sj.completed, 8, 4.0, 0.0, list(enumerate(metas)), total)
    c.chunks.append(memoryview(bytes(flat)))
    return c


def _move(epoch: int, min_generation: int) -> ps_pb2.SetCoordinatorRequest:
    return ps_pb2.SetCoordinatorRequest(
        job_id=JOB,
        coordinator_address=SHARD_0,
        coordinator_epoch=epoch,
        min_generation=min_generation,
    )


async def test_a_repeated_set_coordinator_keeps_the_running_iterations_sums(tmp_path: Path):
    servicer = ParameterSyncServicer(ShardOptions(shard_index=1, storage_uri=tmp_path.as_uri()))
    try:
        # The recovery points the restarted shard at the successor, then restores its slice.
        await servicer._local_SetCoordinator(_move(EPOCH, FLOOR))
        sj = _slice(servicer)
        running = FLOOR + 2  # the successor's generation after the restore
        members = frozenset({"l1", "l2"})
        assert not sj.accumulate(_contribution(sj, "l1", running), members)
        waiter = asyncio.get_running_loop().create_future()
        servicer._slices[JOB].futures[(running, sj.completed)] = waiter
        # The deposer's SetCoordinator arrives now (same coordinator, same epoch, its
        # generation as it was when the call was made).
        reply = await servicer._local_SetCoordinator(_move(EPOCH, FLOOR + 1))
        assert reply.completed_iterations == 840
        assert sj.pending is not None and (sj.pending.generation, sj.pending.iteration) == (
            running,
            840,
        )
        assert sj.min_generation <= running
        sj.check_iteration(running, 840)  # the next contribution is taken, not refused
        assert sj.accumulate(_contribution(sj, "l2", running), members)  # and completes it
        assert not waiter.done()  # the learner waiting for the commit still waits for it
    finally:
        await servicer.close()


async def test_a_real_move_drops_an_older_coordinators_sums_and_aborts_its_waiters(
    tmp_path: Path,
):
    servicer = ParameterSyncServicer(ShardOptions(shard_index=1, storage_uri=tmp_path.as_uri()))
    try:
        sj = _slice(servicer)
        old = 7  # a generation of the coordinator at epoch 0
        assert not sj.accumulate(_contribution(sj, "l1", old), frozenset({"l1", "l2"}))
        waiter = asyncio.get_running_loop().create_future()
        servicer._slices[JOB].futures[(old, sj.completed)] = waiter
        await servicer._local_SetCoordinator(_move(EPOCH, FLOOR))
        assert sj.pending is None
        assert sj.min_generation == FLOOR
        with pytest.raises(StaleGeneration):
            sj.check_iteration(old, 840)
        assert isinstance(waiter.exception(), Aborted)
    finally:
        await servicer.close()


async def test_a_job_being_taken_over_is_unavailable_not_unknown_until_it_is_coordinated(
    tmp_path: Path,
):
    """TakeOverJob tells the shards (itself included) that this shard coordinates the job
    before it has read the job's bookkeeping: a learner that follows the move at once (its
    FindCoordinator names this shard) must be told to retry, not that the job is unknown,
    which it takes as fatal (seen in CI: a collective learner exited on "job not found")."""
    servicer = ParameterSyncServicer(ShardOptions(shard_index=1, storage_uri=tmp_path.as_uri()))
    try:
        with servicer._taking_over_job(JOB):
            with pytest.raises(Unavailable, match="taking over as its coordinator"):
                servicer._job(JOB)
        with pytest.raises(JobNotFound):  # after it (the takeover failed): unknown again
            servicer._job(JOB)
    finally:
        await servicer.close()
