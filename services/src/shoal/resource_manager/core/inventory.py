"""The resource-manager core's :class:`Inventory`: hosts, liveness and the allocation ledger.
Every mutation is computed as a :class:`Change` without touching the state; the service
persists it, then calls :meth:`Inventory.apply` (see :mod:`shoal.resource_manager.core`)."""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TypeVar

from shoal.contract import ids
from shoal.contract.errors import (
    DeviceBusy,
    DeviceNotFound,
    FailedPrecondition,
    HostNotFound,
    HostUnavailable,
    InvalidField,
    InvalidTransition,
    StaleIncarnation,
)
from shoal.resource_manager.core.codec import decode_page_token, encode_page_token
from shoal.resource_manager.core.records import (
    DEFAULT_RESOURCE_GROUP,
    LIVENESS_TRANSITIONS,
    SCHEDULING_TRANSITIONS,
    AcquireOutcome,
    AcquireRecord,
    AllocationRecord,
    Change,
    Claim,
    DeviceHealth,
    DeviceStats,
    Event,
    EventKind,
    HeartbeatOutcome,
    HostRecord,
    LearnerReport,
    LearnerState,
    Liveness,
    Registration,
    Scheduling,
    Transition,
)

MAX_PAGE_SIZE = 1000
DEFAULT_PAGE_SIZE = 100
_EXITED_MEMORY = 100_000  # learner ids whose exit was announced, for once-only LEARNER_EXITED
_HISTORY_PER_HOST = 64

# --------------------------------------------------------------------------------------------
# The inventory
# --------------------------------------------------------------------------------------------


def _new_allocation_id() -> str:
    return f"a-{uuid.uuid4().hex[:16]}"


_S = TypeVar("_S", Liveness, Scheduling)


def _check_transition(table: Mapping[_S, set[_S]], source: _S, target: _S, what: str) -> None:
    if target not in table.get(source, set()):
        raise InvalidTransition(f"{what}: {source.value} -> {target.value} is not allowed")


