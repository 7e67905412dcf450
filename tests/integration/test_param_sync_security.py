"""The parameter-sync attacks of issue 13, replayed against a shard in this process (real gRPC,
auth on): a user or a learner of another job reading, writing or joining a job, a learner
speaking for another learner, a job id that climbs out of storage, and a storage URI the
operator did not configure. Every one is refused and changes nothing; the job's own learner
and its owner keep doing what they may."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc import aio

from shoal.contract.wire import TensorMeta, pack_layout
from shoal.param_sync.service import ParameterSyncServicer
from shoal.runtime.auth import LearnerTokenSigner
from shoal.runtime.server import RunningServer
from shoal.v1 import (
    job_pb2,
    parameter_sync_service_pb2 as ps_pb2,
    parameter_sync_service_pb2_grpc as ps_grpc,
)
from tests.integration.shard_bed import start_shard
from tests.support import make_tokens

JOB = "job-5e1f0a2b3c4d"
LAYOUT, _ = pack_layout([TensorMeta("w", "float32", (4, 2), 0, 32)])


@dataclass
class Shard:
    server: RunningServer
    servicer: ParameterSyncServicer
    tokens: dict[str, str]
    storage: Path
    channels: list[aio.Channel]

    def stub(self, who: str) -> ps_grpc.ParameterSyncServiceStub:
        channel = aio.insecure_channel(self.server.address)
        self.channels.append(channel)
        return ps_grpc.ParameterSyncServiceStub(channel)

    def md(self, who: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.tokens[who]}"),)

    async def code(self, who: str, method: str, request: Any) -> grpc.StatusCode:
        try:
            await getattr(self.stub(who), method)(request, metadata=self.md(who), timeout=30)
            return grpc.StatusCode.OK
        except aio.AioRpcError as exc:
            return exc.code()

    def state(self) -> Any:
        job = self.servicer._coordinated.get(JOB)
        coord = job.coord if job else None
        files = sorted(str(p.relative_to(self.storage.parent)) for p in self.storage.rglob("*"))
        return (
            sorted(self.servicer._coordinated),
            coord.progress()["completed_iterations"] if coord else None,
            sorted(coord.members) if coord else None,
            (sorted(coord.ready), sorted(coord.known)) if coord else None,
            files,
        )


def join(learner: str, job: str = JOB) -> ps_pb2.JoinRequest:
    return ps_pb2.JoinRequest(
        job_id=job,
        learner_id=learner,
        layout=[m.to_proto() for m in LAYOUT],
        optimizer=ps_pb2.OptimizerSpec(name="SGD", hyperparameters_json='{"lr": 0.1}'),
        dataset_size=16,
    )


def open_job(job_id: str = JOB, **kw: Any) -> ps_pb2.OpenJobRequest:
    return ps_pb2.OpenJobRequest(
        job_id=job_id,
        spec=job_pb2.JobSpec(batch_size=4, epochs=1, seed=1),
        owner="alice",
        **kw,
    )


@pytest.fixture
async def shard(tmp_path: Path) -> AsyncIterator[Shard]:
    tokens = make_tokens(tmp_path / "tokens")
    signer = LearnerTokenSigner.generate()
    storage = tmp_path / "storage"
    bed = await start_shard(tmp_path / "tokens", tokens["service"], storage.as_uri(), signer=signer)
    server, servicer = bed.server, bed.servicer
    tokens = {
        **tokens,
        "alice": tokens["user"],
        "bob": tokens["other"],
        "learner": signer.mint(job_id=JOB, learner_id=f"{JOB}-l1"),
        "learner-of-k": signer.mint(job_id="job-k", learner_id="job-k-l1"),
    }
    s = Shard(server, servicer, tokens, storage, [])
    request = open_job(shard_addresses=[server.address])
    assert await s.code("service", "OpenJob", request) == grpc.StatusCode.OK
    yield s
    for channel in s.channels:
        await channel.close()
    await bed.stop()


async def test_nobody_but_the_jobs_learners_joins_reports_or_checkpoints_it(shard: Shard) -> None:
    assert await shard.code("learner", "Join", join(f"{JOB}-l1")) == grpc.StatusCode.OK
    before = shard.state()
    assert before[3] == ([f"{JOB}-l1"], [f"{JOB}-l1"])  # the learner the scheduler started
    metrics = ps_pb2.ReportEpochMetricsRequest(
        job_id=JOB, learner_id=f"{JOB}-l1", epoch=999, values={"accuracy": -1.0}
    )
    # A Boundary, the one sent beside a SyncStep too (held by the coordinator): only as itself.
    boundary = ps_pb2.BoundaryRequest(
        job_id=JOB, learner_id=f"{JOB}-l1", completed_iteration=0, ahead=True
    )
    others = ps_pb2.BoundaryRequest(
        job_id=JOB, learner_id=f"{JOB}-l2", completed_iteration=0, ahead=True
    )
    refused = [
        ("bob", "Boundary", boundary),
        ("alice", "Boundary", boundary),
        ("learner-of-k", "Boundary", boundary),
        ("learner", "Boundary", others),
        # a user, even the owner, is no learner
        ("bob", "Join", join("rogue")),
        ("alice", "Join", join("rogue")),
        ("bob", "ReportEpochMetrics", metrics),
        ("alice", "ReportEpochMetrics", metrics),
        ("bob", "CreateCheckpoint", ps_pb2.CreateCheckpointRequest(job_id=JOB)),
        ("bob", "GetJobProgress", ps_pb2.GetJobProgressRequest(job_id=JOB)),
        ("bob", "GetMembership", ps_pb2.GetMembershipRequest(job_id=JOB, generation=1)),
        # a learner of another job, as itself or as one of this job's learners
        ("learner-of-k", "Join", join("job-k-l1")),
        ("learner-of-k", "Join", join(f"{JOB}-l2")),
        ("learner-of-k", "GetJobProgress", ps_pb2.GetJobProgressRequest(job_id=JOB)),
        ("learner-of-k", "ReportEpochMetrics", metrics),
        # this job's learner speaking for another, or doing what the scheduler does
        ("learner", "Join", join(f"{JOB}-l2")),
        (
            "learner",
            "ReportEpochMetrics",
            ps_pb2.ReportEpochMetricsRequest(job_id=JOB, learner_id=f"{JOB}-l2", epoch=0),
        ),
        ("learner", "EvictLearner", ps_pb2.EvictLearnerRequest(job_id=JOB, learner_id="x")),
        ("learner", "CloseJob", ps_pb2.CloseJobRequest(job_id=JOB)),
        ("learner", "OpenJob", open_job("job-new", shard_addresses=[shard.server.address])),
        ("alice", "CloseJob", ps_pb2.CloseJobRequest(job_id=JOB)),
    ]
    for who, method, request in refused:
        code = await shard.code(who, method, request)
        assert code == grpc.StatusCode.PERMISSION_DENIED, (who, method, code)
        assert shard.state() == before, (who, method)
    assert not (shard.storage / "jobs" / JOB / "metrics" / "epochs.jsonl").exists()
    # What each may do still works: the owner reads, the learner reports as itself.
    assert await shard.code(
        "alice", "GetJobProgress", ps_pb2.GetJobProgressRequest(job_id=JOB)
    ) == (grpc.StatusCode.OK)
    good = ps_pb2.ReportEpochMetricsRequest(job_id=JOB, learner_id=f"{JOB}-l1", epoch=0)
    assert await shard.code("learner", "ReportEpochMetrics", good) == grpc.StatusCode.OK
    assert (shard.storage / "jobs" / JOB / "metrics" / "epochs.jsonl").exists()


async def test_a_job_id_that_is_a_path_or_storage_the_operator_did_not_configure_is_refused(
    shard: Shard, tmp_path: Path
) -> None:
    target = tmp_path / "outside"
    before = shard.state()
    traversal = "../" * 8 + str(target).lstrip("/") + "/pwned"
    for job_id in (traversal, "/etc/pwned", "job\0x", "j\u043eb-1", "x" * 5000):
        request = open_job(job_id, shard_addresses=[shard.server.address])
        assert await shard.code("service", "OpenJob", request) == grpc.StatusCode.INVALID_ARGUMENT
        metrics = ps_pb2.ReportEpochMetricsRequest(job_id=job_id, learner_id="l", epoch=1)
        code = await shard.code("learner", "ReportEpochMetrics", metrics)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
    elsewhere = open_job(
        "job-elsewhere", shard_addresses=[shard.server.address], storage_uri=target.as_uri()
    )
    assert await shard.code("service", "OpenJob", elsewhere) == grpc.StatusCode.INVALID_ARGUMENT
    load = ps_pb2.LoadShardRequest(job_id=JOB, directory=target.as_uri())
    assert await shard.code("service", "LoadShard", load) == grpc.StatusCode.INVALID_ARGUMENT
    assert not target.exists()
    assert shard.state() == before
