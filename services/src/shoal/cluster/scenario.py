"""The reference scenario of shoal's design, replayed against a running cluster.

1. Job 1 (max 8) gets all 8 GPUs.
2. Job 2 (max 8, same priority 5000) arrives: fairshare 4 and 4.
3. Job 2's priority goes to 10000: 5 for job 2, 3 for job 1.
4. Job 1 finishes: job 2 scales up to 8.
5. (optional) A host agent is SIGKILLed mid-training: job 2 continues on the surviving host
   and completes.

Used by ``make demo`` (:mod:`shoal.cluster.demo`) and by the end-to-end test, which asserts on
every step through the :class:`ScenarioResult` it returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shoal.client import Client
from shoal.v1 import job_pb2

FINAL = {job_pb2.JOB_STATE_COMPLETED, job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_CANCELLED}
Log = Callable[[str], None]


class ScenarioFailed(AssertionError):
    pass


@dataclass
class ScenarioResult:
    job1: str = ""
    job2: str = ""
    steps: list[tuple[str, float, dict[str, int]]] = field(default_factory=list)
    jobs: dict[str, job_pb2.Job] = field(default_factory=dict)


def wait_for(
    what: str, check: Callable[[], object], *, timeout: float, interval: float = 0.2
) -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise ScenarioFailed(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def job_spec(
    name: str,
    artifact: str,
    *,
    epochs: int,
    batch_size: int,
    max_workers: int,
    priority: int = 5000,
    args: list[str] | None = None,
) -> job_pb2.JobSpec:
    return job_pb2.JobSpec(
        name=name,
        entry_point="train.py",
        artifact_id=artifact,
        args=args or [],
        batch_size=batch_size,
        epochs=epochs,
        min_workers=1,
        max_workers=max_workers,
        priority=priority,
        sync_mode=job_pb2.SYNC_MODE_PARAMETER_SERVER,
        checkpoint_every=1,
        seed=0,
    )


def run_scenario(
    client: Client,
    model_dir: Path,
    *,
    capacity: int = 8,
    job1_epochs: int = 12,
    job2_epochs: int = 30,
    batch_size: int = 64,
    kill_host: Callable[[], str] | None = None,
    log: Log = print,
    step_timeout: float = 240.0,
) -> ScenarioResult:
    result = ScenarioResult()
    t0 = time.monotonic()

    def workers() -> dict[str, int]:
        """GPUs per running job, counted only once the learners train: the scheduler holds
        them (allocated) and the coordinator's current generation has that many members."""
        out = {}
        for job_id in (result.job1, result.job2):
            if job_id:
                job = client.get_job(job_id)
                result.jobs[job_id] = job
                if job.state in FINAL:
                    continue
                if job.allocated_workers != job.progress.world_size:
                    out[job_id] = -1  # in transition
                else:
                    out[job_id] = job.allocated_workers
        return out

    def step(name: str, want: Callable[[dict[str, int]], bool]) -> None:
        seen = wait_for(
            name, lambda: (lambda w: w if want(w) else None)(workers()), timeout=step_timeout
        )
        assert isinstance(seen, dict)
        result.steps.append((name, time.monotonic() - t0, dict(seen)))
        log(
            f"[{time.monotonic() - t0:6.1f}s] {name}: "
            + ", ".join(f"{j}={n}" for j, n in seen.items())
        )

    artifact = client.upload_directory(model_dir)
    half = capacity // 2
    share2 = round(capacity * 10000 / 15000)
    job1 = client.submit_job(
        job_spec("job-1", artifact, epochs=job1_epochs, batch_size=batch_size, max_workers=capacity)
    )
    result.job1 = job1.job_id
    step(f"1. job 1 alone gets all {capacity} GPUs", lambda w: w.get(result.job1) == capacity)
    job2 = client.submit_job(
        job_spec("job-2", artifact, epochs=job2_epochs, batch_size=batch_size, max_workers=capacity)
    )
    result.job2 = job2.job_id
    step(
        f"2. fairshare {half}/{half}",
        lambda w: w.get(result.job1) == half and w.get(result.job2) == half,
    )
    client.update_job(result.job2, priority=10000)
    step(
        f"3. priority 10000 vs 5000: {share2}/{capacity - share2}",
        lambda w: w.get(result.job2) == share2 and w.get(result.job1) == capacity - share2,
    )
    wait_for(
        "job 1 to complete",
        lambda: client.get_job(result.job1).state in FINAL,
        timeout=step_timeout * 2,
    )
    state1 = client.get_job(result.job1)
    if state1.state != job_pb2.JOB_STATE_COMPLETED:
        raise ScenarioFailed(
            f"job 1 ended {job_pb2.JobState.Name(state1.state)}: {state1.state_reason}"
        )
    step(f"4. job 1 done, job 2 scales to {capacity}", lambda w: w.get(result.job2) == capacity)
    if kill_host is not None:
        host = kill_host()
        log(f"[{time.monotonic() - t0:6.1f}s] 5. SIGKILL host agent {host}")
        step(
            "5. job 2 continues on the surviving host",
            lambda w: 0 < w.get(result.job2, 0) <= capacity - half,
        )
    wait_for(
        "job 2 to complete",
        lambda: client.get_job(result.job2).state in FINAL,
        timeout=step_timeout * 3,
    )
    final2 = client.get_job(result.job2)
    result.jobs[result.job2] = final2
    result.jobs[result.job1] = client.get_job(result.job1)
    if final2.state != job_pb2.JOB_STATE_COMPLETED:
        raise ScenarioFailed(
            f"job 2 ended {job_pb2.JobState.Name(final2.state)}: {final2.state_reason}"
        )
    log(f"[{time.monotonic() - t0:6.1f}s] both jobs completed")
    return result
