"""SetGlobalBatch over gRPC (the opt-in adaptive batch, issue 17): two shard servers in this
process with auth, driven by a hand-written learner (tests/integration/test_param_sync.py's
harness). Bad calls get their status and change nothing; a good one changes the batch at the
next boundary, with positions kept in samples, and is stored for a successor coordinator."""

from __future__ import annotations

import asyncio
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


async def open_adaptive(
    c: Cluster, job: str, epochs: int = 2, rule: int = job_pb2.BATCH_SCALING_RULE_LINEAR
) -> None:
    spec = job_pb2.JobSpec(
        batch_size=4,
        epochs=epochs,
        seed=1,
        adaptive_batch=job_pb2.AdaptiveBatch(min_global_batch=2, max_global_batch=6, rule=rule),
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


async def test_the_noise_scale_is_measured_reported_and_frozen_into_each_assignment(
    cluster: Cluster,
) -> None:
    """Two learners of an ADASCALE job over gRPC: the shards compute the global norm without
    clipping (OptimizerSpec.measure_grad_norm), the learners' estimates travel in the Boundary
    metrics, GetJobProgress reports the smoothed noise scale, and once it averages
    MIN_SAMPLES iterations every member's Assignment carries the same value."""
    from shoal.contract import user_metrics
    from shoal.contract.noise_scale import MIN_SAMPLES
    from tests.integration.test_param_sync import LAYOUT

    c = cluster
    await open_adaptive(c, "gns", epochs=1, rule=job_pb2.BATCH_SCALING_RULE_ADASCALE)
    learners = ["l1", "l2"]
    for x in learners:
        request = ps_pb2.JoinRequest(
            job_id="gns",
            learner_id=x,
            layout=[m.to_proto() for m in LAYOUT],
            optimizer=ps_pb2.OptimizerSpec(
                name="SGD", hyperparameters_json='{"lr": 0.5}', measure_grad_norm=True
            ),
            dataset_size=64,  # 16 iterations of 4
        )
        reply = await c.call("Join", request)
        for s in reply.shards:
            for name in s.tensor_names:
                c.slices[name] = s.shard_index
    await c.upload("gns", "l1", initial())
    buffers = {k: v for k, v in initial().items() if k.startswith("bn.")}
    answers = {x: (await c.boundary("gns", x)).assignment for x in learners}
    metrics = {
        "l1": {user_metrics.GNS_GRAD_SQ: 1.0, user_metrics.GNS_TRACE: 10.0},
        "l2": {user_metrics.GNS_GRAD_SQ: 3.0, user_metrics.GNS_TRACE: 90.0},
    }
    frozen: list[set[float]] = []
    for k in range(MIN_SAMPLES + 2):
        frozen.append({answers[x].gradient_noise_scale for x in learners})
        assert {answers[x].global_iteration for x in learners} == {k}
        results = await asyncio.gather(
            *(
                contribute(c, "gns", x, answers[x], grads(k + i), buffers, n=2)
                for i, x in enumerate(learners)
            )
        )
        # Every shard's answer carries the global gradient's norm, measured without clipping.
        norms = {header.grad_norm for per_learner in results for header, _ in per_learner}
        assert len(norms) == 1 and norms.pop() > 0
        replies = await asyncio.gather(
            *(
                c.call(
                    "Boundary",
                    ps_pb2.BoundaryRequest(
                        job_id="gns",
                        learner_id=x,
                        generation=answers[x].generation,
                        completed_iteration=k,
                        loss_sum=1.0,
                        num_samples=2,
                        metric_sums={n: v * 2 for n, v in metrics[x].items()},
                        metric_samples={n: 2 for n in metrics[x]},
                    ),
                )
                for x in learners
            )
        )
        answers = {x: r.assignment for x, r in zip(learners, replies, strict=True)}
    # Each iteration's members got one value; 0 until MIN_SAMPLES iterations were averaged.
    assert all(len(values) == 1 for values in frozen), frozen
    values = [v.pop() for v in frozen]
    assert values[: MIN_SAMPLES + 1] == [0.0] * (MIN_SAMPLES + 1)
    assert values[-1] == pytest.approx(25.0)  # sample-weighted |G|^2 2, tr 50
    progress = (await c.call("GetJobProgress", ps_pb2.GetJobProgressRequest(job_id="gns"))).progress
    assert progress.gradient_noise_scale == pytest.approx(25.0)
    assert progress.gradient_noise_samples >= MIN_SAMPLES
