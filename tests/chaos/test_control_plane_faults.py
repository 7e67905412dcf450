"""Control-plane faults on a real cluster while two jobs train: what is lost (nothing) and the
time to recover, for each scenario. Runs in `make test` (the short chaos suite) and in
`make chaos`."""

from __future__ import annotations

import signal
import time

import pytest

from tests.chaos.harness import ChaosCluster, leads, time_to, wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(900)]

KINDS = ("resource-manager", "job-scheduler")


def assert_nothing_lost(chaos, jobs, before, since) -> None:
    after = chaos.snapshot()
    assert after == before, f"a host was declared lost (liveness, incarnation): {before} -> {after}"
    for job in jobs:
        assert chaos.evictions(job, since) == [], f"{job} lost learners"
        chaos.assert_iterations_exact(job)
    assert chaos.count_in_logs("resource-manager", "declared lost after") == 0


def test_rolling_restart_of_every_service_loses_no_host_no_learner_no_iteration(
    chaos: ChaosCluster, two_jobs, record
):
    """SIGTERM one replica at a time (standby first, then the leader, as docs/operations.md
    says), and one etcd member at a time, while two jobs train."""
    before = chaos.snapshot()
    since = time.time()
    recover: dict[str, float] = {}
    for kind in KINDS:
        standby = chaos.standby(kind)
        chaos.sigterm(standby)
        chaos.start_again(standby)
        leader = chaos.leader(kind)
        start = time.monotonic()
        chaos.sigterm(leader)
        wait_for(leads(chaos, kind, leader), 60, f"a new {kind} leader after SIGTERM")
        recover[kind] = time.monotonic() - start
        chaos.start_again(leader)
    for member in chaos.cluster.etcd.members:  # type: ignore[union-attr]
        member.stop()
        member.restart(timeout=60)
    for job in two_jobs:
        chaos.wait_training(job, 7)  # training went on: one more epoch after the restarts
    assert_nothing_lost(chaos, two_jobs, before, since)
    for kind, seconds in recover.items():
        assert seconds < 30, f"{kind} took {seconds:.1f} s to lead again after SIGTERM"
    record.update(scenario="rolling restart", failover_s=recover)


@pytest.mark.parametrize("kind", KINDS)
def test_leader_sigkill_fails_over_without_losing_a_host(chaos, two_jobs, kind, record):
    before, since = chaos.snapshot(), time.time()
    leader = chaos.leader(kind)
    chaos.kill(leader, signal.SIGKILL)
    seconds = time_to(leads(chaos, kind, leader), 60, f"a new {kind} leader after SIGKILL")
    chaos.start_again(leader)
    for job in two_jobs:
        chaos.wait_training(job, 3)
    assert_nothing_lost(chaos, two_jobs, before, since)
    assert seconds < 30
    record.update(scenario=f"{kind} leader SIGKILL", recover_s=seconds)


@pytest.mark.parametrize("kind", KINDS)
def test_frozen_leader_is_replaced_and_steps_down_when_it_thaws(chaos, two_jobs, kind, record):
    """SIGSTOP the leader for longer than the election TTL: the standby leads; the old leader,
    resumed, steps down (its lease is gone) instead of acting; no host is declared lost."""
    before, since = chaos.snapshot(), time.time()
    leader = chaos.leader(kind)
    log_before = len(chaos.log_text(leader))
    chaos.freeze(leader)
    try:
        seconds = time_to(leads(chaos, kind, leader), 60, f"the standby {kind} to lead")
        new_leader = chaos.leader(kind)
        assert new_leader != leader
    finally:
        chaos.thaw(leader)
    wait_for(
        lambda: any(
            t in chaos.log_text(leader)[log_before:] for t in ("no longer leading", "stepping down")
        ),
        60,
        f"the thawed {kind} to step down",
    )
    assert chaos.leader(kind) == new_leader
    for job in two_jobs:
        chaos.wait_training(job, 3)
    assert_nothing_lost(chaos, two_jobs, before, since)
    record.update(scenario=f"{kind} leader SIGSTOP", recover_s=seconds)
