"""The job-scheduler against the services it drives.

In process (fast): the real API core and reconcile loop over a MemoryStore, driving the gRPC
fakes of tests/integration/fakes.py (resource-manager, host agents with simulated GPUs,
parameter-sync shards): grow, shrink, priority changes, completion, host loss, failures,
cancel, logs, and a leader hand-over.

Real processes: two ``python -m shoal.scheduler`` replicas on a real etcd (leader + standby),
driving the same fakes over loopback: submit (retried with one request id), priority change,
cancel, and SIGKILL of the leader.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from shoal.contract.data_plane import (
    CoordinatorRecord,
    coordinator_key,
    decode_coordinator,
    encode_coordinator,
    is_legacy,
)
from shoal.runtime.auth import LearnerTokenSigner, LearnerTokenVerifier, Principal, Role
from shoal.runtime.channels import connect
from shoal.runtime.election import LeaderElection
from shoal.runtime.errors import LEADER_METADATA_KEY
from shoal.runtime.etcd_server import EtcdServer
from shoal.runtime.store import EtcdStore, MemoryStore, Store, StoreUnavailable
from shoal.scheduler.artifacts import ArtifactStore, Storage
from shoal.scheduler.health import HealthConfig
from shoal.scheduler.jobs import LearnerPhase
from shoal.scheduler.placement import PlacementConfig
from shoal.scheduler.policy import Policy
from shoal.scheduler.reconcile import (
    ELECTION,
    SHARD_REGISTRY,
    Peers,
    ReconcileConfig,
    Reconciler,
    coordinator_index,
)
from shoal.scheduler.service import JobApi
from shoal.scheduler.store import JobTable
from shoal.v1 import job_pb2, job_scheduler_service_pb2 as js, job_scheduler_service_pb2_grpc
from tests.integration.fakes import FakeCluster, chunked
from tests.support import async_wait_until, free_port, make_tokens

ALICE = Principal("alice", Role.USER)
SIGNER = LearnerTokenSigner.generate()


def mint(job_id: str, learner_id: str, start: str) -> str:
    return SIGNER.mint(job_id=job_id, learner_id=learner_id, start=start)


S = job_pb2


def spec(artifact_id: str, **overrides: object) -> job_pb2.JobSpec:
    s = job_pb2.JobSpec(
        name="mnist",
        entry_point="train.py",
        artifact_id=artifact_id,
        batch_size=64,
        epochs=3,
        seed=7,
        max_workers=8,
        max_batch_per_device=16,
    )
    s.dataset_uris.append("file:///data/mnist")
    s.env["MY_FLAG"] = "1"
    for key, value in overrides.items():
        setattr(s, key, value)
    return s


# ============================================================================================
# In process
# ============================================================================================


@dataclass
class Loop:
    cluster: FakeCluster
    store: Store
    table: JobTable
    reconciler: Reconciler
    api: JobApi
    artifact: str
    task: asyncio.Task[None]

    def job(self, job_id: str) -> job_pb2.Job:
        return self.table.records[job_id].public()

    def state(self, job_id: str) -> int:
        return self.table.records[job_id].state

    async def until(self, condition: Callable[[], object], what: str, timeout: float = 10):
        return await async_wait_until(condition, timeout=timeout, what=what)

    async def shares(self, expected: dict[str, int], what: str = "") -> None:
        def holds() -> bool:
            return all(self.cluster.workers(j) == n for j, n in expected.items()) and all(
                self.table.records[j].workers() == n for j, n in expected.items()
            )

        await self.until(holds, what or f"shares {expected}")


async def start_loop(
    store: Store,
    cluster: FakeCluster,
    storage: Storage,
    *,
    leadership: object = None,
    hold_time: float = 0.0,
    max_failures: int = 5,
    registry: bool = False,
    health: HealthConfig | None = None,
    incremental: bool = True,
) -> tuple[JobTable, Reconciler, JobApi, asyncio.Task[None]]:
    table = JobTable(store)
    peers = Peers([cluster.rm_address], cluster.shard_addresses, token=None)
    config = ReconcileConfig(
        sync_shards=() if registry else tuple(cluster.shard_addresses),
        placement=PlacementConfig(policy=Policy.PRIORITY, hold_time=hold_time),
        resync_interval_s=0.1,
        incremental_placement=incremental,
        stop_grace_s=0.5,
        finish_grace_s=0.5,
        max_learner_failures=max_failures,
        backoff_initial_s=0.05,
        backoff_max_s=0.5,
        agent_sweep_s=0.5,
        learner_credentials=mint,
        health=health or HealthConfig(unreachable_grace_s=0.5),
    )
    reconciler = Reconciler(table, peers, storage, config)
    api = JobApi(
        table, ArtifactStore(storage, max_bytes=1 << 20), trigger=reconciler.trigger, peers=peers
    )
    fence = getattr(leadership, "fence", None)
    await table.become_leader(fence)
    task = asyncio.create_task(reconciler.lead(leadership))  # type: ignore[arg-type]
    return table, reconciler, api, task


async def stop_task(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@pytest.fixture
async def loop(tmp_path: Path) -> AsyncIterator[Loop]:
    cluster = await FakeCluster.start(hosts=2, gpus=4, shards=2)
    store = MemoryStore()
    storage = Storage((tmp_path / "storage").as_uri())
    table, reconciler, api, task = await start_loop(store, cluster, storage)
    info = await api.artifacts.upload(
        name="model",
        declared_size=0,
        declared_sha256="",
        chunks=chunked(b"tarball" * 50),
        owner=ALICE,
    )
    yield Loop(cluster, store, table, reconciler, api, info.artifact_id, task)
    await stop_task(task)
    await reconciler.peers.close()
    await cluster.stop()
    await store.close()
    # Every test here runs the incremental path (the default: only the jobs that changed are
    # observed again, the incremental planner decides) with the full cycle as the safety net
    # every 0.1 s: the two never disagreed, neither the observed view nor the decisions
    # (observing.py and placing.py log and count it).
    placing = reconciler.placing
    assert placing.incremental_cycles > 0
    assert placing.divergences == 0, placing.last_divergence
    assert reconciler.observing.divergences == 0, reconciler.observing.last_divergence


async def test_the_reference_scenario_fairshare_priority_completion_and_host_loss(
    loop: Loop,
) -> None:
    c = loop.cluster
    # 1. Job 1 alone gets all 8 devices, packed, with the learner environment contract.
    j1 = (await loop.api.submit(ALICE, "r1", spec(loop.artifact))).job_id
    await loop.shares({j1: 8}, "job 1 on 8 learners")
    await loop.until(lambda: loop.state(j1) == S.JOB_STATE_RUNNING, "job 1 RUNNING")
    record = loop.table.records[j1]
    shard = coordinator_index(j1, 2)
    assert record.coordinator_address == c.shard_addresses[shard]
    assert c.sync.open_calls == [(shard, j1)]
    assert loop.job(j1).effective_sync_mode == S.SYNC_MODE_PARAMETER_SERVER  # simulated GPUs
    learner = c.running(j1)[0]
    env = dict(learner.request.env)
    assert env["SHOAL_JOB_ID"] == j1
    assert env["SHOAL_LEARNER_ID"] == learner.learner.learner_id
    assert env["SHOAL_SYNC_ENDPOINTS"] == ",".join(c.shard_addresses)
    assert env["SHOAL_COORDINATOR"] == c.shard_addresses[shard]
    assert env["SHOAL_STORAGE_URI"] == loop.api.storage.uri
    # The learner's own credential: for this learner of this job, verifiable without a store.
    credential = LearnerTokenVerifier({"k": SIGNER.public_key_raw}).verify(env["SHOAL_TOKEN"])
    assert credential is not None and credential.role is Role.LEARNER
    assert (credential.job_id, credential.learner_id) == (j1, learner.learner.learner_id)
    assert credential.start == learner.request.allocation_id
    assert (env["SHOAL_BATCH_SIZE"], env["SHOAL_EPOCHS"], env["SHOAL_SEED"]) == ("64", "3", "7")
    assert env["SHOAL_MAX_BATCH_PER_DEVICE"] == "16"
    assert env["SHOAL_SYNC_BACKEND"] == "parameter_server"
    assert env["SHOAL_DATASET_URIS"] == "file:///data/mnist"
    assert env["MY_FLAG"] == "1"
    assert learner.request.allocation_id in c.rm.ledger
    assert c.sync.jobs[j1].storage_uri == loop.api.storage.uri

    # 2. Job 2 at the same priority: 4 and 4; job 1's learners retire (exit 0), none evicted.
    j2 = (await loop.api.submit(ALICE, "r2", spec(loop.artifact))).job_id
    await loop.shares({j1: 4, j2: 4}, "fairshare 4/4")
    assert c.sync.jobs[j1].evicted == []
    exited = [fl.learner for a in c.agents.values() for fl in a.learners.values() if not fl.running]
    assert len(exited) == 4 and all(e.exit_code == 0 for e in exited)

    # 3. Job 2's priority 5000 -> 10000: 10000/15000 of 8 -> 5, and 3 for job 1.
    await loop.api.update(ALICE, j2, priority=10000, max_workers=None, request_id="u1")
    await loop.shares({j1: 3, j2: 5}, "priority shares 3/5")
    assert loop.job(j2).target_workers == 5 and loop.job(j1).target_workers == 3

    # 4. Job 1 finishes: COMPLETED, its data plane closed, and job 2 grows to 8.
    c.sync.finish(j1)
    await loop.until(lambda: loop.state(j1) == S.JOB_STATE_COMPLETED, "job 1 completed")
    await loop.shares({j2: 8}, "job 2 on 8")
    await loop.until(lambda: c.sync.jobs[j1].closed, "job 1 closed")
    assert c.rm.allocations_of(j1) == []

    # 5. A host dies: job 2 goes on with the other host's learners (evicted, not failed),
    # then grows back when the host returns as a new incarnation.
    progress = c.sync.jobs[j2].progress.completed_iterations
    c.lose_host("h2")
    await loop.shares({j2: 4}, "job 2 on the surviving host")
    assert loop.state(j2) == S.JOB_STATE_RUNNING
    assert len(c.sync.jobs[j2].evicted) == 4
    await loop.until(
        lambda: c.sync.jobs[j2].progress.completed_iterations > progress + 3, "progress goes on"
    )
    lost_agent = loop.reconciler.inventory.hosts["h2"].agent_address
    old_channel = loop.reconciler.peers.channel(lost_agent)
    await c.add_host("h2", 4)
    await loop.shares({j2: 8}, "job 2 back on 8")
    assert loop.table.records[j2].failures == 0
    # The agent that came back is called on a fresh channel (none left in reconnect backoff).
    assert old_channel not in loop.reconciler.peers._channels.values()

    async def recorded_back_at_8() -> list[job_pb2.AllocationEvent] | None:
        events = await loop.api.allocation_history(ALICE, j2)
        return events if events and events[-1].workers == 8 else None

    history = await loop.until(recorded_back_at_8, "allocation event back at 8")
    steps = [e.workers for e in history]
    assert 4 in steps and 5 in steps
    assert any("host h2 lost" in e.reason for e in history)
    times = [(e.time.seconds, e.time.nanos) for e in history]
    assert times == sorted(times)


async def test_cancel_stops_the_learners_frees_the_devices_and_closes_the_job(loop: Loop) -> None:
    c = loop.cluster
    j = (await loop.api.submit(ALICE, "", spec(loop.artifact, max_workers=6))).job_id
    await loop.shares({j: 6})
    # The learners run before the worker writes RUNNING: a cancel in between is of a QUEUED
    # job, CANCELLED at once.
    await loop.until(lambda: loop.state(j) == S.JOB_STATE_RUNNING, "running")
    job = await loop.api.cancel(ALICE, j, "c1")
    assert job.state == S.JOB_STATE_CANCELLING
    await loop.until(lambda: loop.state(j) == S.JOB_STATE_CANCELLED, "cancelled")
    assert c.workers(j) == 0
    assert c.rm.allocations_of(j) == []
    assert not loop.table.records[j].learners
    await loop.until(lambda: c.sync.jobs[j].closed, "closed")
    assert loop.job(j).allocated_workers == 0


async def test_a_queued_job_waits_in_priority_order_and_runs_when_devices_free(
    loop: Loop,
) -> None:
    big = (await loop.api.submit(ALICE, "", spec(loop.artifact, min_workers=8))).job_id
    await loop.shares({big: 8})
    low = (
        await loop.api.submit(ALICE, "", spec(loop.artifact, min_workers=2, priority=100))
    ).job_id
    high = (
        await loop.api.submit(ALICE, "", spec(loop.artifact, min_workers=2, priority=200))
    ).job_id
    await loop.until(lambda: loop.job(low).queue_position == 2, "queue positions")
    assert loop.job(high).queue_position == 1
    assert loop.state(low) == loop.state(high) == S.JOB_STATE_QUEUED
    await loop.api.cancel(ALICE, big, "")
    await loop.until(lambda: loop.state(high) == S.JOB_STATE_RUNNING, "high runs")
    await loop.until(lambda: loop.state(low) == S.JOB_STATE_RUNNING, "low runs")
    assert loop.job(high).queue_position == 0


async def test_a_raised_priority_takes_effect_even_where_sticky_rounding_would_keep_shares(
    loop: Loop,
) -> None:
    """Three jobs at 5000 on 8 devices hold 3/3/2. Raising the third to 7500 gives exact
    shares 2.29/2.29/3.43: sticky rounding alone would keep the first job's spare unit (3/2/3,
    the raise changing nothing); a priority change rounds plainly: 2/2/4."""
    jobs = []
    for _ in range(3):
        jobs.append((await loop.api.submit(ALICE, "", spec(loop.artifact))).job_id)
        await loop.until(lambda: loop.job(jobs[-1]).target_workers > 0, "admitted")
    j1, j2, j3 = jobs
    await loop.shares({j1: 3, j2: 3, j3: 2}, "3/3/2")
    await loop.api.update(ALICE, j3, priority=7500, max_workers=None, request_id="")
    await loop.shares({j1: 2, j2: 2, j3: 4}, "2/2/4 after the raise")
    # Settled: the next cycles keep it (no churn once nothing changes).
    loop.reconciler.trigger("test")
    await loop.shares({j1: 2, j2: 2, j3: 4}, "still 2/2/4")


async def test_a_failing_learner_is_evicted_and_replaced_and_repeated_failures_fail_the_job(
    loop: Loop,
) -> None:
    c = loop.cluster
    j = (await loop.api.submit(ALICE, "", spec(loop.artifact, max_workers=2))).job_id
    await loop.shares({j: 2})
    victim = c.running(j)[0].learner.learner_id
    c.exit_learner(victim, 1, "Traceback: boom")
    await loop.until(lambda: victim in c.sync.jobs[j].evicted, "evicted")
    await loop.shares({j: 2}, "replaced")
    assert victim not in loop.table.records[j].learners
    c.tick_interval = 3600  # no progress from now on: failures accumulate
    for _ in range(10):
        if loop.state(j) == S.JOB_STATE_FAILED:
            break
        running = c.running(j)
        if running:
            c.exit_learner(running[0].learner.learner_id, 1, "Traceback: boom")
        await asyncio.sleep(0.05)
    await loop.until(lambda: loop.state(j) == S.JOB_STATE_FAILED, "failed")
    assert "learner failures without progress" in loop.job(j).state_reason
    assert "Traceback: boom" in loop.job(j).state_reason
    await loop.until(lambda: c.rm.allocations_of(j) == [] and c.workers(j) == 0, "all freed")


async def test_a_permanent_start_error_fails_the_job_with_the_reason(loop: Loop) -> None:
    j = (await loop.api.submit(ALICE, "", spec(loop.artifact, entry_point="missing.py"))).job_id
    await loop.until(lambda: loop.state(j) == S.JOB_STATE_FAILED, "failed")
    assert "StartLearner" in loop.job(j).state_reason
    assert "NOT_FOUND" in loop.job(j).state_reason
    await loop.until(lambda: loop.cluster.rm.ledger == {}, "devices freed")


async def test_a_job_its_coordinator_forgot_is_opened_again_and_goes_on(loop: Loop) -> None:
    c = loop.cluster
    j = (await loop.api.submit(ALICE, "", spec(loop.artifact, max_workers=2))).job_id
    await loop.shares({j: 2})
    c.sync.jobs[j].closed = True  # its coordinator shard restarted and lost the job
    await loop.until(lambda: not loop.table.records[j].opened, "the scheduler notices")
    for fl in c.running(j):  # its learners fail at their next boundary
        c.exit_learner(fl.learner.learner_id, 1, "Boundary: NOT_FOUND")
    await loop.until(lambda: [o for o in c.sync.open_calls if o[1] == j][1:], "opened again")
    await loop.shares({j: 2}, "running again")
    await loop.until(lambda: loop.state(j) == S.JOB_STATE_RUNNING, "RUNNING again")
    await loop.until(lambda: c.sync.jobs[j].progress.completed_iterations > 2, "progress")
    said = [h.reason for h in loop.table.records[j].history if h.to_state == S.JOB_STATE_RECOVERING]
    assert said and "lost the job's state" in said[0]


async def test_a_dead_coordinator_shard_makes_the_job_recovering_without_learners_then_it_resumes(
    loop: Loop,
) -> None:
    """Issue 12's repro: SIGKILL of the coordinator shard made every learner exit 1 while the
    job said "RUNNING, running on 4 learner(s)" forever."""
    c = loop.cluster
    j = (await loop.api.submit(ALICE, "", spec(loop.artifact, max_workers=4))).job_id
    await loop.shares({j: 4})
    await loop.until(lambda: loop.job(j).progress.completed_iterations > 3, "progress")
    index = loop.table.records[j].coordinator_index
    c.sync.down.add(index)  # the shard is dead: every call to it fails
    c.sync.jobs[j].closed = True  # and the job's state died with it
    for fl in c.running(j):
        c.exit_learner(fl.learner.learner_id, 1, "Boundary: UNAVAILABLE")
    await loop.until(lambda: loop.state(j) == S.JOB_STATE_RECOVERING, "RECOVERING")
    reason = loop.job(j).state_reason
    assert f"shard {index} (" in reason and "lost after iteration" in reason, reason
    await loop.until(
        lambda: loop.job(j).allocated_workers == 0 and c.workers(j) == 0, "no learner counted"
    )
    # While the coordinator is down no learner is started (it could not sync): many cycles on.
    starts, cycles = c.starts, loop.reconciler.cycles
    await loop.until(lambda: loop.reconciler.cycles >= cycles + 10, "cycles")
    assert c.starts == starts
    assert loop.state(j) == S.JOB_STATE_RECOVERING
    c.sync.down.discard(index)  # restarted (by the supervisor), without the job
    await loop.until(lambda: loop.state(j) == S.JOB_STATE_RUNNING, "RUNNING again", timeout=20)
    assert "recovered" in loop.job(j).state_reason
    await loop.shares({j: 4}, "all learners back")
    reasons = [h.reason for h in loop.table.records[j].history]
    assert any("re-opening the job from its latest checkpoint" in r for r in reasons), reasons


async def test_a_data_plane_that_never_comes_back_fails_the_job_after_bounded_retries(
    tmp_path: Path,
) -> None:
    cluster = await FakeCluster.start(hosts=1, gpus=2, shards=2)
    store = MemoryStore()
    storage = Storage((tmp_path / "storage").as_uri())
    table, reconciler, api, task = await start_loop(
        store,
        cluster,
        storage,
        health=HealthConfig(stall_timeout_s=1.5, max_recoveries=1, unreachable_grace_s=0.2),
    )
    try:
        info = await api.artifacts.upload(
            name="m", declared_size=0, declared_sha256="", chunks=chunked(b"x" * 64), owner=ALICE
        )
        j = (await api.submit(ALICE, "", spec(info.artifact_id, max_workers=2))).job_id
        await async_wait_until(
            lambda: cluster.workers(j) == 2 and table.records[j].job.progress.completed_iterations,
            what="running",
        )
        cluster.sync.down.update({0, 1})  # the whole tier is gone for good
        for fl in cluster.running(j):
            cluster.exit_learner(fl.learner.learner_id, 1, "Boundary: UNAVAILABLE")
        await async_wait_until(
            lambda: table.records[j].state == S.JOB_STATE_FAILED, timeout=60, what="FAILED"
        )
        record = table.records[j]
        assert "unreachable" in record.job.state_reason, record.job.state_reason
        assert "gave up after 1 automatic retry" in record.job.state_reason
        said = [(h.to_state, h.reason) for h in record.history]
        assert any(s == S.JOB_STATE_RECOVERING and "lost after iteration" in r for s, r in said)
        assert any("retrying from the latest checkpoint (retry 1 of 1)" in r for _, r in said)
        assert record.workers() == 0 and cluster.workers(j) == 0
    finally:
        await stop_task(task)
        await reconciler.peers.close()
        await cluster.stop()
        await store.close()


async def test_the_scheduler_follows_a_coordinator_moved_by_the_data_plane(loop: Loop) -> None:
    """The parameter-sync tier fails the coordinator role over and publishes the move in etcd
    (shoal.contract.data_plane): the scheduler talks to the new coordinator and tells new
    learners about it; an older epoch does not move it back."""
    c = loop.cluster
    j = (await loop.api.submit(ALICE, "", spec(loop.artifact, max_workers=2))).job_id
    await loop.shares({j: 2})
    old = loop.table.records[j].coordinator_index
    new = 1 - old
    c.sync.down.add(old)  # the old coordinator's shard is gone
    moved = CoordinatorRecord(address=c.shard_addresses[new], index=new, epoch=1)
    await loop.store.put(coordinator_key(j), encode_coordinator(moved))
    await loop.until(
        lambda: loop.table.records[j].coordinator_address == c.shard_addresses[new], "re-pointed"
    )
    done = loop.job(j).progress.completed_iterations
    await loop.until(lambda: loop.job(j).progress.completed_iterations > done + 3, "progress")
    assert loop.state(j) == S.JOB_STATE_RUNNING
    stored = await loop.table.get(j)
    assert stored is not None and stored.coordinator_index == new  # persisted
    # A learner started from now on is told the new coordinator.
    c.exit_learner(c.running(j)[0].learner.learner_id, 1, "boom")
    await loop.until(
        lambda: any(
            fl.request.env["SHOAL_COORDINATOR"] == c.shard_addresses[new] for fl in c.running(j)
        ),
        "a learner told the new coordinator",
    )
    stale = CoordinatorRecord(address=c.shard_addresses[old], index=old, epoch=0)
    await loop.store.put(coordinator_key(j), encode_coordinator(stale))
    cycles = loop.reconciler.cycles
    await loop.until(lambda: loop.reconciler.cycles > cycles + 5, "cycles")
    assert loop.table.records[j].coordinator_address == c.shard_addresses[new]


async def test_a_lost_coordinator_shard_is_replaced_by_the_next_shard_and_the_move_published(
    loop: Loop,
) -> None:
    """Coordinator failover, the scheduler's side: the coordinator's shard unreachable for the
    grace, the scheduler makes the next shard the coordinator (TakeOverJob at epoch 1),
    publishes the move in etcd (shoal.contract.data_plane) and follows it; no rewind, no
    learner stopped."""
    c = loop.cluster
    c.sync.takeover = True
    j = (await loop.api.submit(ALICE, "", spec(loop.artifact, max_workers=2))).job_id
    await loop.shares({j: 2})
    await loop.until(lambda: loop.job(j).progress.completed_iterations > 3, "progress")
    old = loop.table.records[j].coordinator_index
    new = 1 - old
    opened = len(c.sync.open_calls)
    c.sync.down.add(old)
    await loop.until(
        lambda: loop.table.records[j].coordinator_address == c.shard_addresses[new], "moved"
    )
    assert c.sync.takeover_calls == [(new, j, old, 1)]
    stored = await loop.store.get(coordinator_key(j))
    assert stored is not None
    assert decode_coordinator(stored.value) == CoordinatorRecord(c.shard_addresses[new], new, 1)
    done = loop.job(j).progress.completed_iterations
    await loop.until(lambda: loop.job(j).progress.completed_iterations > done + 3, "progress")
    assert loop.state(j) == S.JOB_STATE_RUNNING and c.workers(j) == 2
    assert len(c.sync.open_calls) == opened  # not re-opened from a checkpoint
    reasons = [h.reason for h in loop.table.records[j].history]
    assert not any("checkpoint" in r for r in reasons), reasons


async def test_a_collective_job_s_lost_coordinator_is_taken_over_too_with_its_sync_mode(
    loop: Loop,
) -> None:
    """Collective mode (docs/data-plane.md, "Coordinator failover in collective mode"): the
    scheduler moves the coordinator role as for a parameter-server job, telling the successor
    the job's sync mode (its learners hold the state); no re-open from a checkpoint."""
    c = loop.cluster
    c.sync.takeover = True
    j = (
        await loop.api.submit(
            ALICE, "", spec(loop.artifact, max_workers=2, sync_mode=job_pb2.SYNC_MODE_COLLECTIVE)
        )
    ).job_id
    await loop.shares({j: 2})
    await loop.until(lambda: loop.job(j).progress.completed_iterations > 3, "progress")
    assert loop.table.records[j].job.effective_sync_mode == job_pb2.SYNC_MODE_COLLECTIVE
    old = loop.table.records[j].coordinator_index
    new = 1 - old
    opened = len(c.sync.open_calls)
    c.sync.down.add(old)
    await loop.until(
        lambda: loop.table.records[j].coordinator_address == c.shard_addresses[new], "moved"
    )
    assert c.sync.takeover_calls == [(new, j, old, 1)]
    assert c.sync.takeover_modes == [job_pb2.SYNC_MODE_COLLECTIVE]
    done = loop.job(j).progress.completed_iterations
    await loop.until(lambda: loop.job(j).progress.completed_iterations > done + 3, "progress")
    assert loop.state(j) == S.JOB_STATE_RUNNING and c.workers(j) == 2
    assert len(c.sync.open_calls) == opened  # not re-opened from a checkpoint


