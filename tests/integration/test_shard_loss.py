"""A parameter-sync shard lost mid-training never fails the job (issue 12), on real processes:
two shard processes, two learner processes (the digits MLP through the "grpc" backend), this
test acting as the scheduler.

The non-coordinator shard is SIGKILLed mid-epoch: the coordinator's probe reports the job
recovering (GetJobProgress says why), the learners stay up and wait at their boundary. The
shard is started again on its address 5 s later, holding nothing. With replication (the
default) the coordinator restores its slice from the replica on the other shard, and the
replica it kept from that shard's primary: no committed iteration is run again. With
``--replication off`` it rewinds every shard to the latest checkpoint. Either way the learners
pull and go on, the job completes, each iteration is recorded once, and the final model equals
single-process training within the equivalence tests' 1e-5.
"""

from __future__ import annotations

import hashlib
import json
import signal
import time
from pathlib import Path

import pytest

from tests.integration._param_sync_cluster import DataPlane
from tests.integration.test_elastic_training import (
    BATCH,
    assert_each_iteration_recorded_once,
    assert_matches_reference,
    assert_shares_tile_every_batch,
    iterations_per_epoch,
)
from tests.support import make_tokens, wait_until


@pytest.mark.slow
@pytest.mark.parametrize("replication", ["on", "off"])
def test_a_killed_non_coordinator_shard_restarted_5s_later_never_fails_the_job(
    tmp_path: Path, replication: str
):
    tokens = make_tokens(tmp_path / "tokens")
    plane = DataPlane(tmp_path, tmp_path / "tokens", tokens)
    job, epochs = "shardloss", 2
    ipe = iterations_per_epoch()
    total = epochs * ipe
    try:
        # A long promotion grace: the shard is restored in place when it is back, rather
        # than replaced by its backup (the other test).
        # Groups of ~0.5 KiB: every commit steps its slice in several groups (shard.py,
        # step_groups), so a shard is lost and restored between grouped commits too.
        plane.start_shards(
            [
                *("--shard-probe", "0.5", "--replication", replication),
                *("--promote-after", "120", "--step-group-mb", "0.0005"),
            ]
        )
        plane.open_job(job, batch=BATCH, epochs=epochs, checkpoint_every=1)
        learners = {
            n: plane.start_learner(job, n, epochs=epochs, batch=BATCH, delay=0.02)
            for n in ("s0", "s1")
        }
        checkpoints = plane.job_dir(job) / "checkpoints"
        wait_until(
            lambda: plane.progress(job).progress.completed_iterations >= ipe + 3,
            timeout=180,
            what=f"{ipe + 3} iterations (past the first checkpoint)",
        )
        assert (checkpoints / "latest").read_text() == f"iter-{ipe}"
        plane.shards[1].kill()  # SIGKILL: its slice (parameters, optimizer state) is gone
        killed_at = time.monotonic()

        def recovering() -> bool:
            reply = plane.progress(job)
            return reply.recovering and "shard 1" in reply.recovery_reason

        wait_until(recovering, timeout=60, what="the job reported recovering from shard 1")
        stalled = plane.progress(job).progress.completed_iterations
        assert all(p.popen.poll() is None for p in learners.values())  # nobody exited
        # Down for about 5 s (the scenario), then back, holding nothing.
        wait_until(lambda: time.monotonic() - killed_at >= 5, timeout=10, what="5 s down")
        assert plane.progress(job).progress.completed_iterations == stalled  # nothing commits
        plane.restart_shard(1)
        wait_until(lambda: not plane.progress(job).recovering, timeout=120, what="the rewind")
        for name, proc in learners.items():
            assert proc.wait(timeout=300) == 0, f"{name}:\n{proc.text()[-3000:]}"
    finally:
        plane.kill_all()

    assert_each_iteration_recorded_once(plane, job, total)
    assert_matches_reference(plane.final_model(job), epochs)
    coordinator_log = plane.shards[0].text()
    for name in learners:
        history = plane.history(name)
        steps = [r["step"] for r in history["history"]]
        assert steps[-1] == total - 1
        # On the lanes (same host), the syncs went on the trainer's thread: the kill met them.
        assert history["direct_syncs"] > 0, name
        if replication == "on":  # zero committed iterations lost: none completed twice
            # (a learner whose answer of a committed iteration was cut by the kill does not
            # count it as completed; it pulls the parameters after the recovery)
            assert steps == sorted(set(steps)), (name, steps)
        else:
            assert set(steps) == set(range(steps[0], total))
    if replication == "on":
        assert "restored from its replicas" in coordinator_log, coordinator_log[-3000:]
        assert "rewound to the checkpoint" not in coordinator_log
    else:
        assert "rewound to the checkpoint after" in coordinator_log, coordinator_log[-3000:]


