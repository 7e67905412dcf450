"""The reconcile loop's placement step (reconcile/placing.py): the events it derives from what
the loop observes keep the incremental planner's decision equal to the full plan's; a dropped
event is caught by the next safety-net cycle, logged with the jobs, and the full plan wins."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings, strategies as st

from shoal.scheduler.placement import LearnerView, PlacementConfig, plan
from shoal.scheduler.policy import JobDemand, Policy
from shoal.scheduler.reconcile.inventory import Inventory
from shoal.scheduler.reconcile.placing import Placing, diverging_jobs
from shoal.v1 import resources_pb2

HOSTS = ["h0", "h1", "h2"]
JOBS = ["j0", "j1", "j2", "j3"]


@st.composite
def hosts(draw: st.DrawFn) -> resources_pb2.Host:
    host = resources_pb2.Host(
        host_id=draw(st.sampled_from(HOSTS)),
        cordoned=draw(st.booleans()),
        state=draw(
            st.sampled_from([resources_pb2.HOST_STATE_READY, resources_pb2.HOST_STATE_LOST])
        ),
    )
    for d in range(draw(st.integers(0, 3))):
        host.devices.add(device_id=str(d))
    return host


@st.composite
def demands(draw: st.DrawFn) -> list[JobDemand]:
    out = []
    for seq, job_id in enumerate(JOBS):
        if draw(st.booleans()):
            low = draw(st.integers(1, 3))
            out.append(
                JobDemand(
                    job_id=job_id,
                    priority=draw(st.sampled_from([100, 5000, 10000])),
                    submit_seq=seq,
                    min_workers=low,
                    max_workers=low + draw(st.integers(0, 4)),
                    last_shrunk_at=draw(st.none() | st.sampled_from([0.0, 5.0])),
                )
            )
    return out


@st.composite
def learners(draw: st.DrawFn) -> list[LearnerView]:
    """Learners on distinct devices (the loop never observes two on one device)."""
    slots = draw(
        st.sets(st.tuples(st.sampled_from([*HOSTS, "gone"]), st.integers(0, 3)), max_size=8)
    )
    out = []
    for i, (host_id, device) in enumerate(sorted(slots)):
        # The same id on the same device most of the time (a learner that stays), sometimes
        # a new one (an exit, then a start).
        lid = f"l{host_id}{device}" if draw(st.booleans()) else f"n{i}"
        job_id = draw(st.sampled_from(JOBS))
        out.append(LearnerView(lid, job_id, host_id, str(device), draw(st.booleans())))
    return out


@settings(max_examples=120, deadline=None)
@given(st.data())
def test_the_derived_events_keep_the_planner_equal_to_the_full_plan(data: st.DataObject) -> None:
    config = PlacementConfig(policy=data.draw(st.sampled_from(list(Policy))), hold_time=10.0)
    placing = Placing(config, resync_interval_s=1e9)  # only the first cycle is a full one
    inventory = Inventory()
    inventory.reset(data.draw(st.lists(hosts(), max_size=3)), [])
    jobs, current = data.draw(demands()), data.draw(learners())
    now = 0.0
    placing.decide(jobs, inventory, current, now)
    for _ in range(data.draw(st.integers(1, 12))):
        op = data.draw(st.sampled_from(["host", "lose", "jobs", "learners", "time", "alloc"]))
        if op == "host":
            inventory.put_host(data.draw(hosts()))
        elif op == "lose":
            inventory.lose_host(data.draw(hosts()))
        elif op == "jobs":
            jobs = data.draw(demands())
        elif op == "learners":
            current = data.draw(learners())
        elif op == "time":
            now += data.draw(st.sampled_from([1.0, 6.0, 20.0]))
        else:
            host_id = data.draw(st.sampled_from(HOSTS))
            inventory.allocated(
                [
                    resources_pb2.Allocation(
                        allocation_id=f"a{host_id}",
                        host_id=host_id,
                        device_id=str(data.draw(st.integers(0, 3))),
                        learner_id="other",
                    )
                ]
            )
        cycles = placing.incremental_cycles
        decided = placing.decide(jobs, inventory, current, now)
        assert placing.incremental_cycles == cycles + 1  # decided by the planner
        full = plan(jobs, inventory.host_views(), current, config, now=now)
        assert diverging_jobs(decided, full) == []
    assert placing.divergences == 0


def test_a_dropped_event_is_caught_by_the_safety_net_logged_once_and_the_full_plan_wins(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = PlacementConfig(policy=Policy.PRIORITY)
    placing = Placing(config, resync_interval_s=1.0)
    inventory = Inventory()
    h1 = resources_pb2.Host(host_id="h1")
    h1.devices.add(device_id="0")
    inventory.reset([h1], [])
    job = JobDemand(job_id="j1", priority=5000, submit_seq=0, max_workers=4)
    first = placing.decide([job], inventory, [], 0.0)  # the term's first cycle: full
    assert (placing.full_cycles, [s.host_id for s in first.starts]) == (1, ["h1"])
    current = [LearnerView("l1", "j1", "h1", "0")]

    # A host joins; its event is dropped (taken before the cycle): the planner does not see
    # it, so its decision starts nothing.
    h2 = resources_pb2.Host(host_id="h2")
    h2.devices.add(device_id="0")
    inventory.put_host(h2)
    inventory.take_changed()
    assert placing.decide([job], inventory, current, 0.5).starts == ()
    assert placing.incremental_cycles == 1

    # The safety net (a resync interval later): the full plan starts j1 on h2; the planner
    # disagreed (on the capacity and on j1's share and starts), which is logged once with the
    # job's id.
    caplog.set_level(logging.WARNING, logger="shoal.scheduler.reconcile.placing")
    decided = placing.decide([job], inventory, current, 1.0)
    assert [(s.job_id, s.host_id) for s in decided.starts] == [("j1", "h2")]
    assert (placing.divergences, placing.last_divergence) == (1, ["<capacity 1 != 2>", "j1"])
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "j1" in warnings[0] and "full plan is used" in warnings[0]
    # Resynced: the next decision is the planner's, and right.
    again = placing.decide([job], inventory, current, 1.2)
    assert [(s.job_id, s.host_id) for s in again.starts] == [("j1", "h2")]
    assert (placing.incremental_cycles, placing.divergences) == (2, 1)


def test_off_every_cycle_is_the_full_plan_and_no_planner_is_kept() -> None:
    placing = Placing(PlacementConfig(), resync_interval_s=1.0, incremental=False)
    inventory = Inventory()
    inventory.reset([], [])
    job = JobDemand(job_id="j1", priority=5000, submit_seq=0, max_workers=4)
    for now in (0.0, 0.1, 0.2):
        assert placing.decide([job], inventory, [], now).queue == ("j1",)
    assert (placing.full_cycles, placing.incremental_cycles, placing.planner) == (3, 0, None)


def test_diverging_jobs_names_each_difference() -> None:
    config = PlacementConfig()
    a = plan([JobDemand(job_id="j1", priority=1, submit_seq=0, max_workers=2)], [], [], config)
    b = plan([JobDemand(job_id="j2", priority=1, submit_seq=0, max_workers=2)], [], [], config)
    assert diverging_jobs(a, a) == []
    assert diverging_jobs(a, b) == ["j1", "j2"]


def test_the_incremental_placement_flag_is_on_by_default_and_checked() -> None:
    from shoal.contract.errors import InvalidField
    from shoal.scheduler.main import build_parser, config_from_args

    base = ["--insecure-no-auth", "--resource-managers", "rm:1", "--sync-shards", "ps:1"]

    def config(*flags: str, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
        return config_from_args(build_parser(env or {}).parse_args([*base, *flags]))

    assert config().incremental_placement is True
    assert config("--incremental-placement", "off").incremental_placement is False
    assert config(env={"SHOAL_INCREMENTAL_PLACEMENT": "OFF"}).incremental_placement is False
    with pytest.raises(InvalidField, match=r"incremental_placement.*maybe"):
        config("--incremental-placement", "maybe")
    assert config().placement_check_interval_s == 10.0
    assert config("--placement-check-interval", "2.5").placement_check_interval_s == 2.5
    assert config(env={"SHOAL_PLACEMENT_CHECK_INTERVAL_S": "30"}).placement_check_interval_s == 30.0
    for bad in ("0", "-1", "nan", "soon"):
        with pytest.raises(InvalidField, match="placement_check_interval_s"):
            config("--placement-check-interval", bad)