async def test_a_stale_coordinator_refusal_never_deposes_the_scheduler_and_the_job_reopens_above_the_published_epoch(  # noqa: E501
    loop: Loop,
) -> None:
    """A job's coordinator role moved before (a takeover published at epoch 3), then its
    coordinator lost the job, so the scheduler re-opens it. Shards that still know a newer
    coordinator epoch refuse OpenJob with ERROR_REASON_STALE_COORDINATOR: that is the job's
    coordinator fenced, not this scheduler's leadership, so it keeps leading and retries; it
    opens the job above the published epoch (4) and publishes the epoch the shard took. (The
    bug this guards: the refusal was ERROR_REASON_FENCED_OUT and both scheduler replicas
    stepped down in turn, the job never resumed; tests/chaos second coordinator loss.)"""
    sync = loop.cluster.sync
    job_id = (await loop.api.submit(ALICE, "", spec(loop.artifact, max_workers=2))).job_id
    await async_wait_until(lambda: loop.cluster.workers(job_id) == 2, what="2 learners")
    assert sync.open_epochs == [(job_id, 0)]  # the role never moved: epoch 0
    index = loop.table.records[job_id].coordinator_index
    moved = CoordinatorRecord(address=loop.cluster.shard_addresses[index], index=index, epoch=3)
    await loop.store.put(coordinator_key(job_id), encode_coordinator(moved))
    await async_wait_until(
        lambda: loop.reconciler.moves.get(job_id) is not None, what="the move seen"
    )

    sync.stale_opens = 2
    sync.jobs[job_id].closed = True  # the coordinator lost the job: the scheduler re-opens it
    await loop.until(lambda: not loop.table.records[job_id].opened, "the scheduler notices")
    for fl in loop.cluster.running(job_id):  # before its next learner starts
        loop.cluster.exit_learner(fl.learner.learner_id, 1, "Boundary: NOT_FOUND")
    await async_wait_until(
        lambda: sync.stale_opens == 0 and not sync.jobs[job_id].closed,
        timeout=30,
        what="the job re-opened after two stale-coordinator refusals",
    )
    assert [e for j, e in sync.open_epochs[1:] if j == job_id] == [4, 4, 4]
    await async_wait_until(
        lambda: loop.reconciler.moves.get(job_id).epoch == 4,  # type: ignore[union-attr]
        what="the epoch the shard took, published",
    )
    kv = await loop.store.get(coordinator_key(job_id))
    assert kv is not None
    published = decode_coordinator(kv.value)
    assert (published.index, published.epoch) == (index, 4)
    assert loop.table.leading
    assert not loop.reconciler._deposed.is_set()


