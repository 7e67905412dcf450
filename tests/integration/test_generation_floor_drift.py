"""A shard's generation floor drifting above its coordinator's generation (issue 12), on real
processes: two shard processes, two learner processes (the digits MLP through the "grpc"
backend), this test as the scheduler.

Shard 1 is started with the test fault ``raise-floor@<k>`` (``shoal.contract.faults``): the
first SyncStep of iteration k that reaches it finds its floor raised to the running generation
+ 1, the coordinator (shard 0) not told, as the SetCoordinator bug behind the chaos suite's
livelock did. Shard 1 refuses every contribution of k as stale, with its floor in the
``shoal-generation-floor`` trailer; the learners report it with their next Boundary; the
coordinator asks shard 1 for its floor and re-issues k at it. The watchdog's probe is set to
30 s, so the learners' report is what ends the drift. Without the guard the coordinator
re-issues k in the same generation for ever (the learners log ``aborted; waiting for it to be
re-issued`` tens of times a second and nothing commits): the test fails on its bound."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.integration._param_sync_cluster import DataPlane, release
from tests.integration.test_elastic_training import (
    BATCH,
    assert_each_iteration_recorded_once,
    assert_matches_reference,
    iterations_per_epoch,
)
from tests.support import make_tokens, wait_until

DRIFT = "is above this coordinator's generation"


@pytest.mark.slow
def test_a_shards_floor_raised_above_the_running_generation_is_reissued_above_and_training_goes_on(
    tmp_path: Path,
):
    tokens = make_tokens(tmp_path / "tokens")
    plane = DataPlane(tmp_path, tmp_path / "tokens", tokens, shards=2)
    job, epochs = "floordrift", 1
    ipe = iterations_per_epoch()
    total = epochs * ipe
    at = ipe // 2
    try:
        plane.start_shards(
            ["--shard-probe", "30"], env={1: {"SHOAL_TEST_FAULT": f"raise-floor@{at}"}}
        )
        plane.open_job(job, batch=BATCH, epochs=epochs, checkpoint_every=1)
        # Both warm before either joins (a slow start under load let f1 join after `at`).
        gate = tmp_path / "floor.gate"
        learners = {
            n: plane.start_learner(job, n, epochs=epochs, batch=BATCH, delay=0.02, gate=gate)
            for n in ("f0", "f1")
        }
        release(list(learners.values()), gate, timeout=120)
        plane.shards[1].wait_for("test fault raise-floor", timeout=240)
        fired = time.monotonic()
        # Liveness, not speed: without the guard nothing commits past `at` ever again.
        wait_until(
            lambda: plane.progress(job).progress.completed_iterations > at,
            timeout=120,
            interval=0.1,
            what=f"iteration {at} committed after shard 1's floor drifted (stalled: "
            + " | ".join(p.text()[-800:] for p in learners.values())
            + ")",
        )
        went_on = time.monotonic() - fired
        for name, proc in learners.items():
            assert proc.wait(timeout=300) == 0, f"{name}:\n{proc.text()[-3000:]}"
        assert plane.progress(job).done
    finally:
        plane.kill_all()
    coordinator = plane.shards[0].text()
    drifts = [line for line in coordinator.splitlines() if DRIFT in line]
    assert len(drifts) == 1, coordinator[-3000:]  # said once, with the shard and both numbers
    assert "shard 1's generation floor" in drifts[0]
    assert f"iteration {at} aborted and re-issued at generation" in drifts[0]
    assert "raised to" in plane.shards[1].text()
    assert_each_iteration_recorded_once(plane, job, total)
    assert_matches_reference(plane.final_model(job), epochs)
    for name, proc in learners.items():
        steps = [r["step"] for r in plane.history(name)["history"]]
        # none lost, none run twice (a learner that joined late starts after 0)
        assert steps == list(range(steps[0], total)) and steps[0] <= at, (name, steps)
        aborted = proc.text().count("aborted; waiting for it to be re-issued")
        assert 1 <= aborted < 10, (name, aborted, proc.text()[-3000:])
        assert "ERROR_REASON_STALE_GENERATION" in proc.text()
    print(f"iteration {at} committed {went_on:.1f} s after shard 1's floor drifted")
