"""The resource-manager core without a network: inventory, liveness with an injected clock, the
ledger (all or nothing), the host state machines and the proto round trips."""

from __future__ import annotations

import itertools

import pytest

from shoal.resource_manager import core
from shoal.resource_manager.core import (
    LIVENESS_TRANSITIONS,
    SCHEDULING_TRANSITIONS,
    Claim,
    DeviceBusy,
    DeviceHealth,
    DeviceNotFound,
    DeviceRecord,
    DeviceStats,
    EventKind,
    HostNotFound,
    HostUnavailable,
    InvalidTransition,
    Inventory,
    LearnerReport,
    LearnerState,
    Liveness,
    Registration,
    Scheduling,
    StaleIncarnation,
)
from shoal.runtime.errors import FailedPrecondition, InvalidField


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def inv(clock: FakeClock) -> Inventory:
    ids = (f"a{i}" for i in itertools.count(1))
    return Inventory(
        grace_s=3.0,
        clock=clock,
        wall_clock=lambda: 1.7e9 + clock.now,
        new_allocation_id=ids.__next__,
    )


def devices(n: int) -> tuple[DeviceRecord, ...]:
    return tuple(
        DeviceRecord(f"gpu{i}", index=i, uuid=f"u{i}", model="sim", memory_bytes=1 << 30)
        for i in range(n)
    )


def register(inv: Inventory, host_id: str, n: int = 4, **kw) -> core.HostRecord:
    change, record = inv.register(
        Registration(host_id, f"127.0.0.1:{5000 + len(host_id)}", devices(n), **kw)
    )
    inv.apply(change)
    inv.mark_seen(host_id)
    return record


def acquire(
    inv: Inventory, *claims: Claim, request_id: str = ""
) -> tuple[core.AllocationRecord, ...]:
    outcome = inv.acquire(claims, request_id)
    inv.apply(outcome.change)
    return outcome.allocations


def claim(host: str, device: str, learner: str = "", job: str = "j1") -> Claim:
    return Claim(job, learner or f"{job}-{host}-{device}", host, device)


# -- registration -----------------------------------------------------------------------------


def test_a_new_host_registers_as_incarnation_1_and_is_announced_up(inv):
    change, record = inv.register(Registration("h1", "127.0.0.1:7001", devices(2)))
    assert record.incarnation == 1 and record.liveness is Liveness.READY
    assert [e.kind for e in change.events] == [EventKind.HOST_UP]
    inv.apply(change)
    assert [d.device_id for d in inv.host("h1").devices] == ["gpu0", "gpu1"]
    assert inv.host("h1").resource_group == "default"


def test_a_change_that_is_not_applied_changes_nothing(inv):
    inv.register(Registration("h1", "127.0.0.1:7001", devices(2)))
    with pytest.raises(HostNotFound):
        inv.host("h1")


def test_a_ready_host_registering_again_keeps_its_incarnation(inv):
    register(inv, "h1")
    record = register(inv, "h1")
    assert record.incarnation == 1


@pytest.mark.parametrize(
    ("reg", "field"),
    [
        (Registration("", "127.0.0.1:1"), "host_id"),
        (Registration("bad host", "127.0.0.1:1"), "host_id"),
        (Registration("h1", "nohostport"), "agent_address"),
        (Registration("h1", "127.0.0.1:0"), "agent_address"),
        (Registration("h1", "127.0.0.1:1", (DeviceRecord(""),)), "devices[0].device_id"),
        (
            Registration("h1", "127.0.0.1:1", (DeviceRecord("g"), DeviceRecord("g"))),
            "devices[1].device_id",
        ),
        (Registration("h1", "127.0.0.1:1", resource_group="a b"), "resource_group"),
    ],
)
def test_a_bad_registration_names_the_field_and_changes_nothing(inv, reg, field):
    with pytest.raises(InvalidField) as info:
        inv.register(reg)
    assert info.value.field_name == field
    assert inv.hosts() == []