async def test_a_jobs_coordinator_record_is_deleted_when_it_ends_in_any_terminal_state(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    """Where a job's coordinator moved (``/shoal/v1/parameter-sync/coordinators/<job_id>``)
    is deleted from etcd when the job is COMPLETED, CANCELLED or FAILED; one left by an earlier
    leader for a job that had ended is deleted as soon as it is seen. On a real etcd."""
    cluster = await FakeCluster.start(hosts=2, gpus=4, shards=2)
    store = EtcdStore(etcd.endpoints, timeout=3.0)
    storage = Storage((tmp_path / "storage").as_uri())
    table, reconciler, api, task = await start_loop(store, cluster, storage, max_failures=2)

    async def stored(job_id: str) -> bool:
        return await store.get(coordinator_key(job_id)) is not None

    async def gone(job_id: str, what: str) -> None:
        for _ in range(200):
            if not await stored(job_id):
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"the coordinator record of {what} is still in etcd")

    try:
        info = await api.artifacts.upload(
            name="m", declared_size=0, declared_sha256="", chunks=chunked(b"x" * 64), owner=ALICE
        )
        jobs = [
            (await api.submit(ALICE, "", spec(info.artifact_id, max_workers=2))).job_id
            for _ in range(3)
        ]
        await async_wait_until(
            lambda: all(cluster.workers(j) == 2 for j in jobs), what="3 jobs on 2 learners each"
        )
        for j in jobs:  # the data plane moved every job's coordinator to the other shard
            new = 1 - table.records[j].coordinator_index
            moved = CoordinatorRecord(address=cluster.shard_addresses[new], index=new, epoch=1)
            await store.put(coordinator_key(j), encode_coordinator(moved))
        await async_wait_until(
            lambda: all(reconciler.moves.get(j) is not None for j in jobs), what="moves seen"
        )
        assert [await stored(j) for j in jobs] == [True, True, True]
        completed, cancelled, failed = jobs

        cluster.sync.finish(completed)
        await async_wait_until(
            lambda: table.records[completed].state == S.JOB_STATE_COMPLETED, what="COMPLETED"
        )
        await gone(completed, "a COMPLETED job")
        await async_wait_until(lambda: cluster.sync.jobs[completed].closed, what="closed")
        assert cluster.sync.jobs[completed].closed  # CloseJob still reached its coordinator

        await api.cancel(ALICE, cancelled, "")
        await async_wait_until(
            lambda: table.records[cancelled].state == S.JOB_STATE_CANCELLED, what="CANCELLED"
        )
        await gone(cancelled, "a CANCELLED job")

        cluster.tick_interval = 3600  # no progress: learner failures fail the job
        for _ in range(40):
            if table.records[failed].state == S.JOB_STATE_FAILED:
                break
            running = cluster.running(failed)
            if running:
                cluster.exit_learner(running[0].learner.learner_id, 1, "Traceback: boom")
            await asyncio.sleep(0.1)
        await async_wait_until(
            lambda: table.records[failed].state == S.JOB_STATE_FAILED, what="FAILED"
        )
        await gone(failed, "a FAILED job")
        assert all(reconciler.moves.get(j) is None for j in jobs)

        # A record of an ended job (left by a leader that died before deleting it): deleted
        # as soon as the watch brings it.
        stale = CoordinatorRecord(address=cluster.shard_addresses[0], index=0, epoch=7)
        await store.put(coordinator_key(completed), encode_coordinator(stale))
        await gone(completed, "an ended job, written again")
    finally:
        await stop_task(task)
        await reconciler.peers.close()
        await cluster.stop()
        await store.close()


