"""The coordinator role fails over (issue 12, item 2), on real processes: three shard
processes with replication on (the default), two learner processes (the digits MLP through the
"grpc" backend), this test acting as the scheduler (it calls TakeOverJob on the successor, as
the scheduler does once the coordinator is unreachable for its grace).

Shard 0, the job's coordinator, is SIGKILLed mid-epoch, before any checkpoint. Shard 1 takes
the role over at coordinator epoch 1: the shards left are fenced (a call from epoch 0 is
refused), the learners find the new coordinator through the other shards (FindCoordinator)
without a restart, re-join, and the lost shard's slice is promoted from its replica on shard 1.
No rewind: the job completes, each iteration is recorded once, no learner completes an
iteration twice, and the final model equals single-process training within 1e-5.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import grpc
import pytest

from shoal.v1 import (
    parameter_sync_service_pb2 as ps_pb2,
    parameter_sync_service_pb2_grpc as ps_grpc,
)
from tests.integration._param_sync_cluster import DataPlane
from tests.integration.test_elastic_training import (
    BATCH,
    assert_each_iteration_recorded_once,
    assert_matches_reference,
    iterations_per_epoch,
)
from tests.support import make_tokens, wait_until


@pytest.mark.slow
def test_a_killed_coordinator_shard_is_taken_over_without_a_rewind(tmp_path: Path):
    tokens = make_tokens(tmp_path / "tokens")
    plane = DataPlane(tmp_path, tmp_path / "tokens", tokens, shards=3)
    job, epochs = "coordloss", 2
    ipe = iterations_per_epoch()
    total = epochs * ipe
    try:
        plane.start_shards(["--shard-probe", "0.5"])
        plane.open_job(job, batch=BATCH, epochs=epochs, checkpoint_every=1)
        learners = {
            n: plane.start_learner(job, n, epochs=epochs, batch=BATCH, delay=0.02)
            for n in ("c0", "c1")
        }
        wait_until(
            lambda: plane.progress(job).progress.completed_iterations >= ipe // 2,
            timeout=180,
            what=f"{ipe // 2} iterations (before any checkpoint)",
        )
        plane.shards[0].kill()  # the coordinator (and a slice, whose replica is on shard 1)
        reply = plane.take_over(
            job, 1, lost=0, epoch=1, batch=BATCH, epochs=epochs, checkpoint_every=1
        )
        taken_at = reply.progress.completed_iterations
        assert 0 < taken_at < total

        # Fenced: a coordinator call from the old epoch is refused by the shards left.
        channel = grpc.insecure_channel(plane.addresses[2])
        try:
            with pytest.raises(grpc.RpcError) as refused:
                ps_grpc.ParameterSyncServiceStub(channel).ResolveIteration(
                    ps_pb2.ResolveIterationRequest(
                        job_id=job, generation=1, iteration=taken_at, commit=True
                    ),
                    metadata=(("authorization", f"Bearer {tokens['service']}"),),
                    timeout=30,
                )
            found = ps_grpc.ParameterSyncServiceStub(channel).FindCoordinator(
                ps_pb2.FindCoordinatorRequest(job_id=job),
                metadata=(("authorization", f"Bearer {tokens['service']}"),),
                timeout=30,
            )
        finally:
            channel.close()
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "coordinator_epoch (0)" in refused.value.details()
        assert (found.coordinator_address, found.coordinator_epoch) == (plane.addresses[1], 1)

        for name, proc in learners.items():
            assert proc.wait(timeout=300) == 0, f"{name}:\n{proc.text()[-3000:]}"
        assert plane.progress(job).done
    finally:
        plane.kill_all()

    assert_taken_over_without_loss(plane, job, learners, epochs)


@pytest.mark.slow
def test_a_coordinator_lost_in_the_middle_of_a_commit_is_taken_over_past_that_commit(
    tmp_path: Path,
):
    """The coordinator shard delivers iteration k's commit to shard 1 only and is SIGKILLed
    (the test fault ``commit-partial``, shoal.contract.faults): shard 1 stepped k, shard 2
    still holds k's sums, the lost shard's replica (on shard 1) holds them too. The successor
    commits k on shard 2 (the old coordinator had decided it), promotes the replica settled at
    k + 1, and the job goes on from k + 1: nothing committed is lost or run twice."""
    tokens = make_tokens(tmp_path / "tokens")
    plane = DataPlane(tmp_path, tmp_path / "tokens", tokens, shards=3)
    job, epochs = "midcommit", 1
    ipe = iterations_per_epoch()
    at = ipe // 2
    try:
        # Groups of ~0.5 KiB: every commit steps its slice in several groups (shard.py,
        # step_groups), so the takeover is tested past a grouped, progressively answered one.
        plane.start_shards(
            ["--shard-probe", "0.5", "--step-group-mb", "0.0005"],
            env={0: {"SHOAL_TEST_FAULT": f"commit-partial@{at}"}},
        )
        plane.open_job(job, batch=BATCH, epochs=epochs, checkpoint_every=1)
        learners = {
            n: plane.start_learner(job, n, epochs=epochs, batch=BATCH, delay=0.02)
            for n in ("m0", "m1")
        }
        assert plane.shards[0].popen.wait(timeout=300) == -signal.SIGKILL
        assert "test fault commit-partial: SIGKILL" in plane.shards[0].text()
        reply = plane.take_over(
            job, 1, lost=0, epoch=1, batch=BATCH, epochs=epochs, checkpoint_every=1
        )
        assert reply.progress.completed_iterations == at + 1  # past the partial commit
        for name, proc in learners.items():
            assert proc.wait(timeout=300) == 0, f"{name}:\n{proc.text()[-3000:]}"
        assert plane.progress(job).done
    finally:
        plane.kill_all()
    assert "committed it on shard(s) [2] too" in plane.shards[1].text()
    assert_taken_over_without_loss(plane, job, learners, epochs)


@pytest.mark.slow
def test_a_coordinator_lost_after_an_earlier_promotion_is_taken_over_without_a_rewind(
    tmp_path: Path,
):
    """Shard 2 is SIGKILLed and stays down: its slice is promoted onto its backup, shard 0 (the
    coordinator), and re-replicated. Then shard 0 is SIGKILLed too: the sharding is not the
    hash rule's any more and shard 2 does not answer. The successor (shard 1) learns the
    sharding from the shards left (SetCoordinator's tensor_names: shard 0 held its tensors and
    shard 2's), promotes shard 0's slice from its replica, and the job ends on shard 1 alone,
    with nothing committed lost."""
    tokens = make_tokens(tmp_path / "tokens")
    plane = DataPlane(tmp_path, tmp_path / "tokens", tokens, shards=3)
    job, epochs = "promoted", 1
    ipe = iterations_per_epoch()
    total = epochs * ipe
    try:
        plane.start_shards(["--shard-probe", "0.5"])
        plane.open_job(job, batch=BATCH, epochs=epochs, checkpoint_every=1)
        learners = {
            n: plane.start_learner(job, n, epochs=epochs, batch=BATCH, delay=0.02)
            for n in ("q0", "q1")
        }
        wait_until(
            lambda: plane.progress(job).progress.completed_iterations >= ipe // 3,
            timeout=180,
            what=f"{ipe // 3} iterations",
        )
        plane.shards[2].kill()
        plane.shards[0].wait_for("shard 0 promoted to hold the slice of shard 2", timeout=120)
        promoted_at = plane.progress(job).progress.completed_iterations
        wait_until(
            lambda: plane.progress(job).progress.completed_iterations >= promoted_at + 3,
            timeout=180,
            what="training on two shards",
        )
        plane.shards[0].kill()
        reply = plane.take_over(
            job, 1, lost=0, epoch=1, batch=BATCH, epochs=epochs, checkpoint_every=1
        )
        assert promoted_at < reply.progress.completed_iterations < total
        for name, proc in learners.items():
            assert proc.wait(timeout=300) == 0, f"{name}:\n{proc.text()[-3000:]}"
        assert plane.progress(job).done
    finally:
        plane.kill_all()
    assert "takeover: shard 2 is down" in plane.shards[1].text()
    assert_taken_over_without_loss(plane, job, learners, epochs)


def wait_for_the_grace(plane: DataPlane, index: int, job: str, *, grace: float) -> None:
    """Wait as the scheduler does before a takeover: until shard ``index`` (the job's
    coordinator) has answered no progress poll for ``grace`` seconds."""
    channel = grpc.insecure_channel(plane.addresses[index])
    stub = ps_grpc.ParameterSyncServiceStub(channel)
    metadata = (("authorization", f"Bearer {plane.tokens['service']}"),)
    silent_since: float | None = None

    def silent_for_the_grace() -> bool:
        nonlocal silent_since
        try:
            stub.GetJobProgress(
                ps_pb2.GetJobProgressRequest(job_id=job), metadata=metadata, timeout=0.5
            )
        except grpc.RpcError:
            silent_since = silent_since or time.monotonic()
            return time.monotonic() - silent_since >= grace
        silent_since = None
        return False

    try:
        wait_until(silent_for_the_grace, timeout=60, interval=0.2, what="the coordinator grace")
    finally:
        channel.close()


def assert_taken_over_without_loss(plane: DataPlane, job: str, learners: dict, epochs: int) -> None:
    total = epochs * iterations_per_epoch()
    assert_each_iteration_recorded_once(plane, job, total)
    assert_matches_reference(plane.final_model(job), epochs)
    successor_log = plane.shards[1].text()
    assert "took over as coordinator (epoch 1) from lost shard 0" in successor_log
    assert "shard 1 promoted to hold the slice of shard 0" in successor_log, successor_log[-3000:]
    assert "rewound to the checkpoint" not in successor_log
    for name, proc in learners.items():
        steps = [r["step"] for r in plane.history(name)["history"]]
        assert steps[-1] == total - 1 and steps == sorted(set(steps)), (name, steps)
        assert "coordinator moved" in proc.text()


@pytest.mark.slow
def test_a_paused_coordinator_that_wakes_after_the_takeover_cannot_commit(tmp_path: Path):
    """SIGSTOP of the coordinator for longer than the takeover and the promotion of its
    slice, then SIGCONT. The takeover comes, as from the scheduler, once the coordinator has
    not answered for the grace (2 s): by then every learner waits on it (in Boundary, whose
    connection stays open, or in a stream the new coordinator aborts, then Boundary), and
    nothing but the learners' liveness probes (FindCoordinator on the other shards while a
    call hangs) gets them to the new coordinator; the promotion of the frozen shard's slice
    waits for their re-join. Once awake, the old coordinator is refused by the shards
    (fenced) and steps down. The job completes as if the old one had died."""
    tokens = make_tokens(tmp_path / "tokens")
    plane = DataPlane(tmp_path, tmp_path / "tokens", tokens, shards=3)
    job, epochs = "coordpause", 2
    ipe = iterations_per_epoch()
    try:
        plane.start_shards(["--shard-probe", "0.5"])
        plane.open_job(job, batch=BATCH, epochs=epochs, checkpoint_every=1)
        learners = {
            n: plane.start_learner(job, n, epochs=epochs, batch=BATCH, delay=0.02)
            for n in ("p0", "p1")
        }
        wait_until(
            lambda: plane.progress(job).progress.completed_iterations >= ipe // 2,
            timeout=180,
            what=f"{ipe // 2} iterations",
        )
        old = plane.shards[0]
        old.popen.send_signal(signal.SIGSTOP)
        try:
            wait_for_the_grace(plane, 0, job, grace=2.0)
            plane.take_over(job, 1, lost=0, epoch=1, batch=BATCH, epochs=epochs, checkpoint_every=1)
            taken = time.monotonic()
            # Its slice is promoted while it sleeps (it does not answer the probes), once the
            # learners re-joined the new coordinator.
            plane.shards[1].wait_for("promoted to hold the slice of shard 0", timeout=120)
            promoted_after = time.monotonic() - taken
        finally:
            old.popen.send_signal(signal.SIGCONT)
        for name, proc in learners.items():
            assert proc.wait(timeout=300) == 0, f"{name}:\n{proc.text()[-3000:]}"
        assert plane.progress(job).done
        assert old.popen.poll() is None  # it lives on, and harms nothing
    finally:
        plane.kill_all()
    # Once it answered, the new coordinator told it the role moved (SetCoordinator epoch 1).
    assert "stepping down (epoch 0)" in old.text(), old.text()[-3000:]
    # Every learner was stuck on the frozen coordinator and got out by its liveness probes.
    for name, proc in learners.items():
        assert "which hangs, after the role moved" in proc.text(), (name, proc.text()[-3000:])
    print(f"slice promoted {promoted_after:.1f} s after the takeover")

    assert_taken_over_without_loss(plane, job, learners, epochs)


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP: state ``T`` in /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.slow
def test_a_coordinator_killed_mid_checkpoint_and_restarted_is_restored_and_training_goes_on(
    tmp_path: Path,
):
    """The chaos suite's livelock (issue 12), forced: the coordinator shard stops itself with
    its checkpoint file written to its temporary name (the test fault ``stop-before-rename``),
    shard 1 takes the role over once it has not answered for the grace, and the stopped shard
    is SIGKILLed and started again at once (before its backup could be promoted): its slice is
    restored onto it from the replica on shard 1. Then the successor's SetCoordinator reaches
    the restored shard again and again while iterations run (as its deposer did, by a race, in
    the chaos suite). Training goes on: the job completes, each iteration recorded once, the
    model equal to single-process training; no learner has an iteration aborted over and over.
    (Before the fix the shard dropped the running iteration's sums and refused it as stale
    for ever: the livelock of issue 12.)"""
    tokens = make_tokens(tmp_path / "tokens")
    plane = DataPlane(tmp_path, tmp_path / "tokens", tokens, shards=2)
    job, epochs = "ckptrestore", 2
    trigger = tmp_path / "trigger"
    trigger.write_text("shard-0.safetensors")
    try:
        plane.start_shards(
            ["--shard-probe", "0.5", "--promote-after", "120"],
            env={0: {"SHOAL_TEST_FAULT": f"stop-before-rename@{trigger}"}},
        )
        plane.open_job(job, batch=BATCH, epochs=epochs, checkpoint_every=1)
        # r1 is slower: the shards hold r0's sums of each iteration most of the time (as with
        # learners on unequal hosts), the window in which the livelock began.
        learners = {
            n: plane.start_learner(job, n, epochs=epochs, batch=BATCH, delay=delay)
            for n, delay in (("r0", 0.02), ("r1", 0.3))
        }
        old = plane.shards[0]
        wait_until(lambda: _stopped(old.popen.pid), timeout=240, what="shard 0 stopped mid-write")
        trigger.unlink()
        assert list((plane.job_dir(job) / "checkpoints").rglob("shard-0.safetensors.tmp-*"))
        wait_for_the_grace(plane, 0, job, grace=2.0)
        plane.take_over(job, 1, lost=0, epoch=1, batch=BATCH, epochs=epochs, checkpoint_every=1)
        old.kill()
        plane.restart_shard(0)
        plane.shards[1].wait_for("restored from its replicas", timeout=120)
        # The successor's deposer reaching the restored shard while an iteration runs (the
        # race that made the livelock; here forced): the same SetCoordinator, many times.
        at = plane.progress(job).progress.completed_iterations
        total = epochs * iterations_per_epoch()
        target = min(at + 5, total)
        channel = grpc.insecure_channel(plane.addresses[0])
        deadline = time.monotonic() + 120
        pokes = 0
        try:
            stub = ps_grpc.ParameterSyncServiceStub(channel)
            while (
                plane.progress(job).progress.completed_iterations < target
                and time.monotonic() < deadline
            ):
                stub.SetCoordinator(
                    ps_pb2.SetCoordinatorRequest(
                        job_id=job,
                        coordinator_address=plane.addresses[1],
                        coordinator_epoch=1,
                        min_generation=1 << 32,
                    ),
                    metadata=(("authorization", f"Bearer {tokens['service']}"),),
                    timeout=30,
                )
                pokes += 1
                time.sleep(0.05)  # the pokes' rate (a load generator; the loop waits on progress)
        finally:
            channel.close()
        done = plane.progress(job).progress.completed_iterations
        assert done >= target, (
            f"no iteration past {done} in 120 s of {pokes} SetCoordinator calls: "
            + " | ".join(p.text()[-600:] for p in learners.values())
        )
        for name, proc in learners.items():
            assert proc.wait(timeout=300) == 0, f"{name}:\n{proc.text()[-3000:]}"
        assert plane.progress(job).done
    finally:
        plane.kill_all()
    assert_each_iteration_recorded_once(plane, job, total)
    assert_matches_reference(plane.final_model(job), epochs)
    for name, proc in learners.items():
        aborted = proc.text().count("aborted; waiting for it to be re-issued")
        assert aborted < 10, (name, aborted, proc.text()[-3000:])
        steps = [r["step"] for r in plane.history(name)["history"]]
        assert steps[-1] == total - 1 and steps == sorted(set(steps)), (name, steps)
