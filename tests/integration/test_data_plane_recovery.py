"""Issue 12, the control plane's side, with real processes: a real etcd, the real services of
the local cluster under its supervisor (``ClusterSpec(supervise=True)``, what ``shoal cluster
up`` runs), real PyTorch learners (tests/e2e/tiny_model).

1. SIGKILL of the job's coordinator shard (``--coordinator-failover off``): the job says
   RECOVERING, naming the shard, within a bounded wait, and never "RUNNING" with no learner; the
   supervisor restarts the shard; the job resumes from its latest checkpoint by itself and goes
   on. (With failover on, the default, the next shard takes the role over: the last test.)
2. Then the whole parameter-sync tier is SIGKILLed: the same, from the latest checkpoint.
3. The job COMPLETES; its state history tells both recoveries.
"""

from __future__ import annotations

import contextlib
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from shoal.client import Client
from shoal.cluster.local import ClusterSpec, LocalCluster, RestartPolicy
from shoal.v1 import job_pb2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "tests" / "e2e" / "tiny_model"
S = job_pb2
PER_EPOCH = 7  # 448 samples, batch 64
EPOCHS = 30
# The recovery test's: enough that the job still has epochs to run when the tier comes back
# (else it may finish them while still RECOVERING, before its first committed iteration is
# seen: this model's iterations take milliseconds, and the second kill comes only once
# progress is seen).
RECOVER_EPOCHS = 100


def resumed_at(reason: str) -> int:
    """The iteration a recovered job resumed at (its RUNNING reason says it); a checkpoint's
    (one every epoch), never the start."""
    found = re.search(r"resumed at iteration (\d+)", reason)
    assert found, reason
    iteration = int(found.group(1))
    assert iteration > 0 and iteration % PER_EPOCH == 0, reason
    return iteration


class Watcher:
    """Samples the job through the public API and remembers every (state, learners, reason);
    also follows its WatchJob stream, so that a state held for less than a sampling period
    (a recovered job that finishes its last epochs within it) is seen all the same."""

    def __init__(self, client: Client, job_id: str) -> None:
        self.client = client
        self.job_id = job_id
        self.samples: list[tuple[float, int, int, str, int]] = []
        self._streamed: list[job_pb2.Job] = []  # every job WatchJob sent, in order
        self._checked = 0  # of them, those an until() looked at already
        self._lock = threading.Lock()
        threading.Thread(target=self._follow, daemon=True).start()

    def _follow(self) -> None:
        with contextlib.suppress(Exception):  # (the cluster going away ends it)
            for event in self.client.watch_job(self.job_id):
                with self._lock:
                    self._streamed.append(event.job)

    def _streamed_since(self) -> list[job_pb2.Job]:
        with self._lock:
            new, self._checked = self._streamed[self._checked :], len(self._streamed)
        return new

    def sample(self) -> job_pb2.Job:
        job = self.client.get_job(self.job_id)
        self.samples.append(
            (
                time.monotonic(),
                job.state,
                job.allocated_workers,
                job.state_reason,
                job.progress.completed_iterations,
            )
        )
        return job

    def until(self, condition, what: str, timeout: float = 240.0) -> job_pb2.Job:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while True:
            job = self.sample()
            for streamed in self._streamed_since():
                if condition(streamed):
                    return streamed
            if condition(job):
                return job
            if job.state in (S.JOB_STATE_FAILED, S.JOB_STATE_CANCELLED):
                pytest.fail(f"job {S.JobState.Name(job.state)}: {job.state_reason}")
            if time.monotonic() > deadline:
                pytest.fail(
                    f"timed out waiting for {what}; its states: {self.transitions()}; last: {job}"
                )
            time.sleep(0.2)

    def transitions(self) -> list[tuple[str, str]]:
        """Each (state, reason) the job passed through, as WatchJob told them."""
        seen: list[tuple[str, str]] = []
        with self._lock:
            for j in self._streamed:
                item = (S.JobState.Name(j.state), j.state_reason)
                if not seen or seen[-1] != item:
                    seen.append(item)
        return seen

    def running_without_learners_for(self) -> float:
        """The longest stretch the job said RUNNING with no learner allocated."""
        longest, since = 0.0, None
        for t, state, workers, _, _ in self.samples:
            if state == S.JOB_STATE_RUNNING and workers == 0:
                since = t if since is None else since
                longest = max(longest, t - since)
            else:
                since = None
        return longest