async def test_a_new_leader_rewrites_a_legacy_json_coordinator_record_as_protobuf(
    tmp_path: Path,
) -> None:
    """A coordinator record an earlier release wrote in JSON is still followed, and the leader
    rewrites it as a CoordinatorRecordState when its term begins."""
    cluster = await FakeCluster.start(hosts=1, gpus=2, shards=2)
    store = MemoryStore()
    job_id = "job-0123456789ab"
    await store.put(
        coordinator_key(job_id), b'{"address": "127.0.0.1:7301", "epoch": 2, "index": 1}'
    )
    storage = Storage((tmp_path / "storage").as_uri())
    _table, reconciler, _api, task = await start_loop(store, cluster, storage)
    try:

        async def rewritten() -> bool:
            kv = await store.get(coordinator_key(job_id))
            return kv is not None and not is_legacy(kv.value)

        for _ in range(200):
            if await rewritten():
                break
            await asyncio.sleep(0.05)
        kv = await store.get(coordinator_key(job_id))
        assert kv is not None and not is_legacy(kv.value), "the legacy record was not rewritten"
        assert decode_coordinator(kv.value) == CoordinatorRecord("127.0.0.1:7301", 1, 2)
        assert reconciler.moves.get(job_id) == CoordinatorRecord("127.0.0.1:7301", 1, 2)
    finally:
        await stop_task(task)
        await reconciler.peers.close()
        await cluster.stop()
        await store.close()


async def test_a_job_without_progress_is_retried_from_its_checkpoint_then_fails_with_the_reason(
    tmp_path: Path,
) -> None:
    cluster = await FakeCluster.start(hosts=1, gpus=2, shards=2)
    cluster.tick_interval = 3600  # the data plane never commits an iteration
    store = MemoryStore()
    storage = Storage((tmp_path / "storage").as_uri())
    table, reconciler, api, task = await start_loop(
        store, cluster, storage, health=HealthConfig(stall_timeout_s=1.0, max_recoveries=2)
    )
    try:
        info = await api.artifacts.upload(
            name="m", declared_size=0, declared_sha256="", chunks=chunked(b"x" * 64), owner=ALICE
        )
        j = (await api.submit(ALICE, "", spec(info.artifact_id, max_workers=2))).job_id
        await async_wait_until(
            lambda: table.records[j].state == S.JOB_STATE_FAILED, timeout=60, what="FAILED"
        )
        record = table.records[j]
        assert record.recoveries == 2
        assert "gave up after 2 automatic retries" in record.job.state_reason
        said = [h.reason for h in record.history if h.to_state == S.JOB_STATE_RECOVERING]
        assert any("retry 1 of 2" in r for r in said) and any("retry 2 of 2" in r for r in said)
        # Each retry closed the data plane and opened it again (from the checkpoint).
        assert len([o for o in cluster.sync.open_calls if o[1] == j]) >= 3
        await async_wait_until(
            lambda: cluster.rm.allocations_of(j) == [] and cluster.workers(j) == 0,
            timeout=20,
            what="all freed",
        )
    finally:
        await stop_task(task)
        await reconciler.peers.close()
        await cluster.stop()
        await store.close()


