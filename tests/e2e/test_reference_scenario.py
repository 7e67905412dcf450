"""The reference scenario end to end on the embedded local cluster: real etcd, every service
as a real process (leader + standby for the scheduler and the resource manager, two
parameter-sync shards, two host agents with 4 simulated GPUs each), real PyTorch learners on
the digits example.

Asserted: every allocation step (8 -> 4/4 -> 5/3 -> job 1 done -> 8), that job 1 lost no
completed iteration when it shrank (its iteration record is contiguous, each iteration once),
that both jobs converge (the loss of the last epoch is below LOSS_BOUND, a bound the digits
MLP passes in a few epochs from an initial loss of about 2.3 = ln 10), and, last, that after a
host agent is SIGKILLed mid-training the affected job continues on the surviving host and
completes.

The cluster runs with mutual TLS on every hop (``ClusterSpec(tls=True)``, what ``shoal cluster
up --tls`` starts): client -> services, service -> service, services -> etcd (etcd itself on
TLS), learners -> parameter-sync, each with its own certificate and the learners with their
own credentials. It is the one e2e run with TLS; tests/e2e/test_local_cluster_cli.py covers
the plaintext cluster, so both paths are exercised without a second run of this scenario.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from shoal.client import Client, ShoalClientError
from shoal.cluster.local import ClusterSpec, LocalCluster
from shoal.cluster.scenario import run_scenario
from shoal.v1 import job_pb2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
LOSS_BOUND = 0.6


def assert_iterations_contiguous(metrics, job: job_pb2.Job) -> None:
    per_epoch = job.progress.iterations_per_epoch
    seen = [m.epoch * per_epoch + m.iteration for m in metrics.iterations]
    assert seen == sorted(seen), "iterations recorded out of order"
    assert len(seen) == len(set(seen)), "an iteration was recorded twice"
    assert seen == list(range(job.spec.epochs * per_epoch)), "an iteration is missing"


def last_epoch_loss(metrics, job: job_pb2.Job) -> float:
    last = [m.loss for m in metrics.iterations if m.epoch == job.spec.epochs - 1]
    return sum(last) / len(last)


def assert_plaintext_is_refused(cluster: LocalCluster) -> None:
    """Nothing answers without TLS and the cluster's certificates: a client without them is
    told so in one line."""
    plain = dataclasses.replace(cluster.client_config(), tls_ca=None, tls_cert=None, tls_key=None)
    with Client(plain, timeout=5, retries=0) as client:
        with pytest.raises(ShoalClientError) as caught:
            client.get_job("job-1")
    assert caught.value.message.startswith("TLS: "), caught.value.message


def test_reference_scenario_end_to_end(tmp_path):
    spec = ClusterSpec(
        state_dir=tmp_path / "cluster",
        hosts=2,
        gpus_per_host=4,
        shards=2,
        heartbeat_interval_s=0.3,
        host_lost_after_s=2.0,
        election_ttl_s=3.0,
        tls=True,
    )
    with LocalCluster(spec) as cluster, Client(cluster.client_config()) as client:
        assert all(u.startswith("https://") for u in cluster.etcd.client_urls)  # etcd on TLS
        assert_plaintext_is_refused(cluster)
        lines: list[str] = []
        result = run_scenario(
            client,
            ROOT / "examples" / "digits",
            capacity=8,
            job1_epochs=int(os.environ.get("SHOAL_E2E_JOB1_EPOCHS", "12")),
            job2_epochs=int(os.environ.get("SHOAL_E2E_JOB2_EPOCHS", "30")),
            kill_host=lambda: (cluster.kill("host-2"), "host-2")[1],
            log=lines.append,
        )
        names = [name for name, _, _ in result.steps]
        assert len(names) == 5, lines
        assert result.steps[1][2] == {result.job1: 4, result.job2: 4}
        assert result.steps[2][2] == {result.job1: 3, result.job2: 5}
        assert result.steps[0][2] == {result.job1: 8}
        assert result.steps[3][2] == {result.job2: 8}
        assert 0 < result.steps[4][2][result.job2] <= 4

        for job_id in (result.job1, result.job2):
            job = client.get_job(job_id)
            assert job.state == job_pb2.JOB_STATE_COMPLETED, job.state_reason
            metrics = client.get_metrics(job_id)
            assert_iterations_contiguous(metrics, job)
            assert last_epoch_loss(metrics, job) < LOSS_BOUND
        history = client.allocation_history(result.job1)
        assert [e.workers for e in history][:1] == [8]
        assert any(e.workers == 3 for e in history)
        size = client.download_model(result.job2, tmp_path / "model.safetensors")
        assert size > 0
    for svc in cluster.services.values():
        assert not svc.alive(), f"{svc.name} outlived the cluster"