def test_a_killed_coordinator_shard_and_a_killed_tier_are_recovered_from_the_checkpoint(
    tmp_path: Path,
) -> None:
    spec = ClusterSpec(
        state_dir=tmp_path / "cluster",
        hosts=1,
        gpus_per_host=2,
        shards=2,
        replicas=1,
        host_lost_after_s=30.0,  # host loss is not what this is about (a loaded machine)
        supervise=True,
        # Long enough to see the job RECOVERING before the shard is back, short for the test.
        restart_policy=RestartPolicy(initial_backoff_s=3.0, max_backoff_s=6.0),
        scheduler_flags=(
            "--stall-timeout",
            "180",
            "--coordinator-grace",
            "1",
            # The checkpoint path (a coordinator that is taken over: test_coordinator_failover).
            "--coordinator-failover",
            "off",
        ),
    )
    with LocalCluster(spec) as cluster, Client(cluster.client_config()) as client:
        artifact = client.upload_directory(MODEL)
        job_id = client.submit_job(
            job_pb2.JobSpec(
                name="recover",
                entry_point="train.py",
                artifact_id=artifact,
                batch_size=64,
                epochs=RECOVER_EPOCHS,
                min_workers=1,
                max_workers=2,
                sync_mode=job_pb2.SYNC_MODE_PARAMETER_SERVER,
                checkpoint_every=1,
            )
        ).job_id
        w = Watcher(client, job_id)
        w.until(
            lambda j: j.progress.completed_iterations >= 3 * PER_EPOCH,
            "three epochs (checkpoints)",
        )

        # 1. SIGKILL the job's coordinator shard.
        from shoal.scheduler.reconcile import coordinator_index

        index = coordinator_index(job_id, spec.shards)
        name = f"parameter-sync-{index}"
        cluster.kill(name, signal.SIGKILL)
        killed_at = time.monotonic()
        job = w.until(lambda j: j.state == S.JOB_STATE_RECOVERING, "RECOVERING", timeout=60)
        timings = {"coordinator killed -> RECOVERING": time.monotonic() - killed_at}
        assert f"shard {index} (" in job.state_reason, job.state_reason
        job = w.until(
            lambda j: j.state == S.JOB_STATE_RUNNING and "recovered" in j.state_reason,
            "running again after the shard restarted",
        )
        timings["coordinator killed -> RUNNING again"] = time.monotonic() - killed_at
        first = resumed_at(job.state_reason)
        assert first >= 3 * PER_EPOCH, job.state_reason  # the checkpoint before the kill
        assert cluster.services[name].supervision.restarts >= 1
        assert cluster.services_status()[name]["state"] == "running"

        # 2. SIGKILL the whole parameter-sync tier, a few checkpoints later.
        w.until(lambda j: j.progress.completed_iterations >= first + 3 * PER_EPOCH, "3 epochs")
        for i in range(spec.shards):
            cluster.kill(f"parameter-sync-{i}", signal.SIGKILL)
        killed_at = time.monotonic()
        w.until(lambda j: j.state == S.JOB_STATE_RECOVERING, "RECOVERING again", timeout=60)
        timings["tier killed -> RECOVERING"] = time.monotonic() - killed_at
        job = w.until(
            lambda j: j.state == S.JOB_STATE_RUNNING and "recovered" in j.state_reason,
            "running again after the tier restarted",
        )
        timings["tier killed -> RUNNING again"] = time.monotonic() - killed_at
        second = resumed_at(job.state_reason)
        assert second > first, job.state_reason  # the work between the losses was kept

        # 3. It completes.
        job = w.until(lambda j: j.state == S.JOB_STATE_COMPLETED, "COMPLETED", timeout=600)
        assert job.progress.completed_iterations == RECOVER_EPOCHS * PER_EPOCH

        # The bug: never RUNNING with no learner (beyond the moment an exit takes to be
        # reported).
        assert w.running_without_learners_for() < 3.0, w.samples
        reasons = [s[3] for s in w.samples if s[1] == S.JOB_STATE_RECOVERING]
        assert any("re-opening the job from its latest checkpoint" in r for r in reasons), reasons
        for i in range(spec.shards):
            assert cluster.services[f"parameter-sync-{i}"].alive()
        print(", ".join(f"{k}: {v:.1f} s" for k, v in timings.items()))