async def test_a_running_job_that_stops_committing_says_so_and_says_when_it_trains_again(
    tmp_path: Path,
) -> None:
    """The coordinator answers but no iteration commits (a livelock, a hung learner): the job
    stays RUNNING and its reason says it is stalled (a STATE event, in the history); the next
    committed iteration puts "training again" in its reason. (Issue 12: never "RUNNING" for a
    job that does not train.)"""
    cluster = await FakeCluster.start(hosts=1, gpus=2, shards=2)
    store = MemoryStore()
    storage = Storage((tmp_path / "storage").as_uri())
    health = HealthConfig(stall_timeout_s=0.0, stall_notice_s=0.5)
    table, reconciler, api, task = await start_loop(store, cluster, storage, health=health)
    try:
        info = await api.artifacts.upload(
            name="m", declared_size=0, declared_sha256="", chunks=chunked(b"x" * 64), owner=ALICE
        )
        j = (await api.submit(ALICE, "", spec(info.artifact_id, max_workers=2))).job_id
        await async_wait_until(
            lambda: (
                table.records[j].state == S.JOB_STATE_RUNNING
                and table.records[j].job.progress.completed_iterations > 0
            ),
            timeout=30,
            what="training",
        )
        cluster.tick_interval = 3600  # from now on nothing commits
        await async_wait_until(
            lambda: table.records[j].job.state_reason.startswith("stalled: "),
            timeout=30,
            what="the stalled reason",
        )
        record = table.records[j]
        assert record.state == S.JOB_STATE_RUNNING
        assert "no iteration committed for" in record.job.state_reason
        assert "answers" in record.job.state_reason, record.job.state_reason
        assert record.history[-1].reason == record.job.state_reason
        cluster.sync.tick()  # an iteration commits again
        await async_wait_until(
            lambda: table.records[j].job.state_reason.startswith("training again"),
            timeout=30,
            what="the training-again reason",
        )
        assert table.records[j].state == S.JOB_STATE_RUNNING
        assert "without a committed iteration; running on 2 learner(s)" in (
            table.records[j].job.state_reason
        )
    finally:
        await stop_task(task)
        await reconciler.peers.close()
        await cluster.stop()
        await store.close()


async def test_a_failed_checkpoint_is_said_until_a_later_one_commits(loop: Loop) -> None:
    """GetJobProgress.checkpoint_error goes into the RUNNING job's reason; an empty error alone
    (a coordinator that took the job over starts without it) changes nothing; a checkpoint
    committed after the failed one puts "checkpoints commit again" in the reason."""
    c = loop.cluster
    j = (await loop.api.submit(ALICE, "", spec(loop.artifact, max_workers=2))).job_id
    await loop.shares({j: 2})
    failed = "checkpoint after 230 iterations failed: storage full: ENOSPC (storage file:///s)"
    fake = c.sync.jobs[j]
    fake.latest_checkpoint, fake.checkpoint_error = 220, failed
    await loop.until(lambda: loop.table.records[j].job.state_reason == failed, "the failure")
    fake.checkpoint_error = ""  # a moved coordinator: no error, nothing committed since
    seen = c.sync.jobs[j].progress.completed_iterations
    await loop.until(  # the record's progress moves only with the scheduler's polls
        lambda: loop.table.records[j].job.progress.completed_iterations > seen + 5,
        "polls after the error cleared",
    )
    assert loop.table.records[j].job.state_reason == failed
    assert loop.table.records[j].state == S.JOB_STATE_RUNNING
    fake.latest_checkpoint = 240
    await loop.until(
        lambda: loop.table.records[j].job.state_reason.startswith("checkpoints commit again"),
        "checkpoints commit again",
    )
    assert failed in loop.table.records[j].job.state_reason


async def test_a_draining_host_is_emptied_and_the_job_moves_elsewhere(loop: Loop) -> None:
    c = loop.cluster
    j = (await loop.api.submit(ALICE, "", spec(loop.artifact, max_workers=4))).job_id
    await loop.shares({j: 4})
    host_id = c.running(j)[0].learner.host_id
    host = c.rm.hosts[host_id]
    host.cordoned = host.draining = True
    from shoal.v1 import resource_manager_service_pb2 as rm_pb2

    c.rm.emit(
        rm_pb2.WatchInventoryResponse(kind=rm_pb2.INVENTORY_EVENT_KIND_HOST_CHANGED, hosts=[host])
    )
    await loop.until(
        lambda: c.workers(j) == 4 and all(fl.learner.host_id != host_id for fl in c.running(j)),
        "moved off the draining host",
    )
    assert c.sync.jobs[j].evicted == []


async def test_logs_are_merged_from_the_learners_and_followed_until_the_job_ends(
    loop: Loop,
) -> None:
    c = loop.cluster
    j = (await loop.api.submit(ALICE, "", spec(loop.artifact, max_workers=2))).job_id
    await loop.shares({j: 2})
    ids = sorted(fl.learner.learner_id for fl in c.running(j))
    backlog = [
        line.text
        async for batch in loop.api.logs(ALICE, js.StreamJobLogsRequest(job_id=j))
        for line in batch
    ]
    assert sorted(backlog) == sorted(f"learner {lid} started" for lid in ids)
    tail = [
        line
        async for batch in loop.api.logs(
            ALICE, js.StreamJobLogsRequest(job_id=j, learner_id=ids[0], tail_lines=1)
        )
        for line in batch
    ]
    assert [ln.learner_id for ln in tail] == [ids[0]]

    lines: list[str] = []

    async def follow() -> None:
        async for batch in loop.api.logs(ALICE, js.StreamJobLogsRequest(job_id=j, follow=True)):
            lines.extend(line.text for line in batch)

    follower = asyncio.create_task(follow())
    await loop.until(lambda: len(lines) == 2, "backlog")
    for lid in ids:
        agent = next(a for a in c.agents.values() if lid in a.learners)
        agent.log(lid, f"epoch 0 loss 0.5 from {lid}")
    await loop.until(lambda: len(lines) == 4, "followed lines")
    await loop.api.cancel(ALICE, j, "")
    await asyncio.wait_for(follower, timeout=10)
    assert sum("loss" in text for text in lines) == 2


async def test_a_log_follower_asks_again_for_a_learner_its_agent_did_not_know_yet(
    loop: Loop,
) -> None:
    """`logs -f` right after submit: the learner is allocated (its agent's address known) but
    StartLearner has not reached its agent yet (the artifact is fetched, the job opened), so
    the agent answers NOT_FOUND; the follower asks again and gets the learner's lines (an
    environment's build streams from the agent while it runs)."""
    c = loop.cluster
    hold = asyncio.Event()
    for agent in c.agents.values():
        agent.hold_starts = hold
    j = (await loop.api.submit(ALICE, "", spec(loop.artifact, max_workers=1))).job_id
    lines: list[str] = []

    async def follow() -> None:
        async for batch in loop.api.logs(ALICE, js.StreamJobLogsRequest(job_id=j, follow=True)):
            lines.extend(line.text for line in batch)

    follower = asyncio.create_task(follow())
    await loop.until(
        lambda: sum(a.unknown_log_requests for a in c.agents.values()) >= 1,
        "the agent asked about a learner it does not know yet",
        timeout=20,
    )
    hold.set()
    await loop.until(lambda: any(t.endswith(" started") for t in lines), "its lines", timeout=20)
    await loop.api.cancel(ALICE, j, "")
    await asyncio.wait_for(follower, timeout=10)
    assert len([t for t in lines if t.endswith(" started")]) == 1, lines


async def test_without_a_shard_flag_the_shards_come_from_their_etcd_registry(
    tmp_path: Path,
) -> None:
    cluster = await FakeCluster.start(hosts=1, gpus=2, shards=2)
    store = MemoryStore()
    storage = Storage((tmp_path / "storage").as_uri())
    _, rec, api, task = await start_loop(store, cluster, storage, registry=True)
    try:
        info = await api.artifacts.upload(
            name="m", declared_size=0, declared_sha256="", chunks=chunked(b"m"), owner=ALICE
        )
        job = await api.submit(ALICE, "", spec(info.artifact_id, max_workers=2))
        await store.put(SHARD_REGISTRY + "1", cluster.shard_addresses[1].encode())
        assert rec.registry is not None
        await async_wait_until(lambda: 1 in rec.registry.addresses, what="shard 1 seen")
        # Shard 0 is still missing: the list is not usable, nothing can start.
        assert rec.shards() == ()
        assert cluster.workers(job.job_id) == 0 and cluster.rm.ledger == {}
        await store.put(SHARD_REGISTRY + "0", cluster.shard_addresses[0].encode())
        await async_wait_until(lambda: cluster.workers(job.job_id) == 2, what="running")
        env = dict(cluster.running(job.job_id)[0].request.env)
        assert env["SHOAL_SYNC_ENDPOINTS"] == ",".join(cluster.shard_addresses)
        index = coordinator_index(job.job_id, 2)
        assert env["SHOAL_COORDINATOR"] == cluster.shard_addresses[index]
        assert cluster.sync.open_calls == [(index, job.job_id)]
    finally:
        await stop_task(task)
        await rec.peers.close()
        await cluster.stop()
        await store.close()


