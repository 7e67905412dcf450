"""Every RPC of every service, called with random and mutated messages as every role.

The four services run in this process on real gRPC (loopback), with auth on: a job-scheduler
API, a resource manager, a host agent (two simulated GPUs) and a parameter-sync shard, seeded
with one job of alice (an artifact, the job, its data plane opened on the shard, a host).
Requests are generated from the protobuf descriptors (shoal.v1): half built from random field
values (empty, huge, negative, NaN, out-of-range enums, traversal / NUL / look-alike / 100k
identifiers, random bytes), half a plausible request naming the seeded job with one or two
fields mutated. Each is sent as: no token, a garbage token, bob (a user who owns nothing),
a learner of another job, a learner of alice's job, alice, a service and an admin.

Asserted for every call: the status is never INTERNAL, UNKNOWN or UNIMPLEMENTED; a refused call
(any status but OK and DEADLINE_EXCEEDED) changed no state of its service (the store, the
storage directory, the in-memory jobs and learners); callers without a credential for what they
touch get UNAUTHENTICATED or PERMISSION_DENIED (or INVALID_ARGUMENT / NOT_FOUND, which reveal
nothing); and every service still answers health checks and a known-good call at the end. The
number of calls made is printed (run with ``-s``) and recorded as a test property.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shoal.host_agent.devices import SimulatedDevices
from shoal.host_agent.service import (
    ERRORS as HA_ERRORS,
    HostAgent,
    HostAgentConfig,
    bindings as ha_bindings,
)
from shoal.param_sync.service import (
    ERRORS as PS_ERRORS,
    ROLES as PS_ROLES,
    SERVICE_NAME as PS_NAME,
    ParameterSyncServicer,
    ShardOptions,
    add_servicer,
)
from shoal.resource_manager.service import (
    ERRORS as RM_ERRORS,
    ResourceManager,
    ResourceManagerConfig,
    bindings as rm_bindings,
)
from shoal.runtime.auth import LearnerTokenSigner
from shoal.runtime.config import ServerConfig
from shoal.runtime.server import RunningServer, ServiceBinding, create_server
from shoal.runtime.store import MemoryStore
from shoal.scheduler.artifacts import ArtifactStore, Storage
from shoal.scheduler.service import ERRORS as JS_ERRORS, ApiConfig, JobApi, binding
from shoal.scheduler.store import JobTable
from shoal.v1 import (
    host_agent_service_pb2,
    job_pb2,
    job_scheduler_service_pb2,
    parameter_sync_service_pb2,
    resource_manager_service_pb2,
)
from tests.support import async_wait_until, make_tokens

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

#: Messages per (method, role): half random, half mutated. SHOAL_FUZZ_N overrides.
PER_ROLE = int(os.environ.get("SHOAL_FUZZ_N", "4"))
SEED = int(os.environ.get("SHOAL_FUZZ_SEED", "13"))
CALL_TIMEOUT_S = 0.5
# Calls that must be refused at once (hostile identifiers) get longer: on a loaded 2-core CI
# machine a prompt refusal can still take over half a second to come back.
REFUSAL_TIMEOUT_S = 10.0
NEVER = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNIMPLEMENTED}
#: Statuses after which the service may have done something (a blocking call cut short).
MAY_HAVE_ACTED = {grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED}
REFUSED_WITHOUT_ACCESS = {grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT}

ROLES = ("anonymous", "garbage", "bob", "learner-other", "learner", "alice", "service", "admin")

HOSTILE_STRINGS = [
    "",
    "..",
    "../../../../tmp/pwned",
    "/etc/passwd",
    "a\0b",
    "j\u043eb-1",
    "\uff0e\uff0e\uff0fx",
    "x" * 100_000,
    "job-1\n",
    "%2e%2e%2f",
    "\ud7ff\ue000",
    " ",
]
INTS = [0, 1, -1, 2, 7, 2**31 - 1, -(2**31), 2**63 - 1, -(2**63)]
UINTS = [0, 1, 2, 2**32 - 1, 2**64 - 1]
FLOATS = [0.0, -1.0, 1e308, -1e308, math.nan, math.inf, -math.inf, 1e-310]


@dataclass
class Target:
    """One service under test: where it listens and how to see its state."""

    name: str
    server: RunningServer
    snapshot: Callable[[], Awaitable[Any]]


@dataclass
class Fuzz:
    targets: dict[str, Target]
    tokens: dict[str, str]
    job_id: str
    learner_id: str
    artifact_id: str
    calls: int = 0
    by_code: dict[str, int] = field(default_factory=dict)
    last_details: str = ""  # the details of the last refused call (named in a failure)
    channels: dict[tuple[str, str], aio.Channel] = field(default_factory=dict)
    sync_channels: dict[str, grpc.Channel] = field(default_factory=dict)

    def sync_channel(self, service: str) -> grpc.Channel:
        address = self.targets[service].server.address
        if address not in self.sync_channels:
            self.sync_channels[address] = grpc.insecure_channel(address)
        return self.sync_channels[address]

    def channel(self, service: str) -> aio.Channel:
        address = self.targets[service].server.address
        key = (service, address)
        if key not in self.channels:
            options = [("grpc.max_receive_message_length", 256 * 1024 * 1024)]
            self.channels[key] = aio.insecure_channel(address, options=options)
        return self.channels[key]


def listing(root: Path) -> list[tuple[str, int]]:
    out = []
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = Path(dirpath) / name
            try:
                out.append((str(path.relative_to(root)), path.stat().st_size))
            except FileNotFoundError:
                continue
    return sorted(out)


async def store_state(store: MemoryStore) -> Any:
    kvs, revision = await store.list("")
    return revision, [(kv.key, kv.value) for kv in kvs]


# -- message generation from the descriptors ---------------------------------------------------


class Generator:
    def __init__(self, rng: random.Random, fuzz: Fuzz) -> None:
        self.rng = rng
        self.fuzz = fuzz

    def plausible_string(self, fd: FieldDescriptor) -> str:
        f = self.fuzz
        name = fd.name
        if name == "job_id":
            return f.job_id
        if name in ("learner_id", "sender_id", "learner_ids", "member_learner_ids"):
            return f.learner_id
        if name == "artifact_id":
            return f.artifact_id
        if name == "host_id":
            return "h1"
        if name == "device_id":
            return "gpu0"
        if name == "entry_point":
            return "train.py"
        return self.rng.choice(["x", "model", "digits", "adam", "sgd"])

    def scalar(self, fd: FieldDescriptor, plausible: bool) -> Any:
        rng = self.rng
        t = fd.type
        if t == FieldDescriptor.TYPE_STRING:
            if plausible:
                return self.plausible_string(fd)
            choice = rng.random()
            if choice < 0.6:
                return rng.choice(HOSTILE_STRINGS)
            if choice < 0.8:
                return "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(12)))
            return self.plausible_string(fd)
        if t == FieldDescriptor.TYPE_BYTES:
            n = rng.choice([0, 1, 7, 64, 4096]) if not plausible else 16
            return rng.randbytes(n)
        if t == FieldDescriptor.TYPE_BOOL:
            return rng.random() < 0.5
        if t == FieldDescriptor.TYPE_ENUM:
            values = [v.number for v in fd.enum_type.values]
            return (
                rng.choice(values)
                if plausible or rng.random() < 0.5
                else rng.choice([99, -5, 2**31 - 1])
            )
        if t in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
            value = rng.choice(FLOATS) if not plausible else rng.choice([0.1, 1.0, 2.5])
            if t == FieldDescriptor.TYPE_FLOAT and math.isfinite(value) and abs(value) > 3e38:
                value = math.copysign(math.inf, value)
            return value
        if t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
            return rng.choice(UINTS[:4]) if not plausible else rng.randrange(1, 64)
        if t in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
            return rng.choice(UINTS) if not plausible else rng.randrange(1, 64)
        if t in (
            FieldDescriptor.TYPE_INT32,
            FieldDescriptor.TYPE_SINT32,
            FieldDescriptor.TYPE_SFIXED32,
        ):
            return rng.choice(INTS[:7]) if not plausible else rng.randrange(1, 64)
        return rng.choice(INTS) if not plausible else rng.randrange(1, 64)

    def fill(self, message: Message, plausible: bool, depth: int = 0) -> Message:
        rng = self.rng
        desc: Descriptor = message.DESCRIPTOR
        oneofs_done: set[str] = set()
        for fd in desc.fields:
            if fd.containing_oneof is not None:
                if fd.containing_oneof.name in oneofs_done or rng.random() < 0.5:
                    continue
                oneofs_done.add(fd.containing_oneof.name)
            elif rng.random() < (0.15 if plausible else 0.4):
                continue
            if fd.type == FieldDescriptor.TYPE_MESSAGE:
                if fd.message_type.GetOptions().map_entry:
                    target = getattr(message, fd.name)
                    key_fd = fd.message_type.fields_by_name["key"]
                    value_fd = fd.message_type.fields_by_name["value"]
                    for _ in range(rng.randrange(3)):
                        key = self.scalar(key_fd, plausible)
                        if value_fd.type == FieldDescriptor.TYPE_MESSAGE:
                            self.fill(target[key], plausible, depth + 1)
                        else:
                            target[key] = self.scalar(value_fd, plausible)
                    continue
                if depth >= 3:
                    continue
                if fd.is_repeated:
                    for _ in range(rng.choice([0, 1, 2, 3] if plausible else [0, 1, 3, 50])):
                        self.fill(getattr(message, fd.name).add(), plausible, depth + 1)
                else:
                    self.fill(getattr(message, fd.name), plausible, depth + 1)
                continue
            if fd.is_repeated:
                count = rng.choice([1, 2] if plausible else [0, 1, 3, 200])
                getattr(message, fd.name).extend(self.scalar(fd, plausible) for _ in range(count))
            else:
                setattr(message, fd.name, self.scalar(fd, plausible))
        return message

    def mutate(self, message: Message) -> Message:
        """A plausible message with one or two fields replaced by random values."""
        rng = self.rng
        fields = list(message.DESCRIPTOR.fields)
        for fd in rng.sample(fields, min(len(fields), rng.choice([1, 2]))):
            if fd.containing_oneof is not None:
                continue
            message.ClearField(fd.name)
            if fd.type == FieldDescriptor.TYPE_MESSAGE:
                if fd.is_repeated or fd.message_type.GetOptions().map_entry:
                    continue
                self.fill(getattr(message, fd.name), False, 1)
            elif fd.is_repeated:
                getattr(message, fd.name).extend([self.scalar(fd, False)])
            else:
                setattr(message, fd.name, self.scalar(fd, False))
        return message

    def request(self, cls: type[Message], i: int) -> Message:
        if i % 2 == 0:
            return self.fill(cls(), plausible=False)
        return self.mutate(self.fill(cls(), plausible=True))


# -- calls -------------------------------------------------------------------------------------


def metadata(fuzz: Fuzz, role: str) -> tuple[tuple[str, str], ...]:
    if role == "anonymous":
        return ()
    if role == "garbage":
        return (("authorization", "Bearer not-a-token"),)
    return (("authorization", f"Bearer {fuzz.tokens[role]}"),)


async def invoke(
    fuzz: Fuzz,
    service: str,
    method: MethodDescriptor,
    requests: list[Message],
    role: str,
    timeout: float = CALL_TIMEOUT_S,
) -> grpc.StatusCode:
    channel = fuzz.channel(service)
    path = f"/{method.containing_service.full_name}/{method.name}"
    md = metadata(fuzz, role)

    def ser(m: Message) -> bytes:
        return m.SerializeToString()

    def raw(b: bytes) -> bytes:
        return b

    try:
        async with asyncio.timeout(timeout + 2):
            if method.client_streaming:
                # grpc.aio's client reports INTERNAL "Internal error from Core" instead of the
                # server's status when the server ends the stream before the client half-closes
                # (grpc/grpc#36066); the blocking API reports the server's status, so
                # client-streaming calls go through it, in a thread.
                code, fuzz.last_details = await asyncio.to_thread(
                    _client_streaming_call,
                    fuzz.sync_channel(service),
                    method,
                    path,
                    requests,
                    md,
                    timeout,
                )
                return code
            if method.server_streaming:
                call = channel.unary_stream(path, request_serializer=ser, response_deserializer=raw)
                async for _ in call(requests[0], metadata=md, timeout=timeout):
                    pass
            else:
                call = channel.unary_unary(path, request_serializer=ser, response_deserializer=raw)
                await call(requests[0], metadata=md, timeout=timeout)
        return grpc.StatusCode.OK
    except aio.AioRpcError as exc:
        fuzz.last_details = exc.details() or ""
        return exc.code()


def _client_streaming_call(
    channel: grpc.Channel,
    method: MethodDescriptor,
    path: str,
    requests: list[Message],
    md: tuple[tuple[str, str], ...],
    timeout: float,
) -> tuple[grpc.StatusCode, str]:
    def ser(m: Message) -> bytes:
        return m.SerializeToString()

    def raw(b: bytes) -> bytes:
        return b

    try:
        if method.server_streaming:
            call = channel.stream_stream(path, request_serializer=ser, response_deserializer=raw)
            for _ in call(iter(requests), metadata=md, timeout=timeout):
                pass
        else:
            call = channel.stream_unary(path, request_serializer=ser, response_deserializer=raw)
            call(iter(requests), metadata=md, timeout=timeout)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""  # type: ignore[attr-defined]


EXPECTED_FOR = {
    # role -> service -> the only codes it may get (None: anything but NEVER)
    "anonymous": {
        s: {grpc.StatusCode.UNAUTHENTICATED} for s in ("scheduler", "rm", "agent", "sync")
    },
    "garbage": {s: {grpc.StatusCode.UNAUTHENTICATED} for s in ("scheduler", "rm", "agent", "sync")},
    "bob": {
        "agent": {grpc.StatusCode.PERMISSION_DENIED},
        "sync": REFUSED_WITHOUT_ACCESS,
    },
    "learner-other": {
        "rm": {grpc.StatusCode.PERMISSION_DENIED},
        "agent": {grpc.StatusCode.PERMISSION_DENIED},
        "sync": REFUSED_WITHOUT_ACCESS,
        "scheduler": REFUSED_WITHOUT_ACCESS | {grpc.StatusCode.NOT_FOUND},
    },
    "learner": {
        "rm": {grpc.StatusCode.PERMISSION_DENIED},
        "agent": {grpc.StatusCode.PERMISSION_DENIED},
    },
}


async def fuzz_service(fuzz: Fuzz, service: str, proto_service: Any, gen: Generator) -> None:
    target = fuzz.targets[service]
    for method in proto_service.methods:
        cls = GetMessageClass(method.input_type)
        for role in ROLES:
            for i in range(PER_ROLE):
                requests = [gen.request(cls, i + k) for k in range(gen.rng.choice([1, 2, 3]))]
                before = await target.snapshot()
                expected = EXPECTED_FOR.get(role, {}).get(service)
                # A refusal comes at once: it gets the long timeout (a loaded machine is slow).
                timeout = CALL_TIMEOUT_S if expected is None else REFUSAL_TIMEOUT_S
                code = await invoke(fuzz, service, method, requests, role, timeout)
                fuzz.calls += 1
                fuzz.by_code[code.name] = fuzz.by_code.get(code.name, 0) + 1
                where = (
                    f"{service} {method.name} as {role} ({fuzz.last_details!r}): "
                    f"{requests[0]!s:.300}"
                )
                assert code not in NEVER, f"{code.name} from {where}"
                if expected is not None:
                    assert code in expected, f"{code.name} (expected {expected}) from {where}"
                if code not in MAY_HAVE_ACTED:
                    after = await target.snapshot()
                    assert after == before, f"refused ({code.name}) yet changed state: {where}"


# -- the services ------------------------------------------------------------------------------


@pytest.fixture
async def fuzz(tmp_path: Path) -> AsyncIterator[Fuzz]:
    tokens = make_tokens(tmp_path / "tokens")
    signer = LearnerTokenSigner.generate()

    def config(name: str) -> ServerConfig:
        return ServerConfig(
            name, tokens_file=str(tmp_path / "tokens"), service_token=tokens["service"]
        )

    servers: list[RunningServer] = []
    closers: list[Callable[[], Awaitable[Any]]] = []

    async def serve(name: str, bindings: Any, errors: Any) -> RunningServer:
        running = await create_server(config(name), bindings, errors=errors)
        assert running.credentials is not None
        running.credentials.add_learner_key(signer.public_key_raw)
        servers.append(running)
        return running

    # job-scheduler API (no reconcile loop: the API core over a memory store and storage)
    js_store = MemoryStore()
    table = JobTable(js_store)
    await table.become_leader(None)
    js_storage = tmp_path / "js-storage"
    artifacts = ArtifactStore(Storage(js_storage.as_uri()), max_bytes=1 << 20, quota_bytes=1 << 22)
    api = JobApi(table, artifacts, trigger=lambda _: None, config=ApiConfig(log_poll_s=0.1))
    scheduler = await serve("job-scheduler", [binding(api)], JS_ERRORS)

    # resource manager on a memory store
    rm_store = MemoryStore()
    rm = ResourceManager(ResourceManagerConfig(server=config("resource-manager")), rm_store)
    rm_server = await serve("resource-manager", rm_bindings(rm), RM_ERRORS)
    rm.start(rm_server.address)
    closers.append(rm.close)
    await async_wait_until(rm.became_leader.is_set, what="resource manager leads")

    # host agent with two simulated GPUs, no artifact sources
    agent_config = HostAgentConfig(
        server=config("host-agent"), host_id="h1", work_dir=tmp_path / "agent", simulate_gpus=2
    )
    agent = HostAgent(agent_config, SimulatedDevices("h1", 2))
    agent_server = await serve("host-agent", ha_bindings(agent), HA_ERRORS)
    agent.start(agent_server.address)
    closers.append(lambda: agent.close(0.5))

    # one parameter-sync shard
    ps_storage = tmp_path / "ps-storage"
    servicer = ParameterSyncServicer(
        ShardOptions(
            shard_index=0, storage_uri=ps_storage.as_uri(), service_token=tokens["service"]
        )
    )
    sync = await serve(
        "parameter-sync", [ServiceBinding(PS_NAME, add_servicer, servicer, PS_ROLES)], PS_ERRORS
    )
    closers.append(servicer.close)

    async def js_snapshot() -> Any:
        return await store_state(js_store), listing(js_storage)

    async def rm_snapshot() -> Any:
        return await store_state(rm_store)

    async def agent_snapshot() -> Any:
        return sorted(agent.processes._learners), listing(tmp_path / "agent" / "learners")

    async def sync_snapshot() -> Any:
        jobs = {
            j: (c.coord.progress()["completed_iterations"], sorted(c.coord.members), c.owner)
            for j, c in servicer._coordinated.items()
        }
        return jobs, sorted(servicer._slices), listing(ps_storage)

    targets = {
        "scheduler": Target("scheduler", scheduler, js_snapshot),
        "rm": Target("rm", rm_server, rm_snapshot),
        "agent": Target("agent", agent_server, agent_snapshot),
        "sync": Target("sync", sync, sync_snapshot),
    }
    # Seed: alice's artifact and job, its data plane on the shard, a learner credential for it
    # and one for another job.
    from shoal.runtime.auth import Principal, Role

    alice = Principal("alice", Role.USER)

    async def chunks() -> AsyncIterator[bytes]:
        yield b"model" * 100

    info = await artifacts.upload(
        name="m", declared_size=0, declared_sha256="", chunks=chunks(), owner=alice
    )
    job = await api.submit(
        alice,
        "seed",
        job_pb2.JobSpec(
            name="seed",
            entry_point="train.py",
            artifact_id=info.artifact_id,
            batch_size=8,
            epochs=1,
            max_workers=2,
        ),
    )
    await servicer.OpenJob(
        parameter_sync_service_pb2.OpenJobRequest(
            job_id=job.job_id,
            spec=job.spec,
            shard_addresses=[sync.address],
            owner="alice",
        ),
        None,
    )
    learner_id = f"{job.job_id}-l1"
    tokens = {
        **tokens,
        "alice": tokens["user"],
        "bob": tokens["other"],
        "learner": signer.mint(job_id=job.job_id, learner_id=learner_id),
        "learner-other": signer.mint(job_id="job-other", learner_id="job-other-l1"),
    }
    state = Fuzz(targets, tokens, job.job_id, learner_id, info.artifact_id)
    yield state
    for channel in state.channels.values():
        await channel.close()
    for sync_channel in state.sync_channels.values():
        sync_channel.close()
    for close in reversed(closers):
        await close()
    for running in servers:
        await running.stop(0)


async def test_random_and_mutated_messages_to_every_rpc_as_every_role(fuzz: Fuzz, record_property):
    rng = random.Random(SEED)
    gen = Generator(rng, fuzz)
    started = time.monotonic()
    services = {
        "scheduler": job_scheduler_service_pb2.DESCRIPTOR.services_by_name["JobSchedulerService"],
        "rm": resource_manager_service_pb2.DESCRIPTOR.services_by_name["ResourceManagerService"],
        "agent": host_agent_service_pb2.DESCRIPTOR.services_by_name["HostAgentService"],
        "sync": parameter_sync_service_pb2.DESCRIPTOR.services_by_name["ParameterSyncService"],
    }
    methods = 0
    for name, proto_service in services.items():
        methods += len(proto_service.methods)
        await fuzz_service(fuzz, name, proto_service, gen)
    # Nothing crashed: every service is healthy and answers a known-good call.
    for target in fuzz.targets.values():
        channel = fuzz.channel(target.name)
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, target.name
    reply = await fuzz.channel("scheduler").unary_unary(
        "/shoal.v1.JobSchedulerService/GetJob",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=job_scheduler_service_pb2.GetJobResponse.FromString,
    )(
        job_scheduler_service_pb2.GetJobRequest(job_id=fuzz.job_id),
        metadata=metadata(fuzz, "admin"),
        timeout=5,
    )
    assert reply.job.owner == "alice"
    seconds = time.monotonic() - started
    summary = (
        f"fuzz: {fuzz.calls} calls to {methods} methods of 4 services as {len(ROLES)} roles "
        f"in {seconds:.1f} s (seed {SEED}); status codes: {dict(sorted(fuzz.by_code.items()))}"
    )
    print(summary)
    record_property("fuzz_calls", fuzz.calls)
    record_property("fuzz_codes", dict(sorted(fuzz.by_code.items())))
    assert fuzz.calls == methods * len(ROLES) * PER_ROLE


HOSTILE_IDS = [
    "../../../../tmp/pwned",
    "/etc/passwd",
    "job\0x",
    "j\u043eb-1",  # a Cyrillic o
    "x" * 5_000_000,
]


def id_paths(desc: Descriptor, depth: int = 0) -> list[list[FieldDescriptor]]:
    """Every path to an identifier field of a message type (through sub-messages)."""
    from shoal.contract import ids

    paths: list[list[FieldDescriptor]] = []
    for fd in desc.fields:
        if fd.type == FieldDescriptor.TYPE_MESSAGE:
            if depth < 2 and not fd.message_type.GetOptions().map_entry:
                paths += [[fd, *rest] for rest in id_paths(fd.message_type, depth + 1)]
        elif fd.type == FieldDescriptor.TYPE_STRING and fd.name in ids.FIELD_KINDS:
            paths.append([fd])
    return paths


def with_value(cls: type[Message], path: list[FieldDescriptor], value: str) -> Message:
    message = cls()
    node = message
    for fd in path[:-1]:
        node = getattr(node, fd.name).add() if fd.is_repeated else getattr(node, fd.name)
    last = path[-1]
    if last.is_repeated:
        getattr(node, last.name).append(value)
    else:
        setattr(node, last.name, value)
    return message


async def test_every_identifier_field_of_every_method_refuses_hostile_values(
    fuzz: Fuzz, record_property
):
    """Traversal, an absolute path, a NUL byte, a look-alike and a 5 MB name in every field
    that holds an identifier, of every method of every service, sent by an admin (so nothing
    but the identifier can be wrong): INVALID_ARGUMENT, and nothing changes."""
    services = {
        "scheduler": job_scheduler_service_pb2.DESCRIPTOR.services_by_name["JobSchedulerService"],
        "rm": resource_manager_service_pb2.DESCRIPTOR.services_by_name["ResourceManagerService"],
        "agent": host_agent_service_pb2.DESCRIPTOR.services_by_name["HostAgentService"],
        "sync": parameter_sync_service_pb2.DESCRIPTOR.services_by_name["ParameterSyncService"],
    }
    calls = 0
    covered = set()
    for service, proto_service in services.items():
        target = fuzz.targets[service]
        for method in proto_service.methods:
            cls = GetMessageClass(method.input_type)
            for path in id_paths(method.input_type):
                covered.add(f"{method.name}.{'.'.join(fd.name for fd in path)}")
                for value in HOSTILE_IDS:
                    before = await target.snapshot()
                    code = await invoke(
                        fuzz,
                        service,
                        method,
                        [with_value(cls, path, value)],
                        "admin",
                        timeout=REFUSAL_TIMEOUT_S,
                    )
                    calls += 1
                    where = (
                        f"{service} {method.name} {'.'.join(fd.name for fd in path)}={value[:20]!r}"
                    )
                    assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{code.name}: {where}"
                    assert await target.snapshot() == before, where
    print(f"identifier fields: {len(covered)} fields, {calls} calls")
    record_property("identifier_calls", calls)
    assert len(covered) > 40