@pytest.mark.slow
def test_a_non_coordinator_shard_that_never_comes_back_is_replaced_by_its_backup(tmp_path: Path):
    """SIGKILL, and no restart (its host is gone): after the probe's grace the backup takes
    the lost slice over from its replica, the learners re-route to it without a restart, and
    no committed iteration is run again. The two shards share this host, so the replica
    defers its steps (docs/data-plane.md, "The replica's steps deferred"): the
    kill comes after its first snapshot, most likely with sums kept unstepped since (a
    snapshot comes every 4 commits), which the promotion steps."""
    tokens = make_tokens(tmp_path / "tokens")
    plane = DataPlane(tmp_path, tmp_path / "tokens", tokens)
    job, epochs = "shardgone", 2
    ipe = iterations_per_epoch()
    total = epochs * ipe
    try:
        plane.start_shards(["--shard-probe", "0.5"])
        plane.open_job(job, batch=BATCH, epochs=epochs, checkpoint_every=1)
        learners = {
            n: plane.start_learner(job, n, epochs=epochs, batch=BATCH, delay=0.02)
            for n in ("g0", "g1")
        }
        wait_until(
            lambda: "replica of shard 1 kept here defers its steps" in plane.shards[0].text(),
            timeout=180,
            what="the first snapshot taken by shard 1's replica on shard 0",
        )
        wait_until(
            lambda: plane.progress(job).progress.completed_iterations >= ipe // 2,
            timeout=180,
            what=f"{ipe // 2} iterations (before any checkpoint)",
        )
        assert not (plane.job_dir(job) / "checkpoints" / "latest").exists()
        plane.shards[1].kill()
        for name, proc in learners.items():
            assert proc.wait(timeout=300) == 0, f"{name}:\n{proc.text()[-3000:]}"
    finally:
        plane.kill_all()

    assert_each_iteration_recorded_once(plane, job, total)
    assert_matches_reference(plane.final_model(job), epochs)
    coordinator_log = plane.shards[0].text()
    assert "shard 0 promoted to hold the slice of shard 1" in coordinator_log, coordinator_log[
        -3000:
    ]
    for name, proc in learners.items():
        steps = [r["step"] for r in plane.history(name)["history"]]
        assert steps[-1] == total - 1 and steps == sorted(set(steps)), (name, steps)
        assert "shards re-routed" in proc.text()


