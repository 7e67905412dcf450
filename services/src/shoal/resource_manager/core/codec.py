"""The resource-manager core's conversions: page tokens of ListHosts, and the records to and
from protobuf (the etcd values and the API messages)."""

from __future__ import annotations

import base64
import binascii
from typing import TYPE_CHECKING

from google.protobuf import timestamp_pb2

from shoal.contract.errors import (
    InvalidField,
)
from shoal.resource_manager.core.records import (
    DEFAULT_RESOURCE_GROUP,
    AcquireRecord,
    AllocationRecord,
    Claim,
    DeviceHealth,
    DeviceRecord,
    DeviceStats,
    HostRecord,
    LearnerReport,
    LearnerState,
    Liveness,
    Registration,
    Scheduling,
)
from shoal.v1 import resource_manager_service_pb2 as rm_pb2, resources_pb2

if TYPE_CHECKING:
    from shoal.resource_manager.core.inventory import Inventory

_PAGE_TOKEN_PREFIX = "h1:"

# --------------------------------------------------------------------------------------------
# Page tokens
# --------------------------------------------------------------------------------------------


def encode_page_token(last_host_id: str) -> str:
    raw = (_PAGE_TOKEN_PREFIX + last_host_id).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_page_token(token: str) -> str:
    """The host id after which the page starts ("" for the first page)."""
    if not token:
        return ""
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raw = ""
    if not raw.startswith(_PAGE_TOKEN_PREFIX):
        raise InvalidField("page_token", token, "is not a page token this service issued")
    return raw[len(_PAGE_TOKEN_PREFIX) :]


# --------------------------------------------------------------------------------------------
# Protobuf conversion (the etcd values and the API messages)
# --------------------------------------------------------------------------------------------


