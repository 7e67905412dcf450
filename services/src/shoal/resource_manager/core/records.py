"""The resource-manager core's records: hosts, devices, allocations, requests, learner
reports, the events and changes the inventory computes, and the two host state machines
(liveness, schedulability) as transition tables. Plain data, no I/O."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from shoal.contract import ids
from shoal.v1 import resource_manager_service_pb2 as rm_pb2, resources_pb2

#: The pattern of host ids (and, by ``shoal.contract.ids``, of device ids and resource
#: groups): one shared place for every identifier that becomes a path or a key.
HOST_ID_RE = ids.PATTERNS[ids.IdKind.HOST]
DEFAULT_RESOURCE_GROUP = "default"


# --------------------------------------------------------------------------------------------
# States and transition tables
# --------------------------------------------------------------------------------------------


class Liveness(enum.Enum):
    """Whether a host's agent is alive, as the resource manager decides it."""

    NEW = "new"  # never registered (only as the origin of the first transition)
    READY = "ready"
    LOST = "lost"


class Scheduling(enum.Enum):
    """Whether new learners may be placed on a host, as admins decide it."""

    SCHEDULABLE = "schedulable"
    CORDONED = "cordoned"
    DRAINING = "draining"


LIVENESS_TRANSITIONS: dict[Liveness, set[Liveness]] = {
    Liveness.NEW: {Liveness.READY},
    Liveness.READY: {Liveness.READY, Liveness.LOST},  # READY -> READY: a re-registration
    Liveness.LOST: {Liveness.READY},  # comes back as a new incarnation
}

SCHEDULING_TRANSITIONS: dict[Scheduling, set[Scheduling]] = {
    Scheduling.SCHEDULABLE: {Scheduling.CORDONED, Scheduling.DRAINING},
    Scheduling.CORDONED: {Scheduling.SCHEDULABLE, Scheduling.DRAINING},
    Scheduling.DRAINING: {Scheduling.SCHEDULABLE},
}


class DeviceHealth(enum.Enum):
    UNKNOWN = resources_pb2.DEVICE_HEALTH_UNSPECIFIED
    HEALTHY = resources_pb2.DEVICE_HEALTH_HEALTHY
    UNHEALTHY = resources_pb2.DEVICE_HEALTH_UNHEALTHY


class LearnerState(enum.Enum):
    UNKNOWN = resources_pb2.LEARNER_STATE_UNSPECIFIED
    STARTING = resources_pb2.LEARNER_STATE_STARTING
    RUNNING = resources_pb2.LEARNER_STATE_RUNNING
    STOPPING = resources_pb2.LEARNER_STATE_STOPPING
    SUCCEEDED = resources_pb2.LEARNER_STATE_SUCCEEDED
    FAILED = resources_pb2.LEARNER_STATE_FAILED

    @property
    def terminal(self) -> bool:
        return self in (LearnerState.SUCCEEDED, LearnerState.FAILED)


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceRecord:
    """A device as registered (what is durable); utilization lives in :class:`DeviceStats`."""

    device_id: str
    index: int = 0
    uuid: str = ""
    model: str = ""
    memory_bytes: int = 0
    health: DeviceHealth = DeviceHealth.HEALTHY
    simulated: bool = False


@dataclass(frozen=True)
class DeviceStats:
    """The last sampled utilization and temperature of a device (memory only)."""

    utilization_percent: float = 0.0
    temperature_celsius: float = 0.0


@dataclass(frozen=True)
class HostRecord:
    """A host as stored in etcd."""

    host_id: str
    agent_address: str
    incarnation: int
    liveness: Liveness
    scheduling: Scheduling = Scheduling.SCHEDULABLE
    labels: Mapping[str, str] = field(default_factory=dict)
    resource_group: str = DEFAULT_RESOURCE_GROUP
    devices: tuple[DeviceRecord, ...] = ()
    register_time: float = 0.0  # epoch seconds

    def device(self, device_id: str) -> DeviceRecord | None:
        return next((d for d in self.devices if d.device_id == device_id), None)

    @property
    def cordoned(self) -> bool:
        return self.scheduling is not Scheduling.SCHEDULABLE

    @property
    def draining(self) -> bool:
        return self.scheduling is Scheduling.DRAINING


