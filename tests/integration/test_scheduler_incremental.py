"""The reconcile loop with the incremental planner wired in (reconcile/placing.py), over the
fakes of tests/integration/fakes.py: events drive the decisions through the planner, the
periodic full cycle catches a dropped event, logs the jobs it diverged on and acts on the full
plan; ``incremental_placement=False`` runs the full plan every cycle."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from shoal.runtime.store import MemoryStore
from shoal.scheduler.artifacts import Storage
from shoal.scheduler.reconcile.inventory import Inventory
from shoal.scheduler.store import JobTable
from tests.integration.fakes import FakeCluster, chunked
from tests.integration.test_scheduler import ALICE, Loop, spec, start_loop, stop_task


async def _loop(tmp_path: Path, *, incremental: bool) -> Loop:
    cluster = await FakeCluster.start(hosts=2, gpus=4, shards=2)
    store = MemoryStore()
    storage = Storage((tmp_path / "storage").as_uri())
    table, reconciler, api, task = await start_loop(
        store, cluster, storage, incremental=incremental
    )
    info = await api.artifacts.upload(
        name="model", declared_size=0, declared_sha256="", chunks=chunked(b"t" * 64), owner=ALICE
    )
    return Loop(cluster, store, table, reconciler, api, info.artifact_id, task)


async def _close(loop: Loop) -> None:
    await stop_task(loop.task)
    await loop.reconciler.peers.close()
    await loop.cluster.stop()
    await loop.store.close()


@pytest.fixture
async def incremental(tmp_path: Path) -> AsyncIterator[Loop]:
    loop = await _loop(tmp_path, incremental=True)
    yield loop
    await _close(loop)


@pytest.fixture
async def full_only(tmp_path: Path) -> AsyncIterator[Loop]:
    loop = await _loop(tmp_path, incremental=False)
    yield loop
    await _close(loop)


async def test_events_decide_through_the_planner_and_the_safety_net_catches_a_dropped_host_event(
    incremental: Loop, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    loop = incremental
    placing = loop.reconciler.placing
    # Submit, grow, a second job (shrink by retire, exits), a priority change, a cancel: every
    # trigger cycle in between is decided by the planner, never in disagreement with the full
    # plan of the safety net (0.1 s here).
    j1 = (await loop.api.submit(ALICE, "", spec(loop.artifact, max_workers=12))).job_id
    await loop.shares({j1: 8}, "job 1 on the 8 devices")
    j2 = (await loop.api.submit(ALICE, "", spec(loop.artifact))).job_id
    await loop.shares({j1: 4, j2: 4}, "4/4")
    await loop.api.update(ALICE, j2, priority=15000, max_workers=None, request_id="u1")
    await loop.shares({j1: 2, j2: 6}, "priority 2/6")
    await loop.api.cancel(ALICE, j2, "c1")
    await loop.shares({j1: 8}, "job 1 back on 8 after the cancel")
    assert placing.incremental_cycles > 0
    assert placing.divergences == 0, placing.last_divergence
    assert placing.planner is not None

    # A host joins but its event never reaches the planner (dropped on purpose): the planner
    # does not know h3's devices, so its decisions leave job 1 at 8. The next safety-net
    # cycle's full plan grows job 1 onto h3; the divergence is logged with the job's id.
    real = Inventory.take_changed

    def dropping(self: Inventory) -> set[str]:
        return real(self) - {"h3"}

    monkeypatch.setattr(Inventory, "take_changed", dropping)
    caplog.set_level(logging.WARNING, logger="shoal.scheduler.reconcile.placing")
    before = placing.divergences
    await loop.cluster.add_host("h3", 4)
    await loop.shares({j1: 12}, "job 1 on 12 after the safety net")
    assert placing.divergences == before + 1  # logged once, then resynced
    assert j1 in placing.last_divergence
    warnings = [r.getMessage() for r in caplog.records if "diverged" in r.getMessage()]
    assert len(warnings) == 1 and j1 in warnings[0]
    # Resynced: later decisions come from the planner again, in agreement with the full plan.
    cycles = placing.incremental_cycles
    await loop.api.update(ALICE, j1, priority=None, max_workers=10, request_id="u2")
    await loop.shares({j1: 10}, "job 1 shrunk to its new max")
    await loop.until(lambda: placing.incremental_cycles > cycles, "a planner decision")
    assert placing.divergences == before + 1


async def test_with_incremental_placement_off_every_cycle_runs_the_full_plan(
    full_only: Loop,
) -> None:
    loop = full_only
    j = (await loop.api.submit(ALICE, "", spec(loop.artifact, max_workers=6))).job_id
    await loop.shares({j: 6})
    placing = loop.reconciler.placing
    assert placing.incremental_cycles == 0 and placing.full_cycles > 0
    assert placing.planner is None


async def test_a_record_changed_without_being_written_or_marked_is_caught_by_the_safety_net(
    incremental: Loop, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Incremental cycles observe only the jobs the job table's dirty set (and the exits,
    workers, changed hosts) name. A learner record dropped in memory, its job's dirty mark
    lost (the table's notes of j1 are dropped on purpose: the job's progress saves would
    otherwise mark it), is invisible to them; the next full cycle sees it, logs the job once
    (both the observed view and the planner differ) and acts on the full observation: the
    learner's allocation is an orphan, released, and the job grows back onto the device."""
    loop = incremental
    j1 = (await loop.api.submit(ALICE, "", spec(loop.artifact, max_workers=8))).job_id
    j2 = (await loop.api.submit(ALICE, "", spec(loop.artifact, max_workers=8))).job_id
    await loop.shares({j1: 4, j2: 4}, "4/4")
    placing, observing = loop.reconciler.placing, loop.reconciler.observing
    assert placing.divergences == 0 and observing.divergences == 0
    caplog.set_level(logging.WARNING, logger="shoal.scheduler.reconcile")
    real = JobTable.take_dirty

    def dropping(self: JobTable) -> set[str]:
        return real(self) - {j1}

    monkeypatch.setattr(JobTable, "take_dirty", dropping)
    record = loop.table.records[j1]
    dropped = next(iter(record.learners))
    del record.learners[dropped]  # bypasses the table: no write, no mark
    await loop.until(lambda: observing.divergences == 1, "the safety net's full cycle")
    monkeypatch.undo()
    assert observing.last_divergence == [j1]
    assert placing.divergences == 1
    assert any(j1 in item for item in placing.last_divergence), placing.last_divergence
    warnings = [r.getMessage() for r in caplog.records if "diverged" in r.getMessage()]
    assert len(warnings) == 2 and all(j1 in w for w in warnings)  # observation, planner
    # Acted on: the allocation no learner holds is released (an orphan) and the full plan
    # places a new learner of j1 on the freed device (the fake agent still runs the dropped
    # one there, so it may stay STARTING: the device, not the process, is the point here).
    await loop.until(
        lambda: (
            len(record.learners) == 4
            and not any(a.learner_id == dropped for a in loop.reconciler.inventory.ledger.values())
        ),
        "the orphan released, a new learner of j1 on its device",
    )
    assert observing.divergences == 1 and placing.divergences == 1