def test_a_killed_coordinator_shard_is_taken_over_by_the_next_one_without_a_rewind(
    tmp_path: Path,
) -> None:
    """Coordinator failover end to end, parameter-server mode (``failover_end_to_end``)."""
    failover_end_to_end(tmp_path, job_pb2.SYNC_MODE_PARAMETER_SERVER)


def test_a_killed_coordinator_shard_of_a_collective_job_is_taken_over_without_a_rewind(
    tmp_path: Path,
) -> None:
    """The same in collective mode (two learners in a gloo group): the successor takes the
    job's state from the learners' re-Joins and hosts the rendezvous; the learners re-form
    their group through it in place (docs/data-plane.md, "Coordinator failover in collective
    mode")."""
    # Its iterations cost next to nothing (no shard on the path): more of them, so that the
    # kill comes mid-training.
    successor = failover_end_to_end(tmp_path, job_pb2.SYNC_MODE_COLLECTIVE, epochs=200)
    assert "collective takeover: continuing at iteration" in successor, successor[-3000:]
    assert "no learner holds the state" not in successor


def failover_end_to_end(tmp_path: Path, sync_mode: int, *, epochs: int = EPOCHS) -> str:
    """Coordinator failover end to end (--coordinator-failover on, the default): the
    scheduler makes the other shard the job's coordinator after the grace, publishes the move,
    the learners follow it without a restart, and the job never goes back to a checkpoint
    (its progress never decreases) and completes. The killed shard, restarted by the
    supervisor, holds nothing of the job any more or is restored from the replicas. Returns
    the successor's log."""
    spec = ClusterSpec(
        state_dir=tmp_path / "cluster",
        hosts=1,
        gpus_per_host=2,
        shards=2,
        replicas=1,
        host_lost_after_s=30.0,
        supervise=True,
        restart_policy=RestartPolicy(initial_backoff_s=3.0, max_backoff_s=6.0),
        scheduler_flags=("--stall-timeout", "180", "--coordinator-grace", "1"),
    )
    with LocalCluster(spec) as cluster, Client(cluster.client_config()) as client:
        artifact = client.upload_directory(MODEL)
        job_id = client.submit_job(
            job_pb2.JobSpec(
                name="failover",
                entry_point="train.py",
                artifact_id=artifact,
                batch_size=64,
                epochs=epochs,
                min_workers=2,
                max_workers=2,
                sync_mode=sync_mode,  # type: ignore[arg-type]
                checkpoint_every=1,
            )
        ).job_id
        w = Watcher(client, job_id)
        w.until(
            lambda j: (
                j.progress.completed_iterations >= PER_EPOCH + 3
                and j.allocated_workers == 2
                and j.progress.world_size == 2
            ),
            "into the second epoch on two learners",
        )
        from shoal.scheduler.reconcile import coordinator_index

        index = coordinator_index(job_id, spec.shards)
        cluster.kill(f"parameter-sync-{index}", signal.SIGKILL)
        killed = w.sample().progress.completed_iterations
        assert killed < (epochs - 2) * PER_EPOCH  # mid-training
        job = w.until(
            lambda j: j.state == S.JOB_STATE_COMPLETED, "COMPLETED after the takeover", timeout=600
        )
        assert job.progress.completed_iterations == epochs * PER_EPOCH
        done = [s[4] for s in w.samples]
        assert done == sorted(done), done  # never rewound to a checkpoint
        reasons = [s[3] for s in w.samples]
        assert not any("checkpoint" in r for r in reasons), reasons
        logs = spec.state_dir / "logs"
        scheduler = (logs / "job-scheduler-0.log").read_text()
        other = 1 - index
        assert f"shard {index} lost; shard {other} took the role over (epoch 1)" in scheduler
        successor = (logs / f"parameter-sync-{other}.log").read_text()
        assert "took over as coordinator (epoch 1)" in successor, successor[-3000:]
        assert "rewound to the checkpoint" not in successor
        # The learners followed the new coordinator; none was started again.
        outputs = sorted((spec.state_dir / "hosts").glob("*/learners/*/output.log"))
        assert len(outputs) == 2, outputs
        for output in outputs:
            assert "coordinator moved" in output.read_text(), output
        return successor