@pytest.mark.slow
def test_two_shards_lost_one_after_the_other_on_three_are_each_replaced_without_loss(
    tmp_path: Path,
):
    """Three shards. Shard 1 dies for good: shard 2 (its backup, another process) takes its
    slice over and the slices are re-replicated over shards 0 and 2. Then shard 2 dies too:
    shard 0 takes everything over from the new replicas. No committed iteration is lost."""
    tokens = make_tokens(tmp_path / "tokens")
    plane = DataPlane(tmp_path, tmp_path / "tokens", tokens, shards=3)
    job, epochs = "twolosses", 2
    ipe = iterations_per_epoch()
    total = epochs * ipe
    try:
        plane.start_shards(["--shard-probe", "0.5"])
        plane.open_job(job, batch=BATCH, epochs=epochs)
        learners = {
            n: plane.start_learner(job, n, epochs=epochs, batch=BATCH, delay=0.02)
            for n in ("t0", "t1")
        }

        def completed() -> int:
            return plane.progress(job).progress.completed_iterations

        wait_until(lambda: completed() >= 8, timeout=180, what="8 iterations")
        plane.shards[1].kill()
        wait_until(lambda: plane.progress(job).recovering, timeout=60, what="recovering")
        wait_until(
            lambda: not plane.progress(job).recovering and completed() >= ipe + 2,
            timeout=180,
            what="training again after the first loss, into epoch 1",
        )
        plane.shards[2].kill()
        for name, proc in learners.items():
            assert proc.wait(timeout=300) == 0, f"{name}:\n{proc.text()[-3000:]}"
    finally:
        plane.kill_all()

    assert_each_iteration_recorded_once(plane, job, total)
    assert_matches_reference(plane.final_model(job), epochs)
    coordinator_log = plane.shards[0].text()
    assert "shard 2 promoted to hold the slice of shard 1" in coordinator_log, coordinator_log[
        -3000:
    ]
    assert "shard 0 promoted to hold the slice of shard 2" in coordinator_log, coordinator_log[
        -3000:
    ]
    for name in learners:
        steps = [r["step"] for r in plane.history(name)["history"]]
        assert steps[-1] == total - 1 and steps == sorted(set(steps)), (name, steps)


def _shard_1_killed_by_fault(
    tmp_path: Path, job: str, point: str, iteration: int, learner_names: tuple[str, ...]
) -> DataPlane:
    """Two epochs of ``job`` on two shards with shard 1 armed to SIGKILL itself at the test
    fault ``point@iteration`` (shoal.contract.faults): it dies there, the learners finish,
    each iteration is recorded once and the final model is the single-process one. Returns
    the (stopped) plane for the caller's own checks."""
    tokens = make_tokens(tmp_path / "tokens")
    plane = DataPlane(tmp_path, tmp_path / "tokens", tokens)
    epochs = 2
    fault = f"{point}@{iteration}"
    try:
        plane.start_shards(["--shard-probe", "0.5"], env={1: {"SHOAL_TEST_FAULT": fault}})
        plane.open_job(job, batch=BATCH, epochs=epochs, checkpoint_every=1)
        learners = {
            n: plane.start_learner(job, n, epochs=epochs, batch=BATCH, delay=0.02)
            for n in learner_names
        }
        assert plane.shards[1].popen.wait(timeout=300) == -signal.SIGKILL
        assert f"test fault {point}: SIGKILL" in plane.shards[1].text()
        for name, proc in learners.items():
            assert proc.wait(timeout=300) == 0, f"{name}:\n{proc.text()[-3000:]}"
    finally:
        plane.kill_all()
    assert_each_iteration_recorded_once(plane, job, epochs * iterations_per_epoch())
    assert_matches_reference(plane.final_model(job), epochs)
    return plane


@pytest.mark.slow
def test_a_primary_killed_once_its_snapshot_was_answered_loses_nothing(tmp_path: Path):
    """Shard 1 SIGKILLs itself right after shard 0, its backup on this host, answered a
    snapshot of its slice (the first at 8 or more completed iterations: the test fault
    ``snapshot-sent``), possibly before the backup took it out of the dead primary's segment
    (docs/data-plane.md, "The replica's steps deferred"). The backup takes it from its
    mapping of the segment, settles the replica at the promotion (the sums of the iteration
    running, if that was committed), and the job completes with nothing lost and the
    single-process result."""
    plane = _shard_1_killed_by_fault(tmp_path, "snapkill", "snapshot-sent", 8, ("s0", "s1"))
    backup_log = plane.shards[0].text()
    assert "replica of shard 1 kept here defers its steps" in backup_log
    assert "shard 0 promoted to hold the slice of shard 1" in backup_log, backup_log[-3000:]
    assert "did not take a snapshot" not in backup_log