async def test_a_new_leader_resumes_every_job_from_the_store_without_restarting_learners(
    tmp_path: Path,
) -> None:
    cluster = await FakeCluster.start(hosts=2, gpus=4, shards=1)
    store = MemoryStore()
    storage = Storage((tmp_path / "storage").as_uri())
    first = LeaderElection(store, ELECTION, candidate_id="a:1", ttl=2.0)
    second = LeaderElection(store, ELECTION, candidate_id="b:2", ttl=2.0)
    lead_a = await first.campaign()
    table_a, rec_a, api_a, task_a = await start_loop(store, cluster, storage, leadership=lead_a)
    try:
        info = await api_a.artifacts.upload(
            name="m", declared_size=0, declared_sha256="", chunks=chunked(b"m" * 10), owner=ALICE
        )
        j1 = (await api_a.submit(ALICE, "r1", spec(info.artifact_id))).job_id
        await async_wait_until(lambda: cluster.workers(j1) == 8, what="job 1 on 8")
        j2 = (await api_a.submit(ALICE, "r2", spec(info.artifact_id))).job_id
        await async_wait_until(
            lambda: cluster.workers(j1) == 4 and cluster.workers(j2) == 4, what="4/4"
        )
        await async_wait_until(
            lambda: all(table_a.records[j].workers() == 4 for j in (j1, j2)), what="recorded"
        )
        # A predecessor's leftovers: an allocation nobody recorded (orphan).
        starts = cluster.starts
        learners = {j: set(table_a.records[j].learners) for j in (j1, j2)}

        # The leader's process dies: its loop stops, its lease goes away.
        task_a.cancel()
        await asyncio.gather(task_a, return_exceptions=True)
        await lead_a.resign()
        lead_b = await asyncio.wait_for(second.campaign(), timeout=10)
        table_b, rec_b, api_b, task_b = await start_loop(store, cluster, storage, leadership=lead_b)
        try:
            assert set(table_b.records) == {j1, j2}
            before = cluster.sync.jobs[j1].progress.completed_iterations
            await async_wait_until(
                lambda: table_b.records[j1].job.progress.completed_iterations > before,
                what="new leader sees progress",
            )
            assert cluster.starts == starts
            assert {j: set(table_b.records[j].learners) for j in (j1, j2)} == learners
            assert table_b.records[j1].state == S.JOB_STATE_RUNNING
            # The new leader acts: a cancel frees job 1's devices, job 2 grows into them.
            await api_b.cancel(ALICE, j1, "")
            await async_wait_until(lambda: cluster.workers(j2) == 8, what="job 2 on 8")
            assert cluster.rm.fencing.newest == lead_b.fence.create_revision
            # The old leader is fenced out of the store.
            with pytest.raises(Exception, match="not the leader"):
                table_a.leading = True
                await table_a.save(table_a.records[j2])
        finally:
            await stop_task(task_b)
            await rec_b.peers.close()
    finally:
        await stop_task(task_a)
        await rec_a.peers.close()
        await cluster.stop()
        await store.close()


async def test_a_new_leader_adopts_acquired_learners_and_frees_orphan_allocations(
    tmp_path: Path,
) -> None:
    """A predecessor that died between AcquireDevices and recording the result left a PENDING
    learner whose device is allocated (adopted and started), and an allocation for a learner
    it never recorded (released)."""
    cluster = await FakeCluster.start(hosts=1, gpus=4, shards=1)
    store = MemoryStore()
    storage = Storage((tmp_path / "storage").as_uri())
    table = JobTable(store)
    await table.become_leader(None)
    api = JobApi(table, ArtifactStore(storage, max_bytes=1 << 20), trigger=lambda _: None)
    info = await api.artifacts.upload(
        name="m", declared_size=0, declared_sha256="", chunks=chunked(b"m"), owner=ALICE
    )
    job = await api.submit(ALICE, "", spec(info.artifact_id, max_workers=1))
    record = table.records[job.job_id]
    from shoal.scheduler.jobs import LearnerRecord
    from shoal.v1 import resource_manager_service_pb2 as rm_pb2

    host = cluster.rm.hosts["h1"]
    lr = LearnerRecord(record.next_learner_id(), "h1", "gpu0", host.agent_address, host.incarnation)
    record.learners[lr.learner_id] = lr
    record.coordinator_index, record.coordinator_address = 0, cluster.shard_addresses[0]
    await table.save(record)
    claims = [
        rm_pb2.DeviceClaim(
            job_id=job.job_id, learner_id=lr.learner_id, host_id="h1", device_id="gpu0"
        ),
        rm_pb2.DeviceClaim(
            job_id="job-gone", learner_id="job-gone-l1", host_id="h1", device_id="gpu1"
        ),
    ]
    await cluster.rm.AcquireDevices(rm_pb2.AcquireDevicesRequest(claims=claims), None)
    table.step_down()
    table2, rec, _, task = await start_loop(store, cluster, storage)
    try:
        await async_wait_until(lambda: cluster.workers(job.job_id) == 1, what="adopted")
        assert cluster.running(job.job_id)[0].learner.learner_id == lr.learner_id
        assert cluster.running(job.job_id)[0].learner.device_id == "gpu0"
        await async_wait_until(
            lambda: all(a.learner_id != "job-gone-l1" for a in cluster.rm.ledger.values()),
            what="orphan released",
        )
        await async_wait_until(
            lambda: (
                table2.records[job.job_id].learners[lr.learner_id].phase is LearnerPhase.RUNNING
            ),
            what="the adopted learner recorded as running",
        )
    finally:
        await stop_task(task)
        await rec.peers.close()
        await cluster.stop()
        await store.close()


# ============================================================================================
# Real processes: etcd + two scheduler replicas
# ============================================================================================


class SchedulerProcess:
    """``python -m shoal.scheduler`` as a child process, its output kept in a log file."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.args = args
        self.log = log
        self.address = args[args.index("--listen") + 1]
        self.proc: asyncio.subprocess.Process | None = None
        self.lines: list[str] = []
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> SchedulerProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "SHOAL_LOG_LEVEL": "INFO"}
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "shoal.scheduler",
            *self.args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
        )
        self._reader = asyncio.create_task(self._read())
        await async_wait_until(
            lambda: any(ln.startswith("LISTENING") for ln in self.lines) or self.exited,
            timeout=30,
            what=f"scheduler {self.address} listening",
        )
        assert not self.exited, "\n".join(self.lines[-30:])
        return self

    @property
    def exited(self) -> bool:
        return self.proc is not None and self.proc.returncode is not None

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with self.log.open("a") as out:
            async for raw in self.proc.stdout:
                line = raw.decode(errors="replace").rstrip("\n")
                self.lines.append(line)
                out.write(line + "\n")
                out.flush()

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)
            await self.proc.wait()

    async def terminate(self) -> int:
        assert self.proc is not None
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return await asyncio.wait_for(self.proc.wait(), timeout=20)
        finally:
            await self.kill()
            if self._reader is not None:
                await asyncio.gather(self._reader, return_exceptions=True)


@dataclass
class Replicas:
    etcd: EtcdServer
    cluster: FakeCluster
    processes: list[SchedulerProcess]
    tokens: dict[str, str]
    store: EtcdStore
    channels: dict[str, grpc.aio.Channel]
    artifact: str = ""

    async def leader_address(self) -> str | None:
        try:
            return await LeaderElection(self.store, ELECTION, candidate_id="observer").leader()
        except StoreUnavailable:
            return None  # etcd busy: not known yet

    def stub(self, address: str) -> job_scheduler_service_pb2_grpc.JobSchedulerServiceStub:
        if address not in self.channels:
            self.channels[address] = connect(address, token=self.tokens["user"], trace=False)
        return job_scheduler_service_pb2_grpc.JobSchedulerServiceStub(self.channels[address])

    async def call(self, method: str, request: object) -> object:
        """Call the leader, following a standby's ``shoal-leader`` answer (as clients do)."""
        address = await self.leader_address() or self.processes[0].address
        for _ in range(20):
            try:
                # A list is a client stream: a fresh iterator for every attempt.
                argument = iter(request) if isinstance(request, list) else request
                return await getattr(self.stub(address), method)(argument, timeout=10)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                leader = dict(exc.trailing_metadata() or ()).get(LEADER_METADATA_KEY)
                address = leader or await self.leader_address() or address
                await asyncio.sleep(0.1)
        raise AssertionError(f"{method}: no leader answered")

    async def job(self, job_id: str) -> job_pb2.Job:
        return (await self.call("GetJob", js.GetJobRequest(job_id=job_id))).job  # type: ignore[attr-defined]