@dataclass(frozen=True)
class AllocationRecord:
    """One row of the ledger: a device held for one learner of one job."""

    allocation_id: str
    job_id: str
    learner_id: str
    host_id: str
    device_id: str
    host_incarnation: int
    create_time: float = 0.0  # epoch seconds

    @property
    def claim(self) -> Claim:
        return Claim(self.job_id, self.learner_id, self.host_id, self.device_id)


@dataclass(frozen=True)
class Claim:
    """A request for one device for one learner."""

    job_id: str
    learner_id: str
    host_id: str
    device_id: str


@dataclass(frozen=True)
class AcquireRecord:
    """What an AcquireDevices with a request id returned, so that a retry returns it again."""

    request_id: str
    allocations: tuple[AllocationRecord, ...]


@dataclass(frozen=True)
class LearnerReport:
    """A learner as its host's agent reports it."""

    learner_id: str
    job_id: str = ""
    host_id: str = ""
    device_id: str = ""
    state: LearnerState = LearnerState.UNKNOWN
    pid: int = 0
    exit_code: int = 0
    exit_reason: str = ""
    start_time: float = 0.0
    end_time: float = 0.0
    host_incarnation: int = 0


@dataclass(frozen=True)
class Registration:
    """What RegisterHost carries (validated by :meth:`Inventory.register`)."""

    host_id: str
    agent_address: str
    devices: tuple[DeviceRecord, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    resource_group: str = ""
    learners: tuple[LearnerReport, ...] = ()


class EventKind(enum.Enum):
    SNAPSHOT = rm_pb2.INVENTORY_EVENT_KIND_SNAPSHOT
    HOST_UP = rm_pb2.INVENTORY_EVENT_KIND_HOST_UP
    HOST_LOST = rm_pb2.INVENTORY_EVENT_KIND_HOST_LOST
    HOST_CHANGED = rm_pb2.INVENTORY_EVENT_KIND_HOST_CHANGED
    ALLOCATED = rm_pb2.INVENTORY_EVENT_KIND_ALLOCATED
    RELEASED = rm_pb2.INVENTORY_EVENT_KIND_RELEASED
    LEARNER_EXITED = rm_pb2.INVENTORY_EVENT_KIND_LEARNER_EXITED


@dataclass(frozen=True)
class Event:
    """An inventory event as WatchInventory announces it. ``hosts`` are host ids (the service
    renders them with their current devices and allocations)."""

    kind: EventKind
    hosts: tuple[str, ...] = ()
    allocations: tuple[AllocationRecord, ...] = ()
    learner: LearnerReport | None = None


@dataclass(frozen=True)
class Change:
    """A mutation, computed but not applied: what to write to etcd, then the events to send."""

    put_hosts: tuple[HostRecord, ...] = ()
    put_allocations: tuple[AllocationRecord, ...] = ()
    delete_allocations: tuple[AllocationRecord, ...] = ()
    put_requests: tuple[AcquireRecord, ...] = ()
    delete_requests: tuple[str, ...] = ()
    events: tuple[Event, ...] = ()

    @property
    def empty(self) -> bool:
        return not (
            self.put_hosts
            or self.put_allocations
            or self.delete_allocations
            or self.put_requests
            or self.delete_requests
            or self.events
        )

    @property
    def writes(self) -> bool:
        """Whether the change has anything to persist."""
        return bool(
            self.put_hosts
            or self.put_allocations
            or self.delete_allocations
            or self.put_requests
            or self.delete_requests
        )


@dataclass(frozen=True)
class Transition:
    """One recorded state change of a host."""

    time: float  # epoch seconds
    machine: str  # "liveness" or "scheduling"
    source: str
    target: str
    reason: str


@dataclass(frozen=True)
class HeartbeatOutcome:
    """What a heartbeat produced: learners the agent must stop, learner-exit events (memory
    only), and the devices whose health changed (to persist)."""

    stop_learner_ids: tuple[str, ...]
    events: tuple[Event, ...]
    health_changes: tuple[tuple[str, DeviceHealth], ...] = ()


@dataclass(frozen=True)
class AcquireOutcome:
    """The allocations for the claims (in order) and the change to persist (empty for a
    retried request)."""

    allocations: tuple[AllocationRecord, ...]
    change: Change