# -- liveness ---------------------------------------------------------------------------------


def test_a_host_silent_for_longer_than_the_grace_expires(inv, clock):
    register(inv, "h1")
    register(inv, "h2")
    clock.advance(2.0)
    inv.heartbeat("h2", 1)
    clock.advance(1.5)
    assert inv.expired_hosts() == ["h1"]
    clock.advance(2.0)
    assert inv.expired_hosts() == ["h1", "h2"]


def test_a_lost_host_frees_its_allocations_and_announces_them(inv, clock):
    register(inv, "h1")
    held = acquire(inv, claim("h1", "gpu0"), claim("h1", "gpu1"))
    clock.advance(3.5)
    change = inv.declare_lost("h1")
    (event,) = change.events
    assert event.kind is EventKind.HOST_LOST
    assert {a.allocation_id for a in event.allocations} == {a.allocation_id for a in held}
    inv.apply(change)
    assert inv.host("h1").liveness is Liveness.LOST
    assert inv.allocations() == []
    assert inv.expired_hosts() == []


def test_a_lost_host_that_comes_back_is_a_new_incarnation(inv, clock):
    register(inv, "h1")
    clock.advance(4)
    inv.apply(inv.declare_lost("h1"))
    with pytest.raises(StaleIncarnation, match="declared lost"):
        inv.heartbeat("h1", 1)
    record = register(inv, "h1")
    assert record.incarnation == 2
    with pytest.raises(StaleIncarnation, match=r"incarnation \(1\)"):
        inv.heartbeat("h1", 1)
    inv.heartbeat("h1", 2)
    history = [(t.source, t.target) for t in inv.history("h1") if t.machine == "liveness"]
    assert history == [("new", "ready"), ("ready", "lost"), ("lost", "ready")]


def test_a_heartbeat_from_an_unknown_host_is_not_found(inv):
    with pytest.raises(HostNotFound, match="'ghost'"):
        inv.heartbeat("ghost", 1)


def test_after_a_rebuild_every_ready_host_gets_a_fresh_grace(inv, clock):
    register(inv, "h1")
    register(inv, "h2")
    held = acquire(inv, claim("h1", "gpu0"))
    clock.advance(2.9)
    inv2 = Inventory(grace_s=3.0, clock=clock)
    inv2.load(inv.hosts(), inv.allocations(), inv.requests())
    clock.advance(2.9)
    assert inv2.expired_hosts() == []  # 5.8 s since the last beat, 2.9 s since the rebuild
    assert inv2.allocations() == list(held)
    clock.advance(0.2)
    assert inv2.expired_hosts() == ["h1", "h2"]


# -- the ledger -------------------------------------------------------------------------------


def test_acquire_is_all_or_nothing(inv):
    register(inv, "h1")
    register(inv, "h2")
    acquire(inv, claim("h2", "gpu1", "other"))
    with pytest.raises(DeviceBusy) as info:
        inv.acquire([claim("h1", "gpu0"), claim("h2", "gpu1")])
    assert "'gpu1'" in info.value.message and "'h2'" in info.value.message
    assert "'other'" in info.value.message
    assert [a.learner_id for a in inv.allocations()] == ["other"]


@pytest.mark.parametrize(
    ("claims", "error", "words"),
    [
        ([claim("h9", "gpu0")], HostNotFound, ["'h9'"]),
        ([claim("h1", "gpu7")], DeviceNotFound, ["'gpu7'", "'h1'"]),
        ([Claim("", "l", "h1", "gpu0")], InvalidField, ["claims[0].job_id"]),
        ([claim("h1", "gpu0"), claim("h1", "gpu0", "x")], InvalidField, ["claims[1].device_id"]),
        ([claim("h1", "gpu0", "l"), claim("h1", "gpu1", "l")], InvalidField, ["learner_id"]),
        ([], InvalidField, ["claims"]),
    ],
)
def test_bad_claims_raise_errors_naming_the_values_and_change_nothing(inv, claims, error, words):
    register(inv, "h1")
    with pytest.raises(error) as info:
        inv.acquire(claims)
    for word in words:
        assert word in str(info.value)
    assert inv.allocations() == []


