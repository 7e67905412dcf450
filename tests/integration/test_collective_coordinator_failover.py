"""The coordinator role fails over in collective mode too (issue 12, items 1-2), on real
processes: two shard processes (shard 0 coordinates the job and hosts the rendezvous store),
two learner processes running the digits MLP through the "collective" backend (a gloo group on
CPU), this test acting as the scheduler (TakeOverJob on the successor with the job's sync mode,
as the scheduler does once the coordinator is unreachable for its grace).

Shard 0 is SIGKILLed mid-epoch, with its store. Shard 1 takes the role over at coordinator
epoch 1 and learns the job's state from the learners' re-Joins (their state step and whether
they hold the voted update of the iteration in flight): it commits that iteration or runs it
again (``shoal.param_sync.takeover_collective``), hosts the rendezvous, and the learners
re-form their group in place through its store, keeping model and optimizer. No rewind, no
learner restarted: the job completes, each iteration is recorded once, no learner completes
an iteration twice, and the final model equals single-process training within 1e-5.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from shoal.v1 import job_pb2
from tests.integration._param_sync_cluster import DataPlane
from tests.integration.test_coordinator_failover import wait_for_the_grace
from tests.integration.test_elastic_training import (
    BATCH,
    assert_each_iteration_recorded_once,
    assert_matches_reference,
    iterations_per_epoch,
)
from tests.support import make_tokens, wait_until


def _plane(tmp_path: Path) -> DataPlane:
    return DataPlane(tmp_path, tmp_path / "tokens", make_tokens(tmp_path / "tokens"), shards=2)


def _start(plane: DataPlane, job: str, names: tuple[str, ...], epochs: int) -> dict[str, Any]:
    """Two shards (shard 0 coordinates ``job`` and hosts its store), ``names`` collective
    learners imported, built and released together (paced, so a fault lands mid-epoch)."""
    gate = plane.tmp / "gate"
    plane.start_shards()
    plane.open_job(job, batch=BATCH, epochs=epochs, checkpoint_every=1)
    learners = {
        n: plane.start_learner(
            job, n, epochs=epochs, batch=BATCH, backend="collective", delay=0.05, gate=gate
        )
        for n in names
    }
    for proc in learners.values():
        proc.wait_for("READY", timeout=120)  # imported and built: the job runs paced
    gate.touch()
    return learners


def _take_over(plane: DataPlane, job: str, epochs: int) -> Any:
    """The scheduler's part: shard 1 takes the lost shard 0's role at coordinator epoch 1."""
    return plane.take_over(
        job,
        1,
        lost=0,
        epoch=1,
        batch=BATCH,
        epochs=epochs,
        checkpoint_every=1,
        sync_mode=job_pb2.SYNC_MODE_COLLECTIVE,
    )


@pytest.mark.slow
def test_a_killed_coordinator_shard_of_a_collective_job_is_taken_over_without_a_rewind(
    tmp_path: Path,
):
    plane = _plane(tmp_path)
    job, epochs = "collfail", 2
    ipe = iterations_per_epoch()
    total = epochs * ipe
    names = ("f0", "f1")
    try:
        learners = _start(plane, job, names, epochs)

        def both_training_past(k: int) -> bool:
            p = plane.progress(job).progress
            return p.world_size == 2 and p.completed_iterations >= k

        wait_until(lambda: both_training_past(ipe // 3), timeout=120, what="two learners training")
        plane.shards[0].kill()  # the coordinator and the rendezvous store
        killed = time.monotonic()
        reply = _take_over(plane, job, epochs)
        assert 0 < reply.progress.completed_iterations < total
        taken_at = plane.progress(job).progress.completed_iterations
        wait_until(
            lambda: plane.progress(job).progress.completed_iterations > taken_at + 1,
            timeout=120,
            what="training again after the takeover",
        )
        resumed_after = time.monotonic() - killed
        for name, proc in learners.items():
            assert proc.wait(timeout=300) == 0, f"{name}:\n{proc.text()[-3000:]}"
        assert plane.progress(job).done
    finally:
        plane.kill_all()

    successor_log = plane.shards[1].text()
    assert "took over as coordinator (epoch 1) from lost shard 0" in successor_log
    assert "collective takeover: continuing at iteration" in successor_log, successor_log[-3000:]
    assert "no learner holds the state" not in successor_log
    assert_each_iteration_recorded_once(plane, job, total)
    assert_matches_reference(plane.final_model(job), epochs)
    for name, proc in learners.items():
        history = plane.history(name)
        assert history["pid"] == proc.popen.pid  # not restarted
        formed = [g for g, _, _ in history["formations"]]
        assert formed == sorted(set(formed)) and formed[-1] >= 1 << 32, formed  # in place
        steps = [r["step"] for r in history["history"]]
        assert steps[-1] == total - 1 and steps == sorted(set(steps)), (name, steps)
        text = proc.text()
        assert "coordinator moved" in text and "rendezvous moved with the coordinator" in text
    decision = next(
        line for line in successor_log.splitlines() if "collective takeover: continuing" in line
    )
    print(f"training again {resumed_after:.1f} s after the kill; {decision.split('job ')[-1]}")


@pytest.mark.slow
def test_a_paused_coordinator_of_a_collective_job_is_left_and_steps_down_when_it_wakes(
    tmp_path: Path,
):
    """SIGSTOP of the coordinator shard (its store freezes with it) through the takeover, then
    SIGCONT: the learners, waiting on it, leave it through their liveness probes
    (FindCoordinator on the other shard names the successor), re-join the successor and
    re-form their group through its store; once awake, the old coordinator is told the role
    moved and steps down. The job completes as if it had died."""
    plane = _plane(tmp_path)
    job, epochs = "collpause", 2
    ipe = iterations_per_epoch()
    total = epochs * ipe
    try:
        learners = _start(plane, job, ("p0", "p1"), epochs)
        wait_until(
            lambda: (
                plane.progress(job).progress.world_size == 2
                and plane.progress(job).progress.completed_iterations >= ipe // 3
            ),
            timeout=120,
            what="two learners training",
        )
        old = plane.shards[0]
        old.popen.send_signal(signal.SIGSTOP)
        try:
            wait_for_the_grace(plane, 0, job, grace=2.0)
            _take_over(plane, job, epochs)
            plane.shards[1].wait_for("collective takeover: continuing at iteration", timeout=120)
        finally:
            old.popen.send_signal(signal.SIGCONT)
        for name, proc in learners.items():
            assert proc.wait(timeout=300) == 0, f"{name}:\n{proc.text()[-3000:]}"
        assert plane.progress(job).done
        assert old.popen.poll() is None  # it lives on, and harms nothing
        old.wait_for("stepping down (epoch 0)", timeout=60)
    finally:
        plane.kill_all()
    assert_each_iteration_recorded_once(plane, job, total)
    assert_matches_reference(plane.final_model(job), epochs)
    for name, proc in learners.items():
        history = plane.history(name)
        assert history["pid"] == proc.popen.pid
        steps = [r["step"] for r in history["history"]]
        assert steps[-1] == total - 1 and steps == sorted(set(steps)), (name, steps)
        assert "which hangs, after the role moved" in proc.text(), (name, proc.text()[-3000:])


@pytest.mark.slow
def test_a_coordinator_shard_killed_during_a_rescale_of_a_collective_job_loses_nothing(
    tmp_path: Path,
):
    """A shrink in flight when the coordinator dies: learner r2 is retired (RetireLearners)
    and shard 0 is SIGKILLed at once, so the retire may be lost with it. The scheduler tells
    a moved coordinator the retires again (``decide``: a moved job's RETIRING learners), as
    this test does after the takeover. r2 leaves at a boundary, the other two finish: no
    rewind, no learner restarted, each iteration recorded once, and the model equal to
    single-process training (the shares tile every batch whatever the world size)."""
    plane = _plane(tmp_path)
    job, epochs = "collshrink", 2
    ipe = iterations_per_epoch()
    total = epochs * ipe
    names = ("r0", "r1", "r2")
    try:
        learners = _start(plane, job, names, epochs)
        wait_until(
            lambda: (
                plane.progress(job).progress.world_size == 3
                and plane.progress(job).progress.completed_iterations >= ipe // 3
            ),
            timeout=120,
            what="three learners training",
        )
        plane.retire(job, "r2")
        plane.shards[0].kill()  # the coordinator and the rendezvous store, the retire pending
        _take_over(plane, job, epochs)
        plane.retire(job, "r2")  # told again to the new coordinator, as the scheduler does
        for name, proc in learners.items():
            assert proc.wait(timeout=300) == 0, f"{name}:\n{proc.text()[-3000:]}"
        assert plane.progress(job).done
    finally:
        plane.kill_all()
    assert_each_iteration_recorded_once(plane, job, total)
    assert_matches_reference(plane.final_model(job), epochs)
    for name, proc in learners.items():
        history = plane.history(name)
        assert history["pid"] == proc.popen.pid  # not restarted
        steps = [r["step"] for r in history["history"]]
        assert steps == sorted(set(steps)), (name, steps)  # no iteration completed twice
        if name == "r2":
            assert steps[-1] < total - 1, steps  # it left before the end
        else:
            assert steps[-1] == total - 1, (name, steps)
