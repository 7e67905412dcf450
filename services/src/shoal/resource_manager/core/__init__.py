"""The resource-manager's core: the inventory and the allocation ledger, without any I/O.

The core holds hosts (with their devices, labels and resource group), the liveness of each host
(from heartbeats, in memory) and the ledger of allocations (device -> learner of a job). It
never talks to etcd or to the network: every mutation is computed as a :class:`Change` (what
to write and which events to announce) *without* touching the state; the service persists the
change (one fenced etcd transaction) and then calls :meth:`Inventory.apply`. If the write
fails, nothing changed. Heartbeat bookkeeping (last seen, utilization, reported learners) is
memory-only and applied at once.

Hosts have two explicit state machines, each a transition table; any other transition is
rejected with :class:`InvalidTransition` and every transition is recorded in the host's history:

* liveness (decided by the resource manager): ``NEW -> READY`` on the first registration,
  ``READY -> READY`` on a re-registration (same incarnation), ``READY -> LOST`` when the host
  stays silent for longer than the grace, ``LOST -> READY`` when it comes back (a new
  incarnation);
* schedulability (decided by admins): ``SCHEDULABLE``, ``CORDONED`` (nothing new is placed on
  it) and ``DRAINING`` (cordoned, and the scheduler moves its learners away). Admin intent
  survives the loss and return of a host.

Errors name the values: ``device 'gpu3' of host 'h1' is held by allocation 'a-1' (job 'j1',
learner 'l1')``. Time comes from injected clocks (``clock``: monotonic seconds, for liveness;
``wall_clock``: epoch seconds, for timestamps), so tests control it.

One module per part: ``records`` (the records and the state machines), ``inventory`` (the
:class:`Inventory`), ``codec`` (page tokens and protobuf conversion). Every name is importable
from here.
"""

from shoal.contract.errors import (
    DeviceBusy,
    DeviceNotFound,
    HostNotFound,
    HostUnavailable,
    InvalidTransition,
    StaleIncarnation,
)
from shoal.resource_manager.core.codec import (
    allocation_from_proto,
    allocation_to_proto,
    claim_from_proto,
    decode_page_token,
    device_from_proto,
    device_stats_from_proto,
    encode_page_token,
    host_from_proto,
    host_to_proto,
    learner_from_proto,
    learner_to_proto,
    registration_from_proto,
    request_from_proto,
    request_to_proto,
)
from shoal.resource_manager.core.inventory import DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE, Inventory
from shoal.resource_manager.core.records import (
    DEFAULT_RESOURCE_GROUP,
    HOST_ID_RE,
    LIVENESS_TRANSITIONS,
    SCHEDULING_TRANSITIONS,
    AcquireOutcome,
    AcquireRecord,
    AllocationRecord,
    Change,
    Claim,
    DeviceHealth,
    DeviceRecord,
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

__all__ = [
    "DEFAULT_PAGE_SIZE",
    "DEFAULT_RESOURCE_GROUP",
    "HOST_ID_RE",
    "LIVENESS_TRANSITIONS",
    "MAX_PAGE_SIZE",
    "SCHEDULING_TRANSITIONS",
    "AcquireOutcome",
    "AcquireRecord",
    "AllocationRecord",
    "Change",
    "Claim",
    "DeviceBusy",
    "DeviceHealth",
    "DeviceNotFound",
    "DeviceRecord",
    "DeviceStats",
    "Event",
    "EventKind",
    "HeartbeatOutcome",
    "HostNotFound",
    "HostRecord",
    "HostUnavailable",
    "InvalidTransition",
    "Inventory",
    "LearnerReport",
    "LearnerState",
    "Liveness",
    "Registration",
    "Scheduling",
    "StaleIncarnation",
    "Transition",
    "allocation_from_proto",
    "allocation_to_proto",
    "claim_from_proto",
    "decode_page_token",
    "device_from_proto",
    "device_stats_from_proto",
    "encode_page_token",
    "host_from_proto",
    "host_to_proto",
    "learner_from_proto",
    "learner_to_proto",
    "registration_from_proto",
    "request_from_proto",
    "request_to_proto",
]
