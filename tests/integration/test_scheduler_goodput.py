"""The scheduler learns each job's throughput model from its progress polls (the reconcile
loop's hook into shoal.scheduler.goodput) and shows it in the Job."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

from shoal.runtime.election import LeaderElection
from shoal.runtime.etcd_server import EtcdServer
from shoal.runtime.store import EtcdStore
from shoal.scheduler.artifacts import Storage
from shoal.scheduler.goodput import GoodputTracker
from shoal.scheduler.policy import Policy, compute_shares
from shoal.scheduler.reconcile import ELECTION, decide
from shoal.scheduler.store import THROUGHPUT
from shoal.v1 import job_pb2
from tests.integration.fakes import FakeCluster, chunked
from tests.integration.test_scheduler import ALICE, Loop, loop, spec, start_loop, stop_task
from tests.support import async_wait_until

__all__ = ["loop"]  # the fixture, shared with test_scheduler.py


async def test_a_running_job_gets_a_throughput_model_from_its_progress(loop: Loop) -> None:
    j = (await loop.api.submit(ALICE, "g1", spec(loop.artifact))).job_id
    await loop.shares({j: 8}, "the job on 8 learners")

    def measured_at_8() -> bool:
        model = loop.job(j).throughput
        return any(p.world_size == 8 and p.observed for p in model.points)

    await loop.until(measured_at_8, "an iteration time measured at world size 8")
    model = loop.job(j).throughput
    assert [p.world_size for p in model.points] == list(range(1, 9))  # 1 .. max_workers
    at8 = next(p for p in model.points if p.world_size == 8)
    assert at8.samples_per_second > 0
    assert model.compute_seconds + model.overhead_seconds > 0
    await loop.until(
        lambda: loop.job(j).throughput.attained_device_seconds > 0, "attained service counted"
    )
    # The policy sees the model too (every active job's demand carries a curve).
    demands = loop.reconciler.goodput.annotate([])
    assert demands == []  # and a job that left the demands is forgotten
    assert loop.reconciler.goodput.model(j) is None


async def test_a_new_leader_goes_on_from_the_stored_models_and_decides_as_the_old_one(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    """The throughput models survive a failover: leader A learns two jobs' models from their
    progress (with the learners' compute/sync split: one compute-bound, one sync-bound) and
    stores them in a real etcd; A dies; leader B loads them when it wins the election, and
    the GOODPUT shares it computes are A's (a scheduler that forgot them, as before, shares
    the devices evenly)."""
    cluster = await FakeCluster.start(hosts=1, gpus=4, shards=1)
    store = EtcdStore(etcd.endpoints, timeout=3.0)
    storage = Storage((tmp_path / "storage").as_uri())
    first = LeaderElection(store, ELECTION, candidate_id="a:1", ttl=2.0)
    second = LeaderElection(store, ELECTION, candidate_id="b:2", ttl=2.0)
    lead_a = await first.campaign()
    table_a, rec_a, api_a, task_a = await start_loop(store, cluster, storage, leadership=lead_a)
    rec_a.config = replace(rec_a.config, progress_persist_s=0.1)
    tasks = [task_a]
    reconcilers = [rec_a]
    try:
        info = await api_a.artifacts.upload(
            name="m", declared_size=0, declared_sha256="", chunks=chunked(b"m" * 10), owner=ALICE
        )
        scales = (await api_a.submit(ALICE, "r1", spec(info.artifact_id))).job_id
        flat = (await api_a.submit(ALICE, "r2", spec(info.artifact_id))).job_id
        await async_wait_until(
            lambda: cluster.workers(scales) == 2 and cluster.workers(flat) == 2, what="2/2"
        )
        # What the learners report: nearly all of an iteration computing, or nearly all syncing
        # (set on the fake coordinator's progress, which the scheduler polls).
        tick = cluster.tick_interval
        for job_id, compute in ((scales, 0.95 * tick), (flat, 0.02 * tick)):
            progress = cluster.sync.jobs[job_id].progress
            progress.compute_seconds, progress.sync_seconds = compute, tick - compute

        async def stored(job_id: str) -> job_pb2.ThroughputState | None:
            kv = await store.get(THROUGHPUT + job_id)
            return None if kv is None else job_pb2.ThroughputState.FromString(kv.value)

        async def learned() -> bool:
            states = [await stored(j) for j in (scales, flat)]
            return all(s is not None and any(p.split_count >= 3 for p in s.samples) for s in states)

        await async_wait_until(learned, timeout=30, what="both models stored with a split")
        cluster.sync.tick = lambda: None  # type: ignore[method-assign]  # no more progress

        async def saved_all() -> bool:  # A's last observations are in etcd
            for j in (scales, flat):
                s, mine = await stored(j), rec_a.goodput.state(j)
                if s is None or mine is None or list(s.samples) != list(mine.samples):
                    return False
            return True

        await async_wait_until(saved_all, timeout=30, what="A's models all stored")
        base = decide.demands(table_a.records)

        def shares(tracker: GoodputTracker) -> dict[str, int]:
            demands = tracker.annotate(base)
            return dict(compute_shares(demands, 8, Policy.GOODPUT).shares)

        before = shares(rec_a.goodput)
        assert before[scales] > before[flat], before  # the decision follows the models
        assert shares(GoodputTracker()) == {scales: 4, flat: 4}  # what a forgetful one does

        # Leader A dies (its loop stops, its lease goes); B wins and loads the models.
        await stop_task(task_a)
        await lead_a.resign()
        lead_b = await asyncio.wait_for(second.campaign(), timeout=10)
        table_b, rec_b, api_b, task_b = await start_loop(store, cluster, storage, leadership=lead_b)
        tasks.append(task_b)
        reconcilers.append(rec_b)
        assert set(table_b.throughput) == {scales, flat}
        await async_wait_until(lambda: rec_b.goodput.jobs() == {scales, flat}, what="B leads")
        assert shares(rec_b.goodput) == before
        for j in (scales, flat):
            mine, theirs = rec_b.goodput.model(j), rec_a.goodput.model(j)
            assert mine is not None and theirs is not None
            assert mine.curve() == theirs.curve()

        # A job that ends takes its stored model with it.
        await api_b.cancel(ALICE, flat, "")

        async def forgotten() -> bool:
            return await stored(flat) is None and await stored(scales) is not None

        await async_wait_until(forgotten, timeout=15, what="the ended job's model deleted")
    finally:
        for task in tasks:
            await stop_task(task)
        for rec in reconcilers:
            await rec.peers.close()
        await cluster.stop()
        await store.close()