def test_cordoned_draining_and_lost_hosts_refuse_new_allocations(inv, clock):
    register(inv, "h1")
    register(inv, "h2")
    register(inv, "h3")
    inv.apply(inv.cordon("h1", True))
    inv.apply(inv.drain("h2"))
    clock.advance(4)
    inv.heartbeat("h1", 1)
    inv.heartbeat("h2", 1)
    inv.apply(inv.declare_lost("h3"))
    for host, word in (("h1", "cordoned"), ("h2", "draining"), ("h3", "lost")):
        with pytest.raises(HostUnavailable, match=word):
            inv.acquire([claim(host, "gpu0")])
    inv.apply(inv.cordon("h1", False))
    acquire(inv, claim("h1", "gpu0"))


def test_an_unhealthy_device_is_not_allocated(inv):
    register(inv, "h1")
    outcome = inv.heartbeat("h1", 1, devices=[("gpu0", DeviceHealth.UNHEALTHY, DeviceStats(0, 90))])
    assert outcome.health_changes == (("gpu0", DeviceHealth.UNHEALTHY),)
    change = inv.set_device_health("h1", outcome.health_changes)
    assert [e.kind for e in change.events] == [EventKind.HOST_CHANGED]
    inv.apply(change)
    assert inv.set_device_health("h1", outcome.health_changes).empty
    with pytest.raises(HostUnavailable, match="unhealthy"):
        inv.acquire([claim("h1", "gpu0")])
    assert inv.stats("h1", "gpu0").temperature_celsius == 90


def test_a_learner_holds_at_most_one_device(inv):
    register(inv, "h1")
    acquire(inv, claim("h1", "gpu0", "l1"))
    with pytest.raises(FailedPrecondition, match="'l1' already holds"):
        inv.acquire([claim("h1", "gpu1", "l1")])


def test_acquire_with_a_request_id_is_idempotent(inv):
    register(inv, "h1")
    first = acquire(inv, claim("h1", "gpu0"), claim("h1", "gpu1"), request_id="r1")
    again = inv.acquire([claim("h1", "gpu0"), claim("h1", "gpu1")], "r1")
    assert again.allocations == first and not again.change.writes
    with pytest.raises(InvalidField, match="request_id"):
        inv.acquire([claim("h1", "gpu2")], "r1")
    # Released allocations drop the request record.
    change = inv.release([a.allocation_id for a in first])
    assert change.delete_requests == ("r1",)
    inv.apply(change)
    assert inv.requests() == []


def test_release_frees_devices_and_ignores_unknown_ids(inv):
    register(inv, "h1")
    (a,) = acquire(inv, claim("h1", "gpu0"))
    change = inv.release([a.allocation_id, "nope", a.allocation_id])
    assert [x.allocation_id for x in change.delete_allocations] == [a.allocation_id]
    assert change.events[0].kind is EventKind.RELEASED
    inv.apply(change)
    assert inv.release(["nope"]).empty
    acquire(inv, claim("h1", "gpu0", "again"))
    with pytest.raises(InvalidField, match=r"allocation_ids\[0\]"):
        inv.release([""])


def test_allocations_on_devices_a_host_no_longer_has_are_released_on_registration(inv):
    register(inv, "h1", n=2)
    acquire(inv, claim("h1", "gpu1"))
    change, _ = inv.register(Registration("h1", "127.0.0.1:5002", devices(1)))
    assert [e.kind for e in change.events] == [EventKind.HOST_UP, EventKind.RELEASED]
    inv.apply(change)
    assert inv.allocations() == []


# -- learners ---------------------------------------------------------------------------------


def running(learner_id: str, device: str = "gpu0", incarnation: int = 1) -> LearnerReport:
    return LearnerReport(
        learner_id, "j1", "h1", device, LearnerState.RUNNING, pid=42, host_incarnation=incarnation
    )


