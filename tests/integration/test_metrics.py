"""Every service's Prometheus endpoint on the embedded local cluster (real etcd, every service
a real process: resource-manager and job-scheduler as leader + standby, one parameter-sync
shard, one host agent with two simulated GPUs), scraped over HTTP while real state changes:
a digits job trains on two GPUs, shrinks to one, and is cancelled.

Asserted from the scrapes (parsed with prometheus_client's parser): the GPU gauges of the
resource-manager leader equal the allocations ListHosts shows, the heartbeat lag of the host is
there and below the grace, the job is counted in the right state, its iterations are counted
and its sync rounds timed by the shard, the shrink is timed by the scheduler leader, the host
agent counts its learners, exactly one replica of each elected service reports
``shoal_leader 1`` with at least one gain, and a standby reports no cluster-wide gauge.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shoal.client import Client
from shoal.cluster.local import ClusterSpec, LocalCluster
from shoal.cluster.scenario import job_spec
from shoal.v1 import job_pb2
from tests.support import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
HOST = "host-1"
LOST_AFTER_S = 3.0


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


class Scrape:
    """One scrape of one endpoint, as samples."""

    def __init__(self, url: str) -> None:
        with urllib.request.urlopen(url, timeout=5) as reply:
            assert reply.status == 200
            text = reply.read().decode()
        self.samples = [
            Sample(s.name, dict(s.labels), s.value)
            for family in text_string_to_metric_families(text)
            for s in family.samples
        ]

    def find(self, name: str, **labels: str) -> Iterator[Sample]:
        for s in self.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                yield s

    def value(self, name: str, **labels: str) -> float | None:
        found = list(self.find(name, **labels))
        assert len(found) <= 1, found
        return found[0].value if found else None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    spec = ClusterSpec(
        state_dir=tmp_path_factory.mktemp("metrics") / "cluster",
        hosts=1,
        gpus_per_host=2,
        shards=1,
        replicas=2,
        heartbeat_interval_s=0.3,
        host_lost_after_s=LOST_AFTER_S,
        election_ttl_s=3.0,
    )
    with LocalCluster(spec) as running:
        yield running


def scrape(cluster: LocalCluster, name: str) -> Scrape:
    return Scrape(cluster.metrics_urls()[name])


def leader(cluster: LocalCluster, kind: str) -> str:
    """The one process of ``kind`` that reports shoal_leader 1 (the others report 0)."""

    def check() -> str | None:
        values = {
            name: scrape(cluster, name).value("shoal_leader", election=kind)
            for name, svc in cluster.services.items()
            if svc.kind == kind
        }
        leaders = [name for name, value in values.items() if value == 1]
        others = [value for name, value in values.items() if name not in leaders]
        return leaders[0] if len(leaders) == 1 and others == [0] else None

    return wait_until(check, timeout=30, interval=0.2, what=f"one {kind} leader")


def standby(cluster: LocalCluster, kind: str, leader_name: str) -> str:
    return next(n for n, s in cluster.services.items() if s.kind == kind and n != leader_name)


def gpus(cluster: LocalCluster, rm: str) -> tuple[float | None, float | None, float | None]:
    s = scrape(cluster, rm)
    return tuple(s.value(f"shoal_gpus_{k}", host=HOST) for k in ("total", "allocated", "idle"))  # type: ignore[return-value]


def listed_allocations(client: Client) -> int:
    (host,) = [h for h in client.list_hosts() if h.host_id == HOST]
    return sum(1 for d in host.devices if d.HasField("allocation"))


def test_the_local_cluster_gives_every_process_a_metrics_url_in_its_state_file(cluster):
    urls = cluster.metrics_urls()
    assert set(urls) == set(cluster.services)
    assert len(set(urls.values())) == len(urls)
    state = json.loads((cluster.state_dir / "cluster.json").read_text())
    assert state["metrics"] == urls
    for name in urls:
        s = scrape(cluster, name)
        assert any(x.name == "process_cpu_seconds_total" for x in s.samples), name


def test_metrics_follow_the_cluster_state_through_a_job_that_shrinks(cluster):
    rm = leader(cluster, "resource-manager")
    scheduler = leader(cluster, "job-scheduler")
    for name in (rm, scheduler):
        kind = cluster.services[name].kind
        s = scrape(cluster, name)
        assert (s.value("shoal_leader_changes_total", election=kind, change="gained") or 0) >= 1
    rm_standby = standby(cluster, "resource-manager", rm)
    sched_standby = standby(cluster, "job-scheduler", scheduler)

    # The idle cluster: two free GPUs, a fresh heartbeat, no job.
    wait_until(lambda: gpus(cluster, rm) == (2, 0, 2), timeout=30, what="2 idle GPUs")
    lag = scrape(cluster, rm).value("shoal_host_heartbeat_lag_seconds", host=HOST)
    assert lag is not None and 0 <= lag < LOST_AFTER_S
    assert list(scrape(cluster, rm_standby).find("shoal_gpus_total")) == []
    assert list(scrape(cluster, rm_standby).find("shoal_host_heartbeat_lag_seconds")) == []
    assert scrape(cluster, scheduler).value("shoal_jobs", state="RUNNING") == 0
    assert list(scrape(cluster, sched_standby).find("shoal_jobs")) == []
    assert scrape(cluster, HOST).value("shoal_host_devices", host=HOST) == 2

    with Client(cluster.client_config()) as client:
        artifact = client.upload_directory(ROOT / "examples" / "digits")
        job = client.submit_job(
            job_spec("metrics", artifact, epochs=500, batch_size=64, max_workers=2)
        )
        job_id = job.job_id

        def training_at(size: int) -> bool:
            j = client.get_job(job_id)
            assert j.state not in (job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_CANCELLED), j
            return (
                j.state == job_pb2.JOB_STATE_RUNNING
                and j.progress.completed_iterations > 0
                and j.progress.world_size == size
            )

        wait_until(lambda: training_at(2), timeout=120, interval=0.2, what="training on 2")

        # Two learners: both GPUs allocated, as ListHosts shows them.
        wait_until(
            lambda: gpus(cluster, rm) == (2, 2, 0) and listed_allocations(client) == 2,
            timeout=30,
            what="2 allocated GPUs",
        )
        wait_until(
            lambda: scrape(cluster, scheduler).value("shoal_jobs", state="RUNNING") == 1,
            timeout=30,
            what="the job counted RUNNING",
        )
        agent = scrape(cluster, HOST)
        assert agent.value("shoal_host_learners", host=HOST, state="RUNNING") == 2
        shard = scrape(cluster, "parameter-sync-0")
        committed = shard.value("shoal_sync_iterations_committed_total", job_id=job_id) or 0
        assert committed > 0
        rounds = shard.value("shoal_sync_round_duration_seconds_count", job_id=job_id) or 0
        assert rounds > 0
        assert (shard.value("shoal_sync_round_duration_seconds_sum", job_id=job_id) or 0) > 0

        def committed_now() -> float:
            s = scrape(cluster, "parameter-sync-0")
            return s.value("shoal_sync_iterations_committed_total", job_id=job_id) or 0

        wait_until(lambda: committed_now() > committed, timeout=30, what="more iterations")

        # Shrink to one learner: the rescale is timed once the job runs at 1.
        def shrinks() -> float:
            s = scrape(cluster, scheduler)
            return s.value("shoal_rescale_duration_seconds_count", direction="shrink") or 0

        assert shrinks() == 0  # starting the job at 2 was no rescale
        client.update_job(job_id, max_workers=1)
        wait_until(lambda: shrinks() >= 1, timeout=60, interval=0.3, what="a timed shrink")
        s = scrape(cluster, scheduler)
        took = s.value("shoal_rescale_duration_seconds_sum", direction="shrink")
        assert took is not None and 0 < took < 60
        assert s.value("shoal_rescale_duration_seconds_count", direction="grow") is None
        assert client.get_job(job_id).progress.world_size == 1
        wait_until(
            lambda: gpus(cluster, rm) == (2, 1, 1) and listed_allocations(client) == 1,
            timeout=30,
            what="1 allocated + 1 idle GPU",
        )

        # Cancelled: the state moves, the GPUs come back.
        client.cancel_job(job_id)
        wait_until(
            lambda: scrape(cluster, scheduler).value("shoal_jobs", state="CANCELLED") == 1,
            timeout=60,
            interval=0.3,
            what="the job counted CANCELLED",
        )
        assert scrape(cluster, scheduler).value("shoal_jobs", state="RUNNING") == 0
        wait_until(lambda: gpus(cluster, rm) == (2, 0, 2), timeout=60, what="GPUs freed")