class Inventory:
    """Hosts, liveness and the ledger. Not thread-safe; the service serializes mutations."""

    def __init__(
        self,
        *,
        grace_s: float,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        new_allocation_id: Callable[[], str] = _new_allocation_id,
    ) -> None:
        if grace_s <= 0:
            raise InvalidField("grace_s", grace_s, "must be > 0")
        self.grace_s = grace_s
        self._clock = clock
        self._wall = wall_clock
        self._new_id = new_allocation_id
        self._reset()

    def _reset(self) -> None:
        self._hosts: dict[str, HostRecord] = {}
        self._allocations: dict[str, AllocationRecord] = {}
        self._by_device: dict[tuple[str, str], str] = {}
        self._by_learner: dict[str, str] = {}
        self._requests: dict[str, AcquireRecord] = {}
        self._request_of: dict[str, str] = {}  # allocation id -> request id
        # Memory only:
        self._last_seen: dict[str, float] = {}  # host -> monotonic time of the last beat
        self._last_beat_wall: dict[str, float] = {}
        # host -> seconds of silence allowed instead of the grace (a host agent that said it
        # is stopping to restart: ``note_stopping``); cleared by its next heartbeat.
        self._allowed_silence: dict[str, float] = {}
        self._last_any_beat = float("-inf")  # monotonic time of the last beat of any host
        self._stats: dict[tuple[str, str], DeviceStats] = {}
        self._live_learners: dict[str, dict[str, LearnerReport]] = {}
        self._exited: OrderedDict[str, None] = OrderedDict()
        self._history: dict[str, deque[Transition]] = {}

    # -- loading -------------------------------------------------------------------------------

    def load(
        self,
        hosts: Iterable[HostRecord],
        allocations: Iterable[AllocationRecord],
        requests: Iterable[AcquireRecord] = (),
        *,
        keep_memory: bool = False,
    ) -> None:
        """Replace the state with what was read from the store.

        A new leader's rebuild (``keep_memory`` False): memory-only state starts empty and every
        READY host gets a fresh grace from now: it has that long to heartbeat to this leader
        before it is declared lost. A resync of the same leader (``keep_memory`` True, after a
        write whose outcome was unknown) keeps liveness, statistics and learner reports.
        """
        last_seen = self._last_seen
        if keep_memory:
            saved = (
                self._last_beat_wall,
                self._stats,
                self._live_learners,
                self._exited,
                self._history,
            )
        self._reset()
        if keep_memory:
            (
                self._last_beat_wall,
                self._stats,
                self._live_learners,
                self._exited,
                self._history,
            ) = saved
        now = self._clock()
        for host in hosts:
            self._hosts[host.host_id] = host
            if host.liveness is Liveness.READY:
                self._last_seen[host.host_id] = (
                    last_seen.get(host.host_id, now) if keep_memory else now
                )
        for alloc in allocations:
            self._add_allocation(alloc)
        for request in requests:
            self._add_request(request)

    # -- queries -------------------------------------------------------------------------------

    def host(self, host_id: str) -> HostRecord:
        host = self._hosts.get(host_id)
        if host is None:
            raise HostNotFound(host_id)
        return host

    def hosts(self, *, include_lost: bool = True) -> list[HostRecord]:
        return [
            h
            for _, h in sorted(self._hosts.items())
            if include_lost or h.liveness is not Liveness.LOST
        ]

    def list_hosts(
        self, page_size: int, page_token: str, *, include_lost: bool
    ) -> tuple[list[HostRecord], str]:
        """A page of hosts by host id and the token of the next page ("" on the last)."""
        if page_size < 0 or page_size > MAX_PAGE_SIZE:
            raise InvalidField("page_size", page_size, f"must be in 0..{MAX_PAGE_SIZE}")
        size = page_size or DEFAULT_PAGE_SIZE
        after = decode_page_token(page_token)
        hosts = [h for h in self.hosts(include_lost=include_lost) if h.host_id > after]
        page = hosts[:size]
        next_token = encode_page_token(page[-1].host_id) if len(hosts) > size else ""
        return page, next_token

    def allocations(self, job_id: str = "") -> list[AllocationRecord]:
        allocs = sorted(self._allocations.values(), key=lambda a: (a.host_id, a.device_id))
        return [a for a in allocs if not job_id or a.job_id == job_id]

    def allocation(self, allocation_id: str) -> AllocationRecord | None:
        return self._allocations.get(allocation_id)

    def allocation_of_device(self, host_id: str, device_id: str) -> AllocationRecord | None:
        alloc_id = self._by_device.get((host_id, device_id))
        return self._allocations[alloc_id] if alloc_id is not None else None

    def allocations_of_host(self, host_id: str) -> list[AllocationRecord]:
        return [a for a in self.allocations() if a.host_id == host_id]

    def requests(self) -> list[AcquireRecord]:
        return list(self._requests.values())

    def stats(self, host_id: str, device_id: str) -> DeviceStats:
        return self._stats.get((host_id, device_id), DeviceStats())

    def last_heartbeat_time(self, host_id: str) -> float | None:
        """Epoch seconds of the last heartbeat this replica heard from the host, if any."""
        return self._last_beat_wall.get(host_id)

    def history(self, host_id: str) -> list[Transition]:
        return list(self._history.get(host_id, ()))

    def live_learners(self, host_id: str) -> dict[str, LearnerReport]:
        return dict(self._live_learners.get(host_id, {}))

    # -- liveness ------------------------------------------------------------------------------

    def expired_hosts(self) -> list[str]:
        """READY hosts that have not been heard from for longer than the grace (or than the
        restart grace of a host agent that said it was stopping)."""
        now = self._clock()
        return sorted(
            host_id
            for host_id, host in self._hosts.items()
            if host.liveness is Liveness.READY
            and now - self._last_seen.get(host_id, now)
            > self._allowed_silence.get(host_id, self.grace_s)
        )

    def ready_hosts(self) -> list[str]:
        return sorted(h for h, host in self._hosts.items() if host.liveness is Liveness.READY)

    @property
    def last_any_beat(self) -> float:
        """Monotonic time of the last heartbeat or registration of any host."""
        return self._last_any_beat

    def refresh_liveness(self) -> None:
        """Every READY host gets a fresh grace from now: the silence was on this replica's side
        (its liveness loop ran late, or every host went silent at once), not the hosts'."""
        now = self._clock()
        for host_id in self.ready_hosts():
            self._last_seen[host_id] = now

    def note_stopping(self, host_id: str, restart_grace_s: float) -> None:
        """The host's agent is stopping to restart: allow it ``restart_grace_s`` of silence
        (from now) before it is declared lost, instead of the grace."""
        if restart_grace_s < 0:
            raise InvalidField("restart_grace_s", restart_grace_s, "must be >= 0")
        self.mark_seen(host_id)
        self._allowed_silence[host_id] = max(restart_grace_s, self.grace_s)

    def silence(self, host_id: str) -> float:
        """Seconds since the host was last heard from (0 for hosts never seen by this replica)."""
        seen = self._last_seen.get(host_id)
        return 0.0 if seen is None else self._clock() - seen

    def declare_lost(self, host_id: str) -> Change:
        """The host went silent: it becomes LOST, and its allocations leave the ledger (they are
        announced in the HOST_LOST event; the learners of this incarnation are never trusted
        again)."""
        host = self.host(host_id)
        _check_transition(
            LIVENESS_TRANSITIONS, host.liveness, Liveness.LOST, f"host {host_id!r} liveness"
        )
        lost = replace(host, liveness=Liveness.LOST)
        held = tuple(self.allocations_of_host(host_id))
        return Change(
            put_hosts=(lost,),
            delete_allocations=held,
            delete_requests=self._requests_emptied_by(held),
            events=(Event(EventKind.HOST_LOST, (host_id,), held),),
        )

    # -- registration and heartbeats -----------------------------------------------------------

    def register(self, reg: Registration) -> tuple[Change, HostRecord]:
        """A host agent registers: a new host (incarnation 1), a lost host coming back (a new
        incarnation), or a READY host registering again (after a failover of the resource
        manager or an agent restart within the grace: same incarnation)."""
        self._validate_registration(reg)
        old = self._hosts.get(reg.host_id)
        now = self._wall()
        group = reg.resource_group or DEFAULT_RESOURCE_GROUP
        if old is None:
            incarnation, scheduling = 1, Scheduling.SCHEDULABLE
            source = Liveness.NEW
        else:
            source = old.liveness
            scheduling = old.scheduling
            incarnation = old.incarnation + (1 if old.liveness is Liveness.LOST else 0)
        _check_transition(
            LIVENESS_TRANSITIONS, source, Liveness.READY, f"host {reg.host_id!r} liveness"
        )
        keep_time = old is not None and source is Liveness.READY
        record = HostRecord(
            host_id=reg.host_id,
            agent_address=reg.agent_address,
            incarnation=incarnation,
            liveness=Liveness.READY,
            scheduling=scheduling,
            labels=dict(reg.labels),
            resource_group=group,
            devices=tuple(reg.devices),
            register_time=old.register_time if keep_time and old is not None else now,
        )
        # Allocations on devices the host no longer has are released.
        gone = tuple(
            a for a in self.allocations_of_host(reg.host_id) if record.device(a.device_id) is None
        )
        events = [Event(EventKind.HOST_UP, (reg.host_id,))]
        if gone:
            events.append(Event(EventKind.RELEASED, (reg.host_id,), gone))
        change = Change(
            put_hosts=(record,),
            delete_allocations=gone,
            delete_requests=self._requests_emptied_by(gone),
            events=tuple(events),
        )
        return change, record

    def heartbeat(
        self,
        host_id: str,
        incarnation: int,
        learners: Sequence[LearnerReport] = (),
        devices: Sequence[tuple[str, DeviceHealth, DeviceStats]] = (),
    ) -> HeartbeatOutcome:
        """One heartbeat: the host is alive now. Returns the learners to stop (running without
        a ledger allocation), the learner exits to announce, and the devices whose health
        changed (persist them with :meth:`set_device_health`)."""
        if not host_id:
            raise InvalidField("host_id", host_id, "must not be empty")
        host = self.host(host_id)
        if host.liveness is Liveness.LOST:
            raise StaleIncarnation(
                f"host {host_id!r} incarnation {host.incarnation} was declared lost: register again"
            )
        if incarnation != host.incarnation:
            raise StaleIncarnation(
                f"incarnation ({incarnation}) of host {host_id!r} is stale (current "
                f"{host.incarnation}): register again"
            )
        self.mark_seen(host_id)
        changed: list[tuple[str, DeviceHealth]] = []
        for device_id, health, stats in devices:
            dev = host.device(device_id)
            if dev is None:
                continue
            self._stats[(host_id, device_id)] = stats
            if health is not DeviceHealth.UNKNOWN and health is not dev.health:
                changed.append((device_id, health))
        events, stop = self._observe_learners(host, learners)
        return HeartbeatOutcome(tuple(stop), tuple(events), tuple(changed))

    def set_device_health(self, host_id: str, health: Sequence[tuple[str, DeviceHealth]]) -> Change:
        """Persist new device health (rare: only when it changes). Announced as HOST_CHANGED."""
        host = self.host(host_id)
        wanted = dict(health)
        devices = tuple(
            replace(d, health=wanted[d.device_id])
            if d.device_id in wanted and wanted[d.device_id] is not d.health
            else d
            for d in host.devices
        )
        if devices == host.devices:
            return Change()
        return Change(
            put_hosts=(replace(host, devices=devices),),
            events=(Event(EventKind.HOST_CHANGED, (host_id,)),),
        )

    def mark_seen(self, host_id: str) -> None:
        """The host was heard from (its registration counts as a heartbeat)."""
        self._last_seen[host_id] = self._last_any_beat = self._clock()
        self._last_beat_wall[host_id] = self._wall()
        self._allowed_silence.pop(host_id, None)

    def observe_registration_learners(self, reg: Registration) -> list[Event]:
        """After a registration was applied: the learners it reports (exits, vanished ones)."""
        host = self.host(reg.host_id)
        events, _ = self._observe_learners(host, reg.learners)
        return events

    def _observe_learners(
        self, host: HostRecord, reports: Sequence[LearnerReport]
    ) -> tuple[list[Event], list[str]]:
        """Learner exits (each announced once), learners that vanished from the agent's full
        report (the agent restarted: they died with it), and learners to stop."""
        live = self._live_learners.setdefault(host.host_id, {})
        events: list[Event] = []
        stop: list[str] = []
        seen: set[str] = set()
        for report in reports:
            if not report.learner_id:
                continue
            seen.add(report.learner_id)
            if report.state.terminal:
                live.pop(report.learner_id, None)
                if self._remember_exit(report.learner_id):
                    events.append(Event(EventKind.LEARNER_EXITED, (host.host_id,), (), report))
                continue
            live[report.learner_id] = report
            if report.state is not LearnerState.STOPPING and not self._trusted(host, report):
                stop.append(report.learner_id)
        for learner_id in [lid for lid in live if lid not in seen]:
            report = live.pop(learner_id)
            if self._remember_exit(learner_id):
                vanished = replace(
                    report,
                    state=LearnerState.FAILED,
                    pid=0,
                    exit_code=-9,
                    exit_reason=(
                        f"the agent of host {host.host_id!r} no longer reports the learner (the "
                        "agent restarted; its learners are killed with it)"
                    ),
                    end_time=self._wall(),
                )
                events.append(Event(EventKind.LEARNER_EXITED, (host.host_id,), (), vanished))
        return events, stop

    def _trusted(self, host: HostRecord, report: LearnerReport) -> bool:
        alloc_id = self._by_learner.get(report.learner_id)
        if alloc_id is None:
            return False
        alloc = self._allocations[alloc_id]
        return (
            alloc.host_id == host.host_id
            and (not report.device_id or alloc.device_id == report.device_id)
            and report.host_incarnation >= alloc.host_incarnation
        )

    def _remember_exit(self, learner_id: str) -> bool:
        if learner_id in self._exited:
            return False
        self._exited[learner_id] = None
        while len(self._exited) > _EXITED_MEMORY:
            self._exited.popitem(last=False)
        return True

    # -- admin ---------------------------------------------------------------------------------

    def cordon(self, host_id: str, cordon: bool) -> Change:
        """Cordon (or uncordon, which also ends a drain). Cordoning a cordoned or draining host,
        or uncordoning a schedulable one, changes nothing."""
        host = self.host(host_id)
        if cordon:
            if host.scheduling is not Scheduling.SCHEDULABLE:
                return Change()
            target = Scheduling.CORDONED
        else:
            if host.scheduling is Scheduling.SCHEDULABLE:
                return Change()
            target = Scheduling.SCHEDULABLE
        return self._schedule(host, target)

    def drain(self, host_id: str) -> Change:
        host = self.host(host_id)
        if host.scheduling is Scheduling.DRAINING:
            return Change()
        return self._schedule(host, Scheduling.DRAINING)

    def _schedule(self, host: HostRecord, target: Scheduling) -> Change:
        _check_transition(
            SCHEDULING_TRANSITIONS,
            host.scheduling,
            target,
            f"host {host.host_id!r} scheduling",
        )
        return Change(
            put_hosts=(replace(host, scheduling=target),),
            events=(Event(EventKind.HOST_CHANGED, (host.host_id,)),),
        )

    # -- the ledger ----------------------------------------------------------------------------

    def acquire(self, claims: Sequence[Claim], request_id: str = "") -> AcquireOutcome:
        """Allocate one device per claim, all or nothing.

        A request id already seen returns the same allocations (if the claims are the same).
        Raises InvalidField (empty or duplicated values), HostNotFound, DeviceNotFound,
        HostUnavailable (lost, cordoned, draining), DeviceBusy, FailedPrecondition (learner
        already holds a device, device unhealthy).
        """
        if request_id and request_id in self._requests:
            previous = self._requests[request_id]
            if tuple(a.claim for a in previous.allocations) != tuple(claims):
                raise InvalidField(
                    "request_id", request_id, "was already used with different claims"
                )
            return AcquireOutcome(previous.allocations, Change())
        if not claims:
            raise InvalidField("claims", [], "must name at least one device")
        devices: set[tuple[str, str]] = set()
        learners: set[str] = set()
        now = self._wall()
        new: list[AllocationRecord] = []
        for i, claim in enumerate(claims):
            for name in ("job_id", "learner_id", "host_id", "device_id"):
                if not getattr(claim, name):
                    raise InvalidField(f"claims[{i}].{name}", "", "must not be empty")
            key = (claim.host_id, claim.device_id)
            if key in devices:
                raise InvalidField(
                    f"claims[{i}].device_id",
                    claim.device_id,
                    f"is claimed twice on host {claim.host_id!r} in this request",
                )
            if claim.learner_id in learners:
                raise InvalidField(
                    f"claims[{i}].learner_id", claim.learner_id, "is claimed twice in this request"
                )
            devices.add(key)
            learners.add(claim.learner_id)
            host = self.host(claim.host_id)
            device = host.device(claim.device_id)
            if device is None:
                raise DeviceNotFound(claim.device_id, host_id=claim.host_id)
            if host.liveness is Liveness.LOST:
                raise HostUnavailable(f"host {claim.host_id!r} is lost")
            if host.scheduling is not Scheduling.SCHEDULABLE:
                raise HostUnavailable(f"host {claim.host_id!r} is {host.scheduling.value}")
            if device.health is DeviceHealth.UNHEALTHY:
                raise HostUnavailable(
                    f"device {claim.device_id!r} of host {claim.host_id!r} is unhealthy"
                )
            held = self.allocation_of_device(claim.host_id, claim.device_id)
            if held is not None:
                raise DeviceBusy(
                    f"device {claim.device_id!r} of host {claim.host_id!r} is held by "
                    f"allocation {held.allocation_id!r} (job {held.job_id!r}, learner "
                    f"{held.learner_id!r})"
                )
            other = self._by_learner.get(claim.learner_id)
            if other is not None:
                mine = self._allocations[other]
                raise FailedPrecondition(
                    f"learner {claim.learner_id!r} already holds allocation "
                    f"{mine.allocation_id!r} (device {mine.device_id!r} of host {mine.host_id!r})"
                )
            new.append(
                AllocationRecord(
                    allocation_id=self._new_id(),
                    job_id=claim.job_id,
                    learner_id=claim.learner_id,
                    host_id=claim.host_id,
                    device_id=claim.device_id,
                    host_incarnation=host.incarnation,
                    create_time=now,
                )
            )
        allocations = tuple(new)
        hosts = tuple(sorted({a.host_id for a in allocations}))
        change = Change(
            put_allocations=allocations,
            put_requests=(AcquireRecord(request_id, allocations),) if request_id else (),
            events=(Event(EventKind.ALLOCATED, hosts, allocations),),
        )
        return AcquireOutcome(allocations, change)

    def release(self, allocation_ids: Sequence[str]) -> Change:
        """Free the named allocations; ids not in the ledger are ignored."""
        for i, alloc_id in enumerate(allocation_ids):
            if not alloc_id:
                raise InvalidField(f"allocation_ids[{i}]", alloc_id, "must not be empty")
        freed: list[AllocationRecord] = []
        for alloc_id in dict.fromkeys(allocation_ids):
            alloc = self._allocations.get(alloc_id)
            if alloc is not None:
                freed.append(alloc)
        if not freed:
            return Change()
        held = tuple(freed)
        hosts = tuple(sorted({a.host_id for a in held}))
        return Change(
            delete_allocations=held,
            delete_requests=self._requests_emptied_by(held),
            events=(Event(EventKind.RELEASED, hosts, held),),
        )

    def _requests_emptied_by(self, removed: Sequence[AllocationRecord]) -> tuple[str, ...]:
        """Request records none of whose allocations stay in the ledger after ``removed``."""
        gone = {a.allocation_id for a in removed}
        out: list[str] = []
        for request_id in dict.fromkeys(self._request_of[a] for a in gone if a in self._request_of):
            record = self._requests[request_id]
            if all(
                a.allocation_id in gone or a.allocation_id not in self._allocations
                for a in record.allocations
            ):
                out.append(request_id)
        return tuple(out)

    # -- applying changes ----------------------------------------------------------------------

    def apply(self, change: Change) -> None:
        """Make a change that was persisted part of the state."""
        for host in change.put_hosts:
            old = self._hosts.get(host.host_id)
            self._record_transitions(old, host)
            self._hosts[host.host_id] = host
            if host.liveness is Liveness.LOST:
                self._last_seen.pop(host.host_id, None)
                self._live_learners.pop(host.host_id, None)
                for dev in host.devices:
                    self._stats.pop((host.host_id, dev.device_id), None)
            elif old is None or old.liveness is not Liveness.READY:
                self._last_seen[host.host_id] = self._clock()
        for alloc in change.delete_allocations:
            self._remove_allocation(alloc.allocation_id)
        for alloc in change.put_allocations:
            self._add_allocation(alloc)
        for request in change.put_requests:
            self._add_request(request)
        for request_id in change.delete_requests:
            record = self._requests.pop(request_id, None)
            if record is not None:
                for a in record.allocations:
                    self._request_of.pop(a.allocation_id, None)

    def _record_transitions(self, old: HostRecord | None, new: HostRecord) -> None:
        history = self._history.setdefault(new.host_id, deque(maxlen=_HISTORY_PER_HOST))
        now = self._wall()
        source = old.liveness if old is not None else Liveness.NEW
        if old is None or old.liveness is not new.liveness or old.incarnation != new.incarnation:
            reason = f"incarnation {new.incarnation}"
            history.append(Transition(now, "liveness", source.value, new.liveness.value, reason))
        if old is not None and old.scheduling is not new.scheduling:
            history.append(
                Transition(now, "scheduling", old.scheduling.value, new.scheduling.value, "admin")
            )

    def _add_allocation(self, alloc: AllocationRecord) -> None:
        self._allocations[alloc.allocation_id] = alloc
        self._by_device[(alloc.host_id, alloc.device_id)] = alloc.allocation_id
        self._by_learner[alloc.learner_id] = alloc.allocation_id

    def _remove_allocation(self, alloc_id: str) -> None:
        alloc = self._allocations.pop(alloc_id, None)
        if alloc is None:
            return
        if self._by_device.get((alloc.host_id, alloc.device_id)) == alloc_id:
            del self._by_device[(alloc.host_id, alloc.device_id)]
        if self._by_learner.get(alloc.learner_id) == alloc_id:
            del self._by_learner[alloc.learner_id]

    def _add_request(self, request: AcquireRecord) -> None:
        self._requests[request.request_id] = request
        for a in request.allocations:
            self._request_of[a.allocation_id] = request.request_id

    # -- validation ----------------------------------------------------------------------------

    @staticmethod
    def _validate_registration(reg: Registration) -> None:
        if not ids.is_valid(ids.IdKind.HOST, reg.host_id):
            raise InvalidField("host_id", reg.host_id, ids.describe(ids.IdKind.HOST))
        address = reg.agent_address
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise InvalidField("agent_address", address, "must be HOST:PORT with a port 1..65535")
        seen: set[str] = set()
        for i, dev in enumerate(reg.devices):
            if not dev.device_id:
                raise InvalidField(f"devices[{i}].device_id", dev.device_id, "must not be empty")
            if not ids.is_valid(ids.IdKind.DEVICE, dev.device_id):
                raise InvalidField(
                    f"devices[{i}].device_id", dev.device_id, ids.describe(ids.IdKind.DEVICE)
                )
            if dev.device_id in seen:
                raise InvalidField(f"devices[{i}].device_id", dev.device_id, "is listed twice")
            if dev.index < 0:
                raise InvalidField(f"devices[{i}].index", dev.index, "must be >= 0")
            seen.add(dev.device_id)
        if reg.resource_group and not ids.is_valid(ids.IdKind.RESOURCE_GROUP, reg.resource_group):
            raise InvalidField(
                "resource_group", reg.resource_group, ids.describe(ids.IdKind.RESOURCE_GROUP)
            )
        for key in reg.labels:
            if not key:
                raise InvalidField("labels", key, "keys must not be empty")