@pytest.fixture
async def replicas(etcd: EtcdServer, tmp_path: Path) -> AsyncIterator[Replicas]:
    tokens = make_tokens(tmp_path / "tokens")
    cluster = await FakeCluster.start(hosts=2, gpus=4, shards=2)
    storage = (tmp_path / "storage").as_uri()
    processes = []
    for i in range(2):
        address = f"127.0.0.1:{free_port()}"
        args = [
            "--listen",
            address,
            "--advertise",
            address,
            "--etcd",
            ",".join(etcd.endpoints),
            "--tokens-file",
            str(tmp_path / "tokens"),
            "--service-token",
            tokens["service"],
            "--resource-managers",
            cluster.rm_address,
            "--sync-shards",
            ",".join(cluster.shard_addresses),
            "--storage-uri",
            storage,
            "--policy",
            "PRIORITY",
            "--hold-time",
            "0",
            "--election-ttl",
            "2",
            "--resync-interval",
            "0.2",
            "--stop-grace",
            "1",
            "--finish-grace",
            "1",
        ]
        processes.append(SchedulerProcess(args, tmp_path / f"scheduler-{i}.log"))
    await asyncio.gather(*(p.start() for p in processes))
    store = EtcdStore(etcd.endpoints, timeout=3.0)
    bed = Replicas(etcd, cluster, processes, tokens, store, {})
    try:
        await async_wait_until(bed.leader_address, timeout=20, what="a leader")
        data = b"artifact" * 1000
        messages = [
            js.UploadArtifactRequest(header=js.ArtifactHeader(name="m", size_bytes=len(data))),
            js.UploadArtifactRequest(chunk=data),
        ]
        bed.artifact = (await bed.call("UploadArtifact", messages)).artifact_id  # type: ignore[attr-defined]
        yield bed
    finally:
        for channel in bed.channels.values():
            await channel.close()
        for p in processes:
            with contextlib.suppress(Exception):
                await p.terminate()
        await store.close()
        await cluster.stop()


async def test_replicas_submit_idempotently_reallocate_on_priority_and_free_on_cancel(
    replicas: Replicas,
) -> None:
    bed, c = replicas, replicas.cluster
    request = js.SubmitJobRequest(request_id="req-1", spec=spec(bed.artifact))
    first = (await bed.call("SubmitJob", request)).job  # type: ignore[attr-defined]
    # The same submit retried (say after a deadline), at the standby too: one job.
    again = (await bed.call("SubmitJob", request)).job  # type: ignore[attr-defined]
    leader = await bed.leader_address()
    standby = next(p for p in bed.processes if p.address != leader)

    async def standby_names_the_leader() -> bool:
        try:
            await bed.stub(standby.address).SubmitJob(request)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE
            return dict(exc.trailing_metadata() or ()).get(LEADER_METADATA_KEY) == leader
        raise AssertionError("the standby accepted a submit")

    await async_wait_until(standby_names_the_leader, what="the standby names the leader")
    assert again.job_id == first.job_id
    listed = (await bed.call("ListJobs", js.ListJobsRequest())).jobs  # type: ignore[attr-defined]
    assert [j.job_id for j in listed] == [first.job_id]
    j1 = first.job_id
    await async_wait_until(lambda: c.workers(j1) == 8, what="job 1 on 8 learners")
    await async_wait_until(
        lambda: _state(bed, j1, S.JOB_STATE_RUNNING), what="job 1 RUNNING", timeout=10
    )

    j2 = (
        await bed.call("SubmitJob", js.SubmitJobRequest(spec=spec(bed.artifact)))  # type: ignore[attr-defined]
    ).job.job_id
    await async_wait_until(lambda: c.workers(j1) == 4 and c.workers(j2) == 4, what="4/4")
    await bed.call("UpdateJob", js.UpdateJobRequest(job_id=j2, priority=10000))
    await async_wait_until(lambda: c.workers(j1) == 3 and c.workers(j2) == 5, what="3/5")
    assert c.sync.jobs[j1].evicted == []

    cancelled = (await bed.call("CancelJob", js.CancelJobRequest(job_id=j1))).job  # type: ignore[attr-defined]
    assert cancelled.state == S.JOB_STATE_CANCELLING
    await async_wait_until(lambda: _state(bed, j1, S.JOB_STATE_CANCELLED), what="cancelled")
    assert c.workers(j1) == 0 and c.rm.allocations_of(j1) == []
    await async_wait_until(lambda: c.workers(j2) == 8, what="job 2 takes the freed devices")

    async def history_ends_at_8() -> bool:
        request = js.GetAllocationHistoryRequest(job_id=j2)
        events = (await bed.call("GetAllocationHistory", request)).events  # type: ignore[attr-defined]
        return bool(events) and events[-1].workers == 8 and 4 in [e.workers for e in events]

    await async_wait_until(history_ends_at_8, what="the allocation history of job 2")


async def _state(bed: Replicas, job_id: str, state: int) -> bool:
    return (await bed.job(job_id)).state == state


async def test_leader_sigkill_the_standby_leads_and_jobs_keep_their_learners_and_progress(
    replicas: Replicas,
) -> None:
    bed, c = replicas, replicas.cluster
    j1 = (
        await bed.call("SubmitJob", js.SubmitJobRequest(spec=spec(bed.artifact, max_workers=4)))  # type: ignore[attr-defined]
    ).job.job_id
    await async_wait_until(lambda: c.workers(j1) == 4, what="job on 4 learners")
    await async_wait_until(lambda: _progressed(bed, j1, 1), what="progress reported", timeout=10)
    learners = sorted(fl.learner.learner_id for fl in c.running(j1))
    starts, opens = c.starts, len(c.sync.open_calls)
    old = await bed.leader_address()
    victim = next(p for p in bed.processes if p.address == old)
    await victim.kill()
    await async_wait_until(lambda: _leader_changed(bed, old), timeout=20, what="the standby leads")
    before = (await bed.job(j1)).progress.completed_iterations
    await async_wait_until(
        lambda: _progressed(bed, j1, before + 5), what="progress after fail-over", timeout=15
    )
    job = await bed.job(j1)
    assert job.state == S.JOB_STATE_RUNNING
    assert job.allocated_workers == 4
    assert sorted(fl.learner.learner_id for fl in c.running(j1)) == learners
    assert (c.starts, len(c.sync.open_calls)) == (starts, opens)  # nothing restarted
    # The new leader acts on the same job: more devices for it.
    await bed.call("UpdateJob", js.UpdateJobRequest(job_id=j1, max_workers=8))
    await async_wait_until(lambda: c.workers(j1) == 8, what="job grows under the new leader")


async def _progressed(bed: Replicas, job_id: str, at_least: int) -> bool:
    return (await bed.job(job_id)).progress.completed_iterations >= at_least


async def _leader_changed(bed: Replicas, old: str | None) -> bool:
    leader = await bed.leader_address()
    return leader is not None and leader != old


# ============================================================================================
# Real processes: the real resource-manager and host agents (simulated GPUs, real learner
# processes), two scheduler replicas, parameter-sync shards faked
# ============================================================================================

LEARNER_SCRIPT = """\
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # a retired learner exits cleanly
print("learner", os.environ["SHOAL_LEARNER_ID"], "of", os.environ["SHOAL_JOB_ID"],
      "on device", os.environ.get("CUDA_VISIBLE_DEVICES", "?"), flush=True)
while True:
    time.sleep(0.05)
"""


def _tarball(files: dict[str, str]) -> bytes:
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o755
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class AgentWatcher:
    """Who runs where, from the real agents' ListLearners (what the fake data plane sees)."""

    def __init__(self, procs: object, addresses: list[str]) -> None:
        from shoal.v1 import host_agent_service_pb2_grpc as ha_grpc

        self.stubs = {a: ha_grpc.HostAgentServiceStub(procs.channel(a)) for a in addresses}  # type: ignore[attr-defined]
        self.running: dict[str, tuple[str, str]] = {}  # learner id -> (job id, agent address)
        self.stops: set[asyncio.Future[object]] = set()
        self.task = asyncio.create_task(self._poll())

    async def _poll(self) -> None:
        from shoal.v1 import host_agent_service_pb2 as ha_pb2, resources_pb2

        live = (resources_pb2.LEARNER_STATE_STARTING, resources_pb2.LEARNER_STATE_RUNNING)
        while True:
            seen: dict[str, tuple[str, str]] = {}
            for address, stub in self.stubs.items():
                with contextlib.suppress(grpc.aio.AioRpcError):
                    reply = await stub.ListLearners(ha_pb2.ListLearnersRequest(), timeout=2)
                    for learner in reply.learners:
                        if learner.state in live:
                            seen[learner.learner_id] = (learner.job_id, address)
            self.running = seen
            await asyncio.sleep(0.05)

    def members(self, job_id: str) -> list[str]:
        return [lid for lid, (job, _) in self.running.items() if job == job_id]

    def workers(self, job_id: str) -> int:
        return len(self.members(job_id))

    def leave(self, learner_id: str, code: int, reason: str) -> None:
        """At its boundary a retired learner exits: here, SIGTERM via StopLearner (exit 0)."""
        from shoal.v1 import host_agent_service_pb2 as ha_pb2

        where = self.running.get(learner_id)
        if where is not None:
            stub = self.stubs[where[1]]
            task = asyncio.ensure_future(
                stub.StopLearner(ha_pb2.StopLearnerRequest(learner_id=learner_id), timeout=10)
            )
            self.stops.add(task)
            task.add_done_callback(self.stops.discard)

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


