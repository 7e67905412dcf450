"""The seeded random-fault soak: ``make chaos SOAK_MINUTES=N SOAK_SEED=S`` (or
``python -m tests.chaos.soak --minutes N --seed S``).

A real local cluster (three etcd members, two replicas of the resource manager and of the job
scheduler, one parameter-sync shard, two hosts with two simulated GPUs each) runs jobs in both
sync modes and at different priorities, while a schedule drawn from ``random.Random(seed)``
kills (SIGKILL), restarts (SIGTERM), freezes (SIGSTOP for a few seconds) random control-plane
processes, etcd members and host agents. The schedule is a pure function of the seed: the same
seed replays the same faults at the same offsets (printed, and saved in the report).

At the end, with the faults stopped, it checks:

* every job ends in exactly one terminal state (COMPLETED, FAILED or CANCELLED) within the
  drain time;
* every COMPLETED job's iterations are contiguous from 0, each exactly once;
* every COMPLETED job's final model equals its single-process reference (plain PyTorch
  training of the same model, data, order and batch: ``harness.tiny_reference``) within
  ``MODEL_ATOL``;
* no host was declared lost except one the schedule made unreachable (an agent killed, or
  frozen for longer than the grace).

Shard kills are left out: surviving them is the data plane's issue (replicated shard state).
Exit status 0 when every check holds; the report (JSON) goes to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import re
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from shoal.v1 import job_pb2
from tests.chaos.harness import TERMINAL, TINY_MODEL, ChaosCluster, job_spec, model_difference
from tests.support import wait_until

GRACE_S = 3.0
# The job's model against plain single-process training: they differ only by the float
# summation order of the per-learner gradients (see tests/integration/test_elastic_training.py).
MODEL_ATOL = 1e-5


@dataclass
class Fault:
    at_s: float  # offset from the start of the soak
    action: str  # kill | restart | freeze
    target: str  # "leader:<kind>", "standby:<kind>", "etcd:<i>", "host:<name>"
    hold_s: float = 0.0  # freeze: how long

    def __str__(self) -> str:
        hold = f" for {self.hold_s:.1f} s" if self.action == "freeze" else ""
        return f"t+{self.at_s:6.1f} s  {self.action:7s} {self.target}{hold}"


def schedule(seed: int, minutes: float, hosts: list[str]) -> list[Fault]:
    """The faults of a soak: a pure function of (seed, minutes, hosts)."""
    rng = random.Random(seed)
    faults: list[Fault] = []
    at = 20.0  # let the jobs start first
    end = minutes * 60 - 10
    targets = [
        *(f"{r}:{k}" for r in ("leader", "standby") for k in ("resource-manager", "job-scheduler")),
        "etcd:0",
        "etcd:1",
        "etcd:2",
        *(f"host:{h}" for h in hosts),
    ]
    while at < end:
        target = rng.choice(targets)
        action = rng.choice(("kill", "restart", "freeze"))
        hold = round(rng.uniform(1.0, 6.0), 1) if action == "freeze" else 0.0
        if target.startswith("etcd:") and action == "freeze":
            hold = min(hold, 4.0)
        faults.append(Fault(round(at, 1), action, target, hold))
        at += rng.uniform(8.0, 20.0)
    return faults


def jobs_for(artifact: str, minutes: float) -> list[tuple[str, job_pb2.JobSpec]]:
    """Jobs of both sync modes and three priorities, sized to end within the soak."""
    epochs = max(3, int(minutes * 6))
    return [
        (
            "ps-high",
            job_spec("soak-ps-high", artifact, max_workers=2, epochs=epochs, priority=9000),
        ),
        ("ps-low", job_spec("soak-ps-low", artifact, max_workers=2, epochs=epochs, priority=2000)),
        (
            "collective",
            job_spec(
                "soak-collective",
                artifact,
                max_workers=2,
                epochs=epochs,
                priority=5000,
                sync_mode=job_pb2.SYNC_MODE_COLLECTIVE,
            ),
        ),
    ]


class Soak:
    def __init__(self, chaos: ChaosCluster) -> None:
        self.chaos = chaos
        self.expected_lost: set[str] = set()
        self.done: list[dict] = []

    def resolve(self, target: str) -> str | None:
        role, _, what = target.partition(":")
        if role in ("leader", "standby"):
            try:
                leader = self.chaos.leader(what, timeout=20)
            except AssertionError:
                return None
            if role == "leader":
                return leader
            return next((n for n in self.chaos.names(what) if n != leader), None)
        if role == "host":
            return what
        return target

    def apply(self, fault: Fault) -> None:
        c = self.chaos
        name = self.resolve(fault.target)
        record = {**asdict(fault), "process": name, "ok": True}
        try:
            if name is None:
                record["ok"] = False
                return
            if name.startswith("etcd:"):
                member = c.cluster.etcd.members[int(name.split(":")[1])]  # type: ignore[union-attr]
                if fault.action == "freeze":
                    member.pause()
                    time.sleep(fault.hold_s)
                    member.resume()
                elif fault.action == "kill":
                    member.kill()
                    member.restart(timeout=60)
                else:
                    member.stop()
                    member.restart(timeout=60)
                return
            is_host = c.cluster.services[name].kind == "host-agent"
            if fault.action == "freeze":
                if is_host and fault.hold_s > GRACE_S * 0.8:
                    self.expected_lost.add(name)
                c.freeze(name)
                time.sleep(fault.hold_s)
                c.thaw(name)
            elif fault.action == "kill":
                if is_host:
                    self.expected_lost.add(name)
                c.kill(name, signal.SIGKILL)
                c.start_again(name)
            else:
                if is_host:  # a graceful restart stops its learners: they leave, not lost
                    self.expected_lost.add(name)  # (allowed, not required)
                c.sigterm(name)
                c.start_again(name)
        except Exception as exc:  # a fault that could not be applied is reported, not fatal
            record["ok"] = False
            record["error"] = str(exc)
        finally:
            self.done.append(record)


def declared_lost(chaos: ChaosCluster) -> list[str]:
    found = []
    for name in chaos.names("resource-manager"):
        found += re.findall(r"host '([^']+)' declared lost", chaos.log_text(name))
    return found


def run(minutes: float, seed: int, out: Path, state_dir: Path) -> int:
    hosts = ["host-1", "host-2"]
    plan = schedule(seed, minutes, hosts)
    print(f"soak: {minutes} min, seed {seed}, {len(plan)} faults:")
    for fault in plan:
        print("  ", fault)
    started = time.monotonic()
    chaos = ChaosCluster.start(state_dir)
    soak = Soak(chaos)
    report: dict = {"minutes": minutes, "seed": seed, "schedule": [asdict(f) for f in plan]}
    try:
        artifact = chaos.client.upload_directory(TINY_MODEL)
        specs = dict(jobs_for(artifact, minutes))
        jobs = {
            key: chaos.client.submit_job(spec, request_id=f"soak-{seed}-{key}").job_id
            for key, spec in specs.items()
        }
        t0 = time.monotonic()
        for fault in plan:
            delay = fault.at_s - (time.monotonic() - t0)
            if delay > 0:
                time.sleep(delay)  # the schedule's pace (a fault at its seeded offset), no wait
            print(f"   applying {fault}", flush=True)
            soak.apply(fault)
        # drain: no more faults; every job must reach a terminal state (a job that does not
        # within the drain time is reported below)
        states: dict[str, int] = {}

        def ended() -> bool:
            try:
                states.update({k: chaos.client.get_job(j).state for k, j in jobs.items()})
            except Exception:  # a failover in progress: ask again at the next poll
                return False
            return all(s in TERMINAL for s in states.values())

        with contextlib.suppress(AssertionError):
            wait_until(
                ended, timeout=max(300.0, minutes * 60), interval=2.0, what="every job to end"
            )
        problems: list[str] = []
        summary = {}
        for key, job_id in jobs.items():
            state = states.get(key, job_pb2.JOB_STATE_UNSPECIFIED)
            entry = {"job_id": job_id, "state": job_pb2.JobState.Name(state)}
            if state not in TERMINAL:
                problems.append(f"{key} ({job_id}) did not end: {entry['state']}")
            if state == job_pb2.JOB_STATE_COMPLETED:
                try:
                    entry["iterations"] = chaos.assert_iterations_exact(job_id)
                    diff = model_difference(chaos, job_id, specs[key].epochs, state_dir)
                    entry["model_max_abs_diff"] = diff
                    if not diff <= MODEL_ATOL:
                        problems.append(
                            f"{key} ({job_id}): its model differs from the single-process "
                            f"reference by {diff:.3g} (> {MODEL_ATOL:g})"
                        )
                except AssertionError as exc:
                    problems.append(str(exc))
            summary[key] = entry
        lost = declared_lost(chaos)
        wrongly = sorted(set(lost) - soak.expected_lost)
        if wrongly:
            problems.append(f"hosts declared lost that were reachable: {wrongly}")
        report.update(
            jobs=summary,
            faults_applied=soak.done,
            hosts_declared_lost=lost,
            hosts_made_unreachable=sorted(soak.expected_lost),
            problems=problems,
            wall_s=round(time.monotonic() - started, 1),
        )
    finally:
        chaos.close()
        out.write_text(json.dumps(report, indent=2))
    print(
        json.dumps(
            {k: report.get(k) for k in ("jobs", "hosts_declared_lost", "problems")}, indent=2
        )
    )
    print(f"report: {out}")
    return 1 if report.get("problems") else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("soak-report.json"))
    parser.add_argument("--state-dir", type=Path, default=None)
    ns = parser.parse_args(argv)
    if not 0.5 <= ns.minutes <= 24 * 60:
        parser.error(f"--minutes ({ns.minutes}) must be in 0.5..1440")
    state_dir = ns.state_dir or Path(tempfile.mkdtemp(prefix="shoal-soak-")) / "cluster"
    return run(ns.minutes, ns.seed, ns.out, state_dir)


if __name__ == "__main__":
    sys.exit(main())
