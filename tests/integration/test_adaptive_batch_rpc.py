"""SetGlobalBatch over gRPC (the opt-in adaptive batch, issue 17): two shard servers in this
process with auth, driven by a hand-written learner (tests/integration/test_param_sync.py's
harness). Bad calls get their status and change nothing; a good one changes the batch at the
next boundary, with positions kept in samples, and is stored for a successor coordinator."""

from __future__ import annotations

import json

import grpc
import pytest
from grpc import aio

from shoal.param_sync import checkpoint as ckpt
from shoal.v1 import job_pb2, parameter_sync_service_pb2 as ps_pb2
from tests.integration.test_param_sync import (
    Cluster,
    cluster,
    contribute,
    grads,
    initial,
    started,
)

__all__ = ["cluster"]  # the fixture, shared with test_param_sync.py


async def open_adaptive(c: Cluster, job: str) -> None:
    spec = job_pb2.JobSpec(
        batch_size=4,
        epochs=2,
        seed=1,
        adaptive_batch=job_pb2.AdaptiveBatch(
            min_global_batch=2, max_global_batch=6, rule=job_pb2.BATCH_SCALING_RULE_LINEAR
        ),
    )
    request = ps_pb2.OpenJobRequest(job_id=job, spec=spec, shard_addresses=c.addresses)
    await c.call("OpenJob", request, role="service")


async def code_of(coro) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(aio.AioRpcError) as info:
        await coro
    return info.value.code(), info.value.details()


async def test_set_global_batch_refuses_bad_calls_and_changes_the_batch_at_the_next_boundary(
    cluster: Cluster,
) -> None:
    c = cluster
    # A job without an adaptive batch keeps its batch: the call is refused.
    await started(c, "fixed", ["f1"], batch=4)
    code, text = await code_of(
        c.call("SetGlobalBatch", ps_pb2.SetGlobalBatchRequest(job_id="fixed", global_batch=2))
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "no adaptive batch" in text, text

    await open_adaptive(c, "ada")
    assert (await c.join("ada", "l1")).initialize
    await c.upload("ada", "l1", initial())
    first = (await c.boundary("ada", "l1")).assignment
    assert (first.global_batch, first.batch_start, first.batch_samples) == (4, 0, 4)

    def set_batch(batch: int, role: str = "service"):
        request = ps_pb2.SetGlobalBatchRequest(job_id="ada", global_batch=batch)
        return c.call("SetGlobalBatch", request, role=role)

    for bad in (0, 1, 7):
        code, text = await code_of(set_batch(bad))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (bad, code)
        assert f"global_batch ({bad})" in text and "[2, 6]" in text, text
    code, _ = await code_of(set_batch(2, role="user"))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    code, _ = await code_of(
        c.call("SetGlobalBatch", ps_pb2.SetGlobalBatchRequest(job_id="nope", global_batch=2))
    )
    assert code == grpc.StatusCode.NOT_FOUND

    # A good call: the running iteration keeps its batch; the next one has 6 samples from
    # position 4 (where the batch of 4 left off), the epoch's last 2 positions then.
    reply = await set_batch(6)
    assert reply.current_global_batch == 4
    buffers = {k: v for k, v in initial().items() if k.startswith("bn.")}
    await contribute(c, "ada", "l1", first, grads(1), buffers, n=4)
    nxt = await c.boundary("ada", "l1", generation=first.generation, completed=0, n=4)
    assert nxt.action == ps_pb2.BOUNDARY_ACTION_RUN
    a = nxt.assignment
    # dataset_size 8 (the harness's): positions [4, 8) are left of epoch 0.
    assert (a.global_iteration, a.epoch, a.iteration) == (1, 0, 1)
    assert (a.global_batch, a.batch_start, a.batch_samples) == (6, 4, 4)
    assert (a.sample_start, a.sample_end) == (4, 8)
    progress = await c.call("GetJobProgress", ps_pb2.GetJobProgressRequest(job_id="ada"))
    assert progress.progress.global_batch == 6

    # Stored before the iteration ran at it, for a successor coordinator.
    stored = ckpt.read_bytes(ckpt.job_uri(c.storage_uri, "ada", "batch_schedule.json"))
    assert stored is not None
    assert json.loads(stored)["segments"] == [[0, 0, 0, 0, 4], [1, 0, 1, 4, 6]]