def test_learners_without_a_ledger_allocation_are_to_be_stopped(inv):
    register(inv, "h1")
    acquire(inv, claim("h1", "gpu0", "ok"))
    outcome = inv.heartbeat("h1", 1, [running("ok"), running("rogue", "gpu1")])
    assert outcome.stop_learner_ids == ("rogue",)


def test_learners_of_an_older_incarnation_are_not_trusted(inv, clock):
    register(inv, "h1")
    acquire(inv, claim("h1", "gpu0", "old"))
    clock.advance(4)
    inv.apply(inv.declare_lost("h1"))
    register(inv, "h1")  # incarnation 2; the ledger lost "old"
    outcome = inv.heartbeat("h1", 2, [running("old", incarnation=1)])
    assert outcome.stop_learner_ids == ("old",)
    acquire(inv, claim("h1", "gpu0", "old"))  # even a new allocation under the same id
    assert inv.heartbeat("h1", 2, [running("old", incarnation=1)]).stop_learner_ids == ("old",)


def test_a_learner_exit_is_announced_once(inv):
    register(inv, "h1")
    acquire(inv, claim("h1", "gpu0", "l1"))
    inv.heartbeat("h1", 1, [running("l1")])
    done = LearnerReport("l1", "j1", "h1", "gpu0", LearnerState.FAILED, exit_code=3)
    first = inv.heartbeat("h1", 1, [done])
    assert [(e.kind, e.learner.exit_code) for e in first.events] == [(EventKind.LEARNER_EXITED, 3)]
    assert inv.heartbeat("h1", 1, [done]).events == ()
    assert inv.heartbeat("h1", 1, []).events == ()


def test_learners_that_vanish_from_the_agent_report_exit_once(inv):
    register(inv, "h1")
    acquire(inv, claim("h1", "gpu0", "l1"))
    inv.heartbeat("h1", 1, [running("l1")])
    # The agent restarted within the grace: it registers again without the learner.
    change, _ = inv.register(Registration("h1", "127.0.0.1:5002", devices(4)))
    inv.apply(change)
    events = inv.observe_registration_learners(Registration("h1", "127.0.0.1:5002", devices(4)))
    assert [(e.kind, e.learner.learner_id, e.learner.state) for e in events] == [
        (EventKind.LEARNER_EXITED, "l1", LearnerState.FAILED)
    ]
    assert "no longer reports" in events[0].learner.exit_reason
    assert inv.heartbeat("h1", 1, []).events == ()


# -- state machines ---------------------------------------------------------------------------


def test_the_transition_tables_cover_every_state():
    assert set(LIVENESS_TRANSITIONS) == set(Liveness)
    assert set(SCHEDULING_TRANSITIONS) == set(Scheduling)
    assert Liveness.NEW not in set().union(*LIVENESS_TRANSITIONS.values())


def test_cordon_drain_and_uncordon_follow_the_table(inv):
    register(inv, "h1")
    assert inv.cordon("h1", False).empty  # already schedulable
    inv.apply(inv.cordon("h1", True))
    assert inv.cordon("h1", True).empty
    inv.apply(inv.drain("h1"))
    assert inv.host("h1").draining and inv.host("h1").cordoned
    assert inv.cordon("h1", True).empty  # draining is already cordoned
    assert inv.drain("h1").empty
    inv.apply(inv.cordon("h1", False))
    assert inv.host("h1").scheduling is Scheduling.SCHEDULABLE
    history = [(t.source, t.target) for t in inv.history("h1") if t.machine == "scheduling"]
    assert history == [
        ("schedulable", "cordoned"),
        ("cordoned", "draining"),
        ("draining", "schedulable"),
    ]


def test_a_transition_outside_the_table_is_rejected(inv, clock):
    register(inv, "h1")
    clock.advance(4)
    inv.apply(inv.declare_lost("h1"))
    with pytest.raises(InvalidTransition, match="lost -> lost"):
        inv.declare_lost("h1")


