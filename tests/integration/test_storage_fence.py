"""The storage fence (shoal.param_sync.holder) on a real in-process shard pair: a coordinator
marks the job's files as its own when it opens the job, and one whose mark another coordinator
took (as a TakeOverJob on another shard does while it is paused) writes no record, epoch
report, checkpoint or model after that, answers UNAVAILABLE, steps down and names the new
coordinator to whoever asks it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import grpc
import pytest
from grpc import aio

from shoal.param_sync import holder
from shoal.v1 import parameter_sync_service_pb2 as ps_pb2
from tests.integration.test_param_sync import (
    Cluster,
    cluster,
    contribute,
    grads,
    initial,
    started,
)
from tests.support import async_wait_until

__all__ = ["cluster"]  # test_param_sync.py's fixture: two in-process shards, shard 0 coordinates


def _records(job_dir: Path) -> list[int]:
    path = job_dir / "metrics" / "iterations.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line)["global_iteration"] for line in lines]


async def test_opening_a_job_marks_its_files_as_the_coordinators(cluster: Cluster, tmp_path: Path):
    c = cluster
    await started(c, "j", ["l1"], batch=4, epochs=1)
    mark = json.loads((tmp_path / "storage" / "jobs" / "j" / holder.HOLDER).read_text())
    assert mark["holder"] == c.servicers[0]._coordinated["j"].holder
    assert (mark["shard"], mark["epoch"]) == (0, 0)


async def test_a_coordinator_superseded_in_storage_writes_nothing_more_and_steps_down(
    cluster: Cluster, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    c = cluster
    job_dir = tmp_path / "storage" / "jobs" / "j"
    [a] = await started(c, "j", ["l1"], batch=4, epochs=1)  # 8 samples: 2 iterations
    buffers = {k: v for k, v in initial().items() if k.startswith("bn.")}
    await contribute(c, "j", "l1", a, grads(1), buffers, n=4, loss_sum=8.0)
    a = (await c.boundary("j", "l1", generation=1, completed=0, loss_sum=8.0, n=4)).assignment
    # (a RUN answer does not wait for the record's write: docs/data-plane.md)
    await async_wait_until(lambda: _records(job_dir) == [0], what="iteration 0 recorded")

    # Another shard takes the job over (its TakeOverJob marks the files) while this
    # coordinator is, say, paused; then this one goes on with the iteration it was running.
    holder.mark_holder(c.storage_uri, "j", "the-successor", shard=1, epoch=1)
    await contribute(c, "j", "l1", a, grads(2), buffers, n=4, loss_sum=4.0)
    with caplog.at_level(logging.WARNING, logger="shoal.param_sync.service"):
        with pytest.raises(aio.AioRpcError) as info:
            await c.boundary("j", "l1", generation=1, completed=1, loss_sum=4.0, n=4)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no longer coordinates job 'j'" in info.value.details()
    assert (
        "job j: its files name the coordinator on shard 1 (epoch 1) now; stepping down "
        "(epoch 0)" in caplog.text
    )

    # Nothing of the last iteration reached the job's files: its record, the final
    # checkpoint and the model are the successor's to write.
    assert _records(job_dir) == [0]
    assert not (job_dir / "model.safetensors").exists()
    assert not (job_dir / "checkpoints" / "latest").exists()
    assert "j" not in c.servicers[0]._coordinated
    # Asked where the coordinator is, the deposed shard names the one its files name (before
    # that one's SetCoordinator reaches it), not itself.
    found = await c.call("FindCoordinator", ps_pb2.FindCoordinatorRequest(job_id="j"))
    assert (found.coordinator_address, found.coordinator_epoch) == (c.addresses[1], 1)
    with pytest.raises(aio.AioRpcError):
        await c.call(
            "ReportEpochMetrics",
            ps_pb2.ReportEpochMetricsRequest(
                job_id="j", learner_id="l1", epoch=0, values={"accuracy": 0.5}
            ),
        )
    assert not (job_dir / "metrics" / "epochs.jsonl").exists()
    assert json.loads((job_dir / holder.HOLDER).read_text())["holder"] == "the-successor"