def _ts(seconds: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    if seconds:
        ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def _seconds(ts: timestamp_pb2.Timestamp) -> float:
    return ts.seconds + ts.nanos / 1e9


def device_from_proto(pb: resources_pb2.Device) -> DeviceRecord:
    return DeviceRecord(
        device_id=pb.device_id,
        index=pb.index,
        uuid=pb.uuid,
        model=pb.model,
        memory_bytes=pb.memory_bytes,
        health=DeviceHealth(pb.health),
        simulated=pb.simulated,
    )


def device_stats_from_proto(pb: resources_pb2.Device) -> tuple[str, DeviceHealth, DeviceStats]:
    return (
        pb.device_id,
        DeviceHealth(pb.health),
        DeviceStats(pb.utilization_percent, pb.temperature_celsius),
    )


def host_to_proto(host: HostRecord, inventory: Inventory | None = None) -> resources_pb2.Host:
    """The host as stored (``inventory`` None) or as listed (with allocations, utilization and
    the last heartbeat time from ``inventory``)."""
    pb = resources_pb2.Host(
        host_id=host.host_id,
        agent_address=host.agent_address,
        incarnation=host.incarnation,
        state=(
            resources_pb2.HOST_STATE_LOST
            if host.liveness is Liveness.LOST
            else resources_pb2.HOST_STATE_READY
        ),
        cordoned=host.cordoned,
        draining=host.draining,
        labels=dict(host.labels),
        resource_group=host.resource_group,
        register_time=_ts(host.register_time),
    )
    for dev in host.devices:
        d = pb.devices.add(
            device_id=dev.device_id,
            index=dev.index,
            uuid=dev.uuid,
            model=dev.model,
            memory_bytes=dev.memory_bytes,
            health=dev.health.value,
            simulated=dev.simulated,
        )
        if inventory is not None:
            stats = inventory.stats(host.host_id, dev.device_id)
            d.utilization_percent = stats.utilization_percent
            d.temperature_celsius = stats.temperature_celsius
            alloc = inventory.allocation_of_device(host.host_id, dev.device_id)
            if alloc is not None:
                d.allocation.CopyFrom(allocation_to_proto(alloc))
    if inventory is not None:
        beat = inventory.last_heartbeat_time(host.host_id)
        if beat is not None:
            pb.last_heartbeat_time.CopyFrom(_ts(beat))
    return pb


def host_from_proto(pb: resources_pb2.Host) -> HostRecord:
    liveness = Liveness.LOST if pb.state == resources_pb2.HOST_STATE_LOST else Liveness.READY
    scheduling = (
        Scheduling.DRAINING
        if pb.draining
        else Scheduling.CORDONED
        if pb.cordoned
        else Scheduling.SCHEDULABLE
    )
    return HostRecord(
        host_id=pb.host_id,
        agent_address=pb.agent_address,
        incarnation=pb.incarnation,
        liveness=liveness,
        scheduling=scheduling,
        labels=dict(pb.labels),
        resource_group=pb.resource_group or DEFAULT_RESOURCE_GROUP,
        devices=tuple(device_from_proto(d) for d in pb.devices),
        register_time=_seconds(pb.register_time),
    )


def allocation_to_proto(alloc: AllocationRecord) -> resources_pb2.Allocation:
    return resources_pb2.Allocation(
        allocation_id=alloc.allocation_id,
        job_id=alloc.job_id,
        learner_id=alloc.learner_id,
        host_id=alloc.host_id,
        device_id=alloc.device_id,
        host_incarnation=alloc.host_incarnation,
        create_time=_ts(alloc.create_time),
    )


def allocation_from_proto(pb: resources_pb2.Allocation) -> AllocationRecord:
    return AllocationRecord(
        allocation_id=pb.allocation_id,
        job_id=pb.job_id,
        learner_id=pb.learner_id,
        host_id=pb.host_id,
        device_id=pb.device_id,
        host_incarnation=pb.host_incarnation,
        create_time=_seconds(pb.create_time),
    )


def request_to_proto(record: AcquireRecord) -> rm_pb2.AcquireDevicesResponse:
    return rm_pb2.AcquireDevicesResponse(
        allocations=[allocation_to_proto(a) for a in record.allocations]
    )


def request_from_proto(request_id: str, pb: rm_pb2.AcquireDevicesResponse) -> AcquireRecord:
    return AcquireRecord(request_id, tuple(allocation_from_proto(a) for a in pb.allocations))


def learner_from_proto(pb: resources_pb2.Learner) -> LearnerReport:
    try:
        state = LearnerState(pb.state)
    except ValueError:
        state = LearnerState.UNKNOWN
    return LearnerReport(
        learner_id=pb.learner_id,
        job_id=pb.job_id,
        host_id=pb.host_id,
        device_id=pb.device_id,
        state=state,
        pid=pb.pid,
        exit_code=pb.exit_code,
        exit_reason=pb.exit_reason,
        start_time=_seconds(pb.start_time),
        end_time=_seconds(pb.end_time),
        host_incarnation=pb.host_incarnation,
    )


def learner_to_proto(report: LearnerReport) -> resources_pb2.Learner:
    return resources_pb2.Learner(
        learner_id=report.learner_id,
        job_id=report.job_id,
        host_id=report.host_id,
        device_id=report.device_id,
        state=report.state.value,
        pid=report.pid,
        exit_code=report.exit_code,
        exit_reason=report.exit_reason,
        start_time=_ts(report.start_time),
        end_time=_ts(report.end_time),
        host_incarnation=report.host_incarnation,
    )


def claim_from_proto(pb: rm_pb2.DeviceClaim) -> Claim:
    return Claim(pb.job_id, pb.learner_id, pb.host_id, pb.device_id)


def registration_from_proto(pb: rm_pb2.RegisterHostRequest) -> Registration:
    return Registration(
        host_id=pb.host_id,
        agent_address=pb.agent_address,
        devices=tuple(device_from_proto(d) for d in pb.devices),
        labels=dict(pb.labels),
        resource_group=pb.resource_group,
        learners=tuple(learner_from_proto(learner) for learner in pb.learners),
    )
