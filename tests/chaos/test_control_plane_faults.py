"""Control-plane faults on a real cluster while two jobs train: what is lost (nothing) and the
time to recover, for each scenario. Runs in `make test` (the short chaos suite) and in
`make chaos`."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from pathlib import Path

import pytest

from shoal.client import AsyncClient, Client, ShoalClientError
from shoal.v1 import resources_pb2
from tests.chaos.harness import (
    FAKETIME_LIB,
    ChaosCluster,
    faketime_env,
    leads,
    time_to,
    wait_for,
)

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(900)]

KINDS = ("resource-manager", "job-scheduler")
HOST_READY = resources_pb2.HOST_STATE_READY
HOST_LOST = resources_pb2.HOST_STATE_LOST


def assert_nothing_lost(chaos, jobs, before, since) -> None:
    """No host was declared lost (a host declared lost gets a new incarnation when it comes
    back, so an unchanged (state, incarnation) of every host proves it), no learner was taken
    from a job, and every job's iteration record is exact."""
    after = chaos.snapshot()
    assert after == before, f"a host was declared lost (liveness, incarnation): {before} -> {after}"
    for job in jobs:
        assert chaos.evictions(job, since) == [], f"{job} lost learners"
        chaos.assert_iterations_exact(job)


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


# -- the full suite (`make chaos`; skipped by the short form in `make test`) ------------------

full = pytest.mark.skipif(
    os.environ.get("SHOAL_CHAOS", "") != "full",
    reason="full chaos suite only: `make chaos` (SHOAL_CHAOS=full)",
)


def _stale_read_and_refused_write(chaos: ChaosCluster, job_id: str) -> None:
    """While etcd has no quorum: a read of a job answers (from the last leader's state, marked
    stale) and a write fails UNAVAILABLE naming etcd."""
    has_leader = leads(chaos, "job-scheduler")
    wait_for(lambda: not has_leader(), 60, "the scheduler leader to step down (no etcd quorum)")
    config = chaos.cluster.client_config()
    with Client(config, timeout=5, retries=8, failover_s=30) as client:
        job = wait_for(lambda: client.get_job(job_id), 60, "a stale read during the outage")
        assert job.job_id == job_id
        with pytest.raises(ShoalClientError) as refused:
            client.cancel_job("job-000000000000")  # a write (of nothing, if it went through)
        assert refused.value.code == "UNAVAILABLE", refused.value
        assert "etcd" in refused.value.message, refused.value.message


@full
def test_etcd_quorum_loss_keeps_reads_refuses_writes_and_loses_no_host(chaos, two_jobs, record):
    """Two of three etcd members down for longer than the leases: no leader can be elected;
    reads serve the last known state, writes fail naming etcd, no host is declared lost, and
    everything resumes when the quorum is back."""
    before, since = chaos.snapshot(), time.time()
    members = chaos.cluster.etcd.members  # type: ignore[union-attr]
    for member in members[1:]:
        member.stop()
    try:
        _stale_read_and_refused_write(chaos, two_jobs[0])
    finally:
        start = time.monotonic()
        for member in members[1:]:
            member.restart(timeout=60)
    wait_for(leads(chaos, "resource-manager"), 90, "a resource-manager leader")
    wait_for(leads(chaos, "job-scheduler"), 90, "a scheduler leader")
    recover = time.monotonic() - start
    for job in two_jobs:
        chaos.wait_training(job, 3)
    assert_nothing_lost(chaos, two_jobs, before, since)
    record.update(scenario="etcd quorum loss (2 of 3 down)", recover_s=recover)


@full
def test_a_full_etcd_restart_loses_no_host_and_no_iteration(chaos, two_jobs, record):
    before, since = chaos.snapshot(), time.time()
    etcd = chaos.cluster.etcd
    assert etcd is not None
    etcd.stop()
    start = time.monotonic()
    etcd.restart()
    wait_for(leads(chaos, "resource-manager"), 90, "a resource-manager leader")
    wait_for(leads(chaos, "job-scheduler"), 90, "a scheduler leader")
    recover = time.monotonic() - start
    for job in two_jobs:
        chaos.wait_training(job, 3)
    assert_nothing_lost(chaos, two_jobs, before, since)
    record.update(scenario="full etcd restart", recover_s=recover)