@pytest.mark.slow
async def test_with_the_real_resource_manager_and_host_agents_and_a_leader_failover(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    from shoal.v1 import resource_manager_service_pb2 as rm_pb2
    from tests.integration._shoal_processes import ShoalProcesses

    procs = ShoalProcesses(tmp_path)
    sync = await FakeCluster.start(hosts=0, shards=2)
    schedulers = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    manager = procs.resource_manager(etcd.endpoints)
    agent_procs = [
        procs.host_agent(h, [manager.address], "--scheduler", ",".join(schedulers))
        for h in ("h1", "h2")
    ]
    watcher = AgentWatcher(procs, [a.address for a in agent_procs])
    sync.sync.members_hook = watcher.members
    sync.sync.leave_hook = watcher.leave
    processes = []
    for i, address in enumerate(schedulers):
        args = [
            "--listen",
            address,
            "--advertise",
            address,
            "--etcd",
            ",".join(etcd.endpoints),
            "--tokens-file",
            str(procs.tokens_file),
            "--service-token",
            procs.tokens["service"],
            "--resource-managers",
            manager.address,
            "--sync-shards",
            ",".join(sync.shard_addresses),
            "--storage-uri",
            (tmp_path / "storage").as_uri(),  # not the agents' artifact dir
            "--hold-time",
            "0",
            "--election-ttl",
            "2",
            "--resync-interval",
            "0.2",
            "--stop-grace",
            "2",
        ]
        processes.append(SchedulerProcess(args, tmp_path / f"scheduler-{i}.log"))
    store = EtcdStore(etcd.endpoints, timeout=3.0)
    bed = Replicas(etcd, sync, processes, procs.tokens, store, {})
    try:
        await asyncio.gather(*(p.start() for p in processes))
        rm_stub = procs.rm_stub(manager.address)

        async def hosts_ready() -> bool:
            with contextlib.suppress(grpc.aio.AioRpcError):
                reply = await rm_stub.ListHosts(rm_pb2.ListHostsRequest(), timeout=2)
                return len(reply.hosts) == 2
            return False

        await async_wait_until(hosts_ready, timeout=30, what="two agents registered")
        await async_wait_until(bed.leader_address, timeout=20, what="a scheduler leader")
        blob = _tarball({"train.py": LEARNER_SCRIPT})
        upload = await bed.call(
            "UploadArtifact",
            [
                js.UploadArtifactRequest(header=js.ArtifactHeader(name="m", size_bytes=len(blob))),
                js.UploadArtifactRequest(chunk=blob),
            ],
        )
        artifact = upload.artifact_id  # type: ignore[attr-defined]

        async def allocations(job_id: str) -> int:
            reply = await rm_stub.ListAllocations(rm_pb2.ListAllocationsRequest(job_id=job_id))
            return len(reply.allocations)

        async def shares(expected: dict[str, int], what: str) -> None:
            async def holds() -> bool:
                for job_id, n in expected.items():
                    if watcher.workers(job_id) != n or await allocations(job_id) != n:
                        return False
                return True

            await async_wait_until(holds, timeout=30, what=what)

        j1 = (await bed.call("SubmitJob", js.SubmitJobRequest(spec=spec(artifact)))).job.job_id  # type: ignore[attr-defined]
        await shares({j1: 8}, "job 1 on 8 real learners")
        j2 = (await bed.call("SubmitJob", js.SubmitJobRequest(spec=spec(artifact)))).job.job_id  # type: ignore[attr-defined]
        await shares({j1: 4, j2: 4}, "4/4")
        await bed.call("UpdateJob", js.UpdateJobRequest(job_id=j2, priority=10000))
        await shares({j1: 3, j2: 5}, "3/5 after the priority change")

        # Logs come from the real agents (each learner prints one line when it starts).
        leader = await bed.leader_address()
        assert leader is not None

        async def started_lines() -> bool:
            request = js.StreamJobLogsRequest(job_id=j2)
            lines = [
                line.text
                async for reply in bed.stub(leader).StreamJobLogs(request)
                for line in reply.lines
            ]
            return sum(f"of {j2} on device" in text for text in lines) >= 5

        await async_wait_until(started_lines, timeout=20, what="the learners' log lines")

        await bed.call("CancelJob", js.CancelJobRequest(job_id=j1))
        await async_wait_until(lambda: _state(bed, j1, S.JOB_STATE_CANCELLED), what="cancel")
        await shares({j1: 0, j2: 8}, "job 2 takes the freed devices")

        # The scheduler leader dies; the standby leads with a new fencing token, which the
        # real resource-manager checks against etcd.
        old = await bed.leader_address()
        await next(p for p in processes if p.address == old).kill()
        await async_wait_until(lambda: _leader_changed(bed, old), timeout=20, what="new leader")
        await bed.call("UpdateJob", js.UpdateJobRequest(job_id=j2, max_workers=4))
        await shares({j2: 4}, "job 2 shrinks under the new leader")
        assert (await bed.job(j2)).state == S.JOB_STATE_RUNNING
    except BaseException:
        print(procs.logs())
        for p in processes:
            print(f"===== {p.address}\n" + "\n".join(p.lines[-40:]))
        raise
    finally:
        for channel in bed.channels.values():
            await channel.close()
        for p in processes:
            with contextlib.suppress(Exception):
                await p.terminate()
        await watcher.close()
        await procs.close()
        await store.close()
        await sync.stop()


@pytest.mark.parametrize("successor_up", [True, False])
async def test_a_leader_dying_between_a_takeover_and_its_publish_leaves_a_job_the_next_one_finds(
    tmp_path: Path, successor_up: bool
) -> None:
    """Three shards. The leader moves a job's coordinator role (its shard lost) with
    TakeOverJob at epoch 1 on the next shard, then dies before it publishes the move in etcd.
    The next leader knows no move; it finds the coordinator's shard unreachable and asks the
    shards first (FindCoordinator): if the successor answers it follows it (publishes it, no
    second takeover); if the successor is gone too, it takes the role over at epoch 2 on the
    shard after it, never at epoch 1 again (one epoch names one coordinator). Either way the job
    is not lost, has one coordinator, keeps RUNNING on its learners, and etcd says where the
    coordinator is."""
    c = await FakeCluster.start(hosts=2, gpus=4, shards=3)
    store = MemoryStore()
    storage = Storage((tmp_path / "storage").as_uri())
    _, first, api, task = await start_loop(store, c, storage)
    second: Reconciler | None = None
    task2: asyncio.Task[None] | None = None
    try:
        info = await api.artifacts.upload(
            name="model",
            declared_size=0,
            declared_sha256="",
            chunks=chunked(b"x" * 64),
            owner=ALICE,
        )
        c.sync.takeover = True
        j = (await api.submit(ALICE, "", spec(info.artifact_id, max_workers=2))).job_id
        await async_wait_until(lambda: c.workers(j) == 2, what="2 learners")
        old = first.table.records[j].coordinator_index
        successor, after = (old + 1) % 3, (old + 2) % 3
        died = asyncio.Event()

        async def dies_before_publishing(record: object, moved: object) -> None:
            died.set()
            await asyncio.Event().wait()  # the process is gone: nothing after this runs

        first._publish_move = dies_before_publishing  # type: ignore[method-assign]
        c.sync.down.add(old)
        await async_wait_until(died.is_set, what="the takeover, then the leader dies")
        await stop_task(task)
        assert c.sync.coordinators[j] == (successor, 1)
        assert await store.get(coordinator_key(j)) is None  # never published
        if not successor_up:
            c.sync.down.add(successor)

        table2, second, _, task2 = await start_loop(store, c, storage)
        expected = CoordinatorRecord(c.shard_addresses[successor], successor, 1)
        if not successor_up:
            expected = CoordinatorRecord(c.shard_addresses[after], after, 2)
        await async_wait_until(
            lambda: table2.records[j].coordinator_address == expected.address,
            timeout=20,
            what="the next leader finds the job's coordinator",
        )
        kv = await store.get(coordinator_key(j))
        assert kv is not None and decode_coordinator(kv.value) == expected
        takeovers = [(i, e) for i, job, _, e in c.sync.takeover_calls if job == j]
        assert takeovers == ([(successor, 1)] if successor_up else [(successor, 1), (after, 2)])
        assert c.sync.coordinators[j] == (expected.index, expected.epoch)  # one coordinator
        done = table2.records[j].job.progress.completed_iterations
        await async_wait_until(
            lambda: table2.records[j].job.progress.completed_iterations > done + 3,
            timeout=20,
            what="progress under the next leader",
        )
        assert table2.records[j].state == S.JOB_STATE_RUNNING and c.workers(j) == 2
        assert len(c.sync.open_calls) == 1  # never re-opened from a checkpoint
    finally:
        if task2 is not None:
            await stop_task(task2)
        await stop_task(task)
        for r in (first, second):
            if r is not None:
                await r.peers.close()
        await c.stop()
        await store.close()