def test_a_cordon_survives_the_loss_and_return_of_a_host(inv, clock):
    register(inv, "h1")
    inv.apply(inv.cordon("h1", True))
    clock.advance(4)
    inv.apply(inv.declare_lost("h1"))
    assert register(inv, "h1").scheduling is Scheduling.CORDONED


# -- listing ----------------------------------------------------------------------------------


def test_list_hosts_paginates_by_host_id_and_hides_lost_hosts_unless_asked(inv, clock):
    for i in range(5):
        register(inv, f"h{i}")
    clock.advance(4)
    for i in range(1, 5):
        inv.heartbeat(f"h{i}", 1)
    inv.apply(inv.declare_lost("h0"))
    page, token = inv.list_hosts(2, "", include_lost=False)
    assert [h.host_id for h in page] == ["h1", "h2"] and token
    page, token = inv.list_hosts(2, token, include_lost=False)
    assert [h.host_id for h in page] == ["h3", "h4"] and token == ""
    page, _ = inv.list_hosts(0, "", include_lost=True)
    assert [h.host_id for h in page] == ["h0", "h1", "h2", "h3", "h4"]
    with pytest.raises(InvalidField, match="page_token"):
        inv.list_hosts(2, "garbage!", include_lost=False)
    with pytest.raises(InvalidField, match="page_size"):
        inv.list_hosts(1001, "", include_lost=False)


def test_records_round_trip_through_protobuf(inv):
    register(inv, "h1", labels={"zone": "a"})
    (alloc,) = acquire(inv, claim("h1", "gpu2"))
    inv.apply(inv.drain("h1"))
    host = inv.host("h1")
    assert core.host_from_proto(core.host_to_proto(host)) == host
    assert core.allocation_from_proto(core.allocation_to_proto(alloc)) == alloc
    listed = core.host_to_proto(host, inv)
    assert listed.devices[2].allocation.allocation_id == alloc.allocation_id
    assert listed.draining and listed.cordoned
    assert listed.last_heartbeat_time.seconds > 0
    report = running("l1")
    assert core.learner_from_proto(core.learner_to_proto(report)) == report


def test_a_host_agent_that_says_it_is_stopping_gets_the_restart_grace(inv, clock):
    register(inv, "h1")
    register(inv, "h2")
    inv.note_stopping("h1", 30.0)
    clock.advance(10.0)
    assert inv.expired_hosts() == ["h2"]  # h2 has only the 3 s grace
    clock.advance(21.0)
    assert inv.expired_hosts() == ["h1", "h2"]


def test_the_restart_grace_ends_with_the_next_heartbeat(inv, clock):
    record = register(inv, "h1")
    inv.note_stopping("h1", 30.0)
    clock.advance(5.0)
    inv.heartbeat("h1", record.incarnation)  # it came back: the normal grace again
    clock.advance(3.5)
    assert inv.expired_hosts() == ["h1"]


def test_a_restart_grace_shorter_than_the_grace_never_shortens_it(inv, clock):
    register(inv, "h1")
    inv.note_stopping("h1", 0.5)
    clock.advance(2.0)
    assert inv.expired_hosts() == []
    with pytest.raises(InvalidField, match="restart_grace_s"):
        inv.note_stopping("h1", -1.0)


def test_refresh_liveness_gives_every_ready_host_a_fresh_grace(inv, clock):
    register(inv, "h1")
    register(inv, "h2")
    clock.advance(5.0)
    assert inv.expired_hosts() == ["h1", "h2"]
    beat_before = inv.last_any_beat
    inv.refresh_liveness()
    assert inv.expired_hosts() == []
    assert inv.last_any_beat == beat_before  # a refresh is not a heartbeat
    clock.advance(3.5)
    assert inv.expired_hosts() == ["h1", "h2"]
    assert inv.ready_hosts() == ["h1", "h2"]