@full
def test_ten_times_the_request_load_sheds_instead_of_timing_out_and_kills_no_host(
    chaos, two_jobs, record
):
    """64 callers hammer both replicated services for 15 s (the cluster runs with
    --max-concurrent-calls 16): every call is answered or shed with RESOURCE_EXHAUSTED, none
    times out, no host is declared lost, training goes on."""
    before, since = chaos.snapshot(), time.time()
    outcomes: dict[str, int] = {}

    async def caller(client: AsyncClient, i: int, until: float) -> None:
        while time.monotonic() < until:
            try:
                if i % 2:
                    await client.list_hosts()
                else:
                    await client.get_job(two_jobs[i % 4 // 2])
                key = "OK"
            except ShoalClientError as exc:
                key = exc.code
            outcomes[key] = outcomes.get(key, 0) + 1

    services = chaos.cluster.services
    rm = services[chaos.leader("resource-manager")].address
    scheduler = services[chaos.leader("job-scheduler")].address

    async def load() -> None:
        # at the leaders only, with no retry: every outcome is the server's own answer
        config = dataclasses.replace(
            chaos.cluster.client_config(), resource_manager=(rm,), scheduler=(scheduler,)
        )
        async with AsyncClient(config, timeout=10, retries=0) as client:
            until = time.monotonic() + 15
            await asyncio.gather(*(caller(client, i, until) for i in range(64)))

    asyncio.run(load())
    assert set(outcomes) <= {"OK", "RESOURCE_EXHAUSTED"}, outcomes
    assert outcomes.get("OK", 0) > 0
    for job in two_jobs:
        chaos.wait_training(job, 3)
    assert_nothing_lost(chaos, two_jobs, before, since)
    record.update(scenario="10x request load", calls=outcomes)


@full
def test_a_frozen_host_agent_is_declared_lost_and_comes_back_fenced_by_its_incarnation(
    chaos, two_jobs, record
):
    """SIGSTOP one host agent past the grace: its host is declared LOST (it is unreachable),
    its learners are evicted and the jobs go on on the other host. Thawed, the zombie agent's
    heartbeats name a stale incarnation: it registers again as a new incarnation, and its old
    learners are stopped, never trusted. No iteration is repeated or lost."""
    host = chaos.names("host-agent")[-1]
    before = chaos.snapshot()
    chaos.freeze(host)
    try:
        lost_after = time_to(
            lambda: chaos.snapshot()[host][0] == HOST_LOST, 60, f"{host} to be declared lost"
        )
    finally:
        chaos.thaw(host)
    back = time_to(
        lambda: chaos.snapshot()[host] == (HOST_READY, before[host][1] + 1),
        60,
        f"{host} to register again as incarnation {before[host][1] + 1}",
    )
    for job in two_jobs:
        chaos.wait_workers(job, 2)  # grown back to two learners each
        chaos.wait_training(job, 3)
        chaos.assert_iterations_exact(job)
    others = {h: v for h, v in chaos.snapshot().items() if h != host}
    assert others == {h: v for h, v in before.items() if h != host}
    record.update(scenario="host agent SIGSTOP", declared_lost_s=lost_after, back_s=back)


@full
@pytest.mark.skipif(not Path(FAKETIME_LIB).is_file(), reason="needs libfaketime (apt faketime)")
def test_a_clock_jump_on_the_resource_manager_leader_declares_no_host_lost(
    chaos, two_jobs, record, tmp_path
):
    """The resource-manager leader's clock (wall and monotonic, libfaketime) jumps an hour
    ahead: every host looks silent for an hour at once. Its liveness loop sees that it ran an
    hour late and gives every host a fresh grace; no host is declared lost (a failover to the
    standby, if the jump also expires its lease, is fine)."""
    offset = tmp_path / "offset"
    # Put the clock-jumpable replica in the lead: restart the standby with libfaketime, then
    # SIGTERM the leader (it resigns; the standby leads) and bring it back.
    standby = chaos.standby("resource-manager")
    chaos.sigterm(standby)
    chaos.start_again(standby, env=faketime_env(offset))
    leader = chaos.leader("resource-manager")
    chaos.sigterm(leader)
    wait_for(leads(chaos, "resource-manager", leader), 60, "the faketime replica to lead")
    chaos.start_again(leader)
    assert chaos.leader("resource-manager") == standby
    before, since = chaos.snapshot(), time.time()
    log_before = len(chaos.log_text(standby))
    offset.write_text("+3600\n")
    noticed = ("s late (this replica", "went silent at once", "no longer leading")
    wait_for(
        lambda: any(t in chaos.log_text(standby)[log_before:] for t in noticed),
        30,
        "the jump to be noticed",
    )
    for job in two_jobs:
        chaos.wait_training(job, 3)
    assert_nothing_lost(chaos, two_jobs, before, since)
    record.update(scenario="clock jump +1 h on the resource-manager leader", hosts_lost=0)
