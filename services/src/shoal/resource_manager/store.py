"""The resource manager's durable state in the store: its keys, the listing that loads it, and
the transaction that writes one change (serialized protobufs, see docs/resource-manager.md)::

    /shoal/v1/resource-manager/hosts/<host_id>                  shoal.v1.Host
    /shoal/v1/resource-manager/allocations/<host_id>/<device_id> shoal.v1.Allocation
    /shoal/v1/resource-manager/requests/<quoted request_id>     shoal.v1.AcquireDevicesResponse

Part of the replica: :mod:`shoal.resource_manager.service` re-exports every name here.
"""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from shoal.contract import keys
from shoal.resource_manager import core
from shoal.resource_manager.core import Change
from shoal.runtime.store import (
    DeleteOp,
    Expect,
    KeyValue,
    PutOp,
)
from shoal.v1 import (
    resource_manager_service_pb2 as rm_pb2,
    resources_pb2,
)

log = logging.getLogger(__name__)

# The key schema is shoal.contract.keys.
PREFIX = keys.RESOURCE_MANAGER_PREFIX
HOSTS = keys.RESOURCE_MANAGER_HOSTS
ALLOCATIONS = keys.RESOURCE_MANAGER_ALLOCATIONS
REQUESTS = keys.RESOURCE_MANAGER_REQUESTS


def host_key(host_id: str) -> str:
    return HOSTS + host_id


def allocation_key(host_id: str, device_id: str) -> str:
    return f"{ALLOCATIONS}{host_id}/{device_id}"


def request_key(request_id: str) -> str:
    return REQUESTS + urllib.parse.quote(request_id, safe="")


@dataclass(frozen=True)
class Loaded:
    hosts: list[core.HostRecord]
    allocations: list[core.AllocationRecord]
    requests: list[core.AcquireRecord]
    revisions: dict[str, int]


def parse_state(kvs: Iterable[KeyValue]) -> Loaded:
    """The durable state from a listing of the resource manager's prefix (bad values are
    logged and skipped)."""
    hosts: list[core.HostRecord] = []
    allocations: list[core.AllocationRecord] = []
    requests: list[core.AcquireRecord] = []
    revisions: dict[str, int] = {}
    for kv in kvs:
        try:
            if kv.key.startswith(HOSTS):
                hosts.append(core.host_from_proto(resources_pb2.Host.FromString(kv.value)))
            elif kv.key.startswith(ALLOCATIONS):
                pb = resources_pb2.Allocation.FromString(kv.value)
                allocations.append(core.allocation_from_proto(pb))
            elif kv.key.startswith(REQUESTS):
                request_id = urllib.parse.unquote(kv.key[len(REQUESTS) :])
                pb_req = rm_pb2.AcquireDevicesResponse.FromString(kv.value)
                requests.append(core.request_from_proto(request_id, pb_req))
            else:
                continue
        except Exception:  # a value we cannot read must not stop the whole service
            log.exception("skipping unreadable key %r", kv.key)
            continue
        revisions[kv.key] = kv.mod_revision
    return Loaded(hosts, allocations, requests, revisions)


def change_ops(change: Change, revisions: dict[str, int]) -> tuple[list[Any], list[Expect]]:
    """The transaction of a change: its ops, and what every touched key must look like."""
    ops: list[Any] = []
    expects: list[Expect] = []
    for host in change.put_hosts:
        key = host_key(host.host_id)
        ops.append(PutOp(key, core.host_to_proto(host).SerializeToString()))
        expects.append(Expect(key, revisions.get(key, 0)))
    for alloc in change.delete_allocations:
        key = allocation_key(alloc.host_id, alloc.device_id)
        ops.append(DeleteOp(key))
        expects.append(Expect(key, revisions.get(key, 0)))
    for alloc in change.put_allocations:
        key = allocation_key(alloc.host_id, alloc.device_id)
        ops.append(PutOp(key, core.allocation_to_proto(alloc).SerializeToString()))
        expects.append(Expect(key, 0))
    for request_id in change.delete_requests:
        key = request_key(request_id)
        ops.append(DeleteOp(key))
        expects.append(Expect(key, revisions.get(key, 0)))
    for record in change.put_requests:
        key = request_key(record.request_id)
        ops.append(PutOp(key, core.request_to_proto(record).SerializeToString()))
        expects.append(Expect(key, 0))
    return ops, expects