@pytest.mark.slow
def test_a_shard_killed_while_it_writes_a_checkpoint_leaves_no_partial_one_and_loses_nothing(
    tmp_path: Path,
):
    """Shard 1 SIGKILLs itself when asked to write its file of the epoch-1 checkpoint (the test
    fault ``save-shard``, shoal.contract.faults): the coordinator's checkpoint waits, the
    probe finds the shard lost, its backup takes its slice over, and that checkpoint is dropped,
    never taken for written (no manifest, ``latest`` never names it). The job completes with
    nothing committed lost, and its final checkpoint is whole."""
    job, ipe = "ckptkill", iterations_per_epoch()
    total = 2 * ipe
    plane = _shard_1_killed_by_fault(tmp_path, job, "save-shard", ipe, ("w0", "w1"))
    assert "shard 0 promoted to hold the slice of shard 1" in plane.shards[0].text()
    checkpoints = plane.job_dir(job) / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == f"iter-{total}"
    for directory in checkpoints.glob("iter-*"):
        manifest = directory / "manifest.json"
        if not manifest.exists():
            assert directory.name == f"iter-{ipe}", directory  # only the interrupted one
            continue
        for entry in json.loads(manifest.read_text())["shards"]:  # a manifest: whole
            data = (directory / entry["file"]).read_bytes()
            assert hashlib.sha256(data).hexdigest() == entry["sha256"], entry
    for name in ("w0", "w1"):
        steps = [r["step"] for r in plane.history(name)["history"]]
        assert steps[-1] == total - 1 and steps == sorted(set(steps)), (name, steps)


@pytest.mark.slow
def test_a_shard_killed_during_a_rescale_loses_nothing_and_the_shares_still_tile(
    tmp_path: Path,
):
    """Three learners are paused inside iteration 6; one is retired and a fourth has joined
    (both take effect at the next freeze) when shard 1 is SIGKILLed. The iteration in flight
    is aborted, the slice promoted onto shard 0, and the survivors and the joiner re-run it in
    the new generation: COMPLETED, each iteration recorded once, every batch's shares tile it,
    equal to single-process training."""
    tokens = make_tokens(tmp_path / "tokens")
    plane = DataPlane(tmp_path, tmp_path / "tokens", tokens)
    job, epochs = "rescalekill", 1
    total = epochs * iterations_per_epoch()
    pauses = tmp_path / "pauses"
    pauses.mkdir()
    first, later = ["k0", "k1", "k2"], ["k3"]
    gates = {n: tmp_path / f"{'first' if n in first else 'later'}.gate" for n in first + later}
    try:
        plane.start_shards(["--shard-probe", "0.5"])
        plane.open_job(job, batch=BATCH, epochs=epochs)
        procs = {
            n: plane.start_learner(
                job, n, epochs=epochs, batch=BATCH, gate=gates[n], pause_at="6", pause_dir=pauses
            )
            for n in first + later
        }
        for proc in procs.values():
            proc.wait_for("READY", timeout=120)
        gates["k0"].touch()
        for n in first:
            procs[n].wait_for("PAUSED at step 6", timeout=120)
        plane.retire(job, "k2")
        gates["k3"].touch()
        procs["k3"].wait_for("training", timeout=60)  # joined, waiting to be admitted
        plane.shards[1].kill()  # the rescale is pending: a retire and a joiner
        (pauses / "release-6").touch()
        for name, proc in procs.items():
            assert proc.wait(timeout=300) == 0, f"{name}:\n{proc.text()[-3000:]}"
    finally:
        plane.kill_all()

    assert plane.history("k2")["retired"]
    records = assert_each_iteration_recorded_once(plane, job, total)
    assert records[-1]["world_size"] == 3  # k0, k1 and the joiner k3
    assert_matches_reference(plane.final_model(job), epochs)
    assert_shares_tile_every_batch(plane, [*first, *later], range(total))
    assert "shard 0 promoted to hold the slice of shard 1" in plane.shards[0].text()
