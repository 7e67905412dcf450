"""The host agent: HostAgentService handlers, the link to the resource manager (registration and
heartbeats) and artifact download from the job scheduler.

The link (:class:`ResourceManagerLink`) registers with the resource manager, trying each
configured address and following the ``shoal-leader`` trailing metadata of a standby, then keeps
one bidirectional Heartbeat stream open and sends a heartbeat every interval (and at once when a
learner exits). A broken stream, FAILED_PRECONDITION (stale or lost incarnation) or NOT_FOUND
(the resource manager does not know the host) makes it register again; the incarnation the
resource manager answers is the one new learners are started under. Learner exits are reported
in every heartbeat until a response acknowledges a heartbeat that carried them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import tenacity
from google.protobuf import timestamp_pb2
from grpc import aio

from shoal.contract import ids
from shoal.contract.errors import InvalidField, decode_rpc_error
from shoal.host_agent.devices import DeviceInfo, DeviceSource
from shoal.host_agent.processes import (
    STDERR,
    ArtifactCache,
    ArtifactSource,
    DirectorySource,
    LaunchRequest,
    Learner,
    ProcessManager,
    reap_orphans,
)
from shoal.host_agent.warm import reap_warm
from shoal.runtime.auth import SERVICES, MethodRoles
from shoal.runtime.channels import connect
from shoal.runtime.config import ServerConfig, TLSConfig
from shoal.runtime.errors import DEFAULT_TABLE, ErrorTable
from shoal.runtime.retrying import backoff
from shoal.runtime.server import ServiceBinding
from shoal.v1 import (
    host_agent_service_pb2 as ha_pb2,
    host_agent_service_pb2_grpc as ha_grpc,
    job_scheduler_service_pb2 as js_pb2,
    job_scheduler_service_pb2_grpc as js_grpc,
    resource_manager_service_pb2 as rm_pb2,
    resource_manager_service_pb2_grpc as rm_grpc,
    resources_pb2,
)

log = logging.getLogger(__name__)

SERVICE_NAME = "shoal.v1.HostAgentService"
ROLES = MethodRoles(service=SERVICE_NAME, default=SERVICES)
ERRORS: ErrorTable = DEFAULT_TABLE.extend({})
RPC_TIMEOUT_S = 5.0
# The longest grace a StopLearner may ask for (a learner that ignores SIGTERM is killed after it).
MAX_STOP_GRACE_S = 3600


@dataclass(frozen=True)
class HostAgentConfig:
    """The host agent's settings (built once in ``main``)."""

    server: ServerConfig
    host_id: str
    work_dir: Path
    resource_managers: tuple[str, ...] = ()
    schedulers: tuple[str, ...] = ()
    artifact_dir: str | None = None
    simulate_gpus: int | None = None
    stop_grace_s: float = 10.0
    retain_exited_s: float = 3600.0
    labels: Mapping[str, str] = field(default_factory=dict)
    resource_group: str = ""
    learner_tls_cert: str | None = None
    """The client certificate (``learner:<host>``) and key given to this host's learners
    (SHOAL_TLS_CERT/KEY), with the cluster CA (SHOAL_TLS_CA): never the agent's own."""
    learner_tls_key: str | None = None
    warm_learners: int | None = 0
    """Warm learner processes kept ready (:mod:`shoal.host_agent.warm`); None: one per device,
    0: none (every learner starts cold)."""

    def learner_env(self) -> dict[str, str]:
        """The variables of the learners' TLS (empty without TLS)."""
        tls = self.server.tls
        if tls is None or tls.ca_file is None:
            return {}
        # Absolute: learners run in their own working directory.
        env = {"SHOAL_TLS_CA": str(Path(tls.ca_file).resolve())}
        if self.learner_tls_cert and self.learner_tls_key:
            env["SHOAL_TLS_CERT"] = str(Path(self.learner_tls_cert).resolve())
            env["SHOAL_TLS_KEY"] = str(Path(self.learner_tls_key).resolve())
        return env

    def __post_init__(self) -> None:
        if not ids.is_valid(ids.IdKind.HOST, self.host_id):
            raise InvalidField("host_id", self.host_id, ids.describe(ids.IdKind.HOST))
        if (self.learner_tls_cert is None) != (self.learner_tls_key is None):
            raise InvalidField(
                "learner_tls", "cert/key", "needs both --learner-tls-cert and --learner-tls-key"
            )
        tls = self.server.tls
        if tls is not None and tls.ca_file is not None and self.learner_tls_cert is None:
            raise InvalidField(
                "learner_tls_cert",
                None,
                "is required with --tls-ca: learners present it to the parameter-sync shards "
                "(issue one per host: kind 'learner'; never the agent's own certificate)",
            )
        if self.server.tls is not None and self.learner_tls_cert in (
            self.server.tls.cert_file,
            self.server.tls.key_file,
        ):
            raise InvalidField(
                "learner_tls_cert",
                self.learner_tls_cert,
                "must not be the agent's own certificate (a service credential)",
            )
        for name in ("learner_tls_cert", "learner_tls_key"):
            value = getattr(self, name)
            if value is not None and not Path(value).is_file():
                raise InvalidField(name, value, "is not a readable file")
        if self.simulate_gpus is not None and not 0 <= self.simulate_gpus <= 1024:
            raise InvalidField("simulate_gpus", self.simulate_gpus, "must be in 0..1024")
        if self.warm_learners is not None and not 0 <= self.warm_learners <= 1024:
            raise InvalidField("warm_learners", self.warm_learners, "must be in 0..1024 or auto")
        if not 0 < self.stop_grace_s <= 3600:
            raise InvalidField("stop_grace_s", self.stop_grace_s, "must be in (0, 3600]")
        if self.retain_exited_s < 0:
            raise InvalidField("retain_exited_s", self.retain_exited_s, "must be >= 0")
        for address in (*self.resource_managers, *self.schedulers):
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise InvalidField("address", address, "must be HOST:PORT")


def _leader_hint(exc: aio.AioRpcError) -> str | None:
    return decode_rpc_error(exc).leader or None


class _Channels:
    """One channel per address, with the service token."""

    def __init__(self, token: str | None, tls: TLSConfig | None = None) -> None:
        self._token = token
        self._tls = tls
        self._channels: dict[str, aio.Channel] = {}

    def get(self, address: str) -> aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = connect(address, token=self._token, tls=self._tls)
            self._channels[address] = channel
        return channel

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()


# --------------------------------------------------------------------------------------------
# Artifacts from the job scheduler
# --------------------------------------------------------------------------------------------


class SchedulerSource(ArtifactSource):
    """Artifacts downloaded with JobSchedulerService.DownloadArtifact (following the leader)."""

    def __init__(self, addresses: Sequence[str], channels: _Channels) -> None:
        self.addresses = list(addresses)
        self._channels = channels
        self._leader: str | None = None

    def describe(self) -> str:
        return f"job-scheduler at {', '.join(self.addresses)}"

    async def fetch(self, artifact_id: str, dest: Path) -> bool:
        candidates = [a for a in [self._leader, *self.addresses] if a]
        tried: set[str] = set()
        last: Exception | None = None
        while candidates:
            address = candidates.pop(0)
            if address in tried:
                continue
            tried.add(address)
            stub = js_grpc.JobSchedulerServiceStub(self._channels.get(address))
            try:
                await self._download(stub, artifact_id, dest)
            except aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    return False
                hint = _leader_hint(exc)
                if hint:
                    candidates.insert(0, hint)
                last = exc
                continue
            self._leader = address
            return True
        raise ConnectionError(f"no job-scheduler answered DownloadArtifact: {last}")

    @staticmethod
    async def _download(stub: Any, artifact_id: str, dest: Path) -> None:
        request = js_pb2.DownloadArtifactRequest(artifact_id=artifact_id)
        with dest.open("wb") as out:
            async for message in stub.DownloadArtifact(request, timeout=600):
                if message.WhichOneof("content") == "chunk":
                    out.write(message.chunk)


# --------------------------------------------------------------------------------------------
# The link to the resource manager
# --------------------------------------------------------------------------------------------


# A failed registration is retried after 0.05 s, doubling up to 2 s (then up to a quarter of the
# grace the resource manager gave, if that is shorter).
_REGISTER_FIRST_S, _REGISTER_CAP_S = 0.05, 2.0


class _Reregister(Exception):
    """The heartbeat stream ended; register again."""


class ResourceManagerLink:
    """Registration and heartbeats (see the module doc)."""

    def __init__(self, agent: HostAgent, addresses: Sequence[str], channels: _Channels) -> None:
        self.agent = agent
        self.addresses = list(addresses)
        self._channels = channels
        self.leader: str | None = None
        self.incarnation = 0
        self.registrations = 0
        self.registered = asyncio.Event()
        self._sequence = 0
        self._wake = asyncio.Event()
        self._stopping: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.shutting_down = False  # sent in every heartbeat as ``stopping``
        self._acked_sequence = 0
        self._acked = asyncio.Event()

    def poke(self) -> None:
        """Send the next heartbeat now (a learner exited)."""
        self._wake.set()

    async def announce_stop(self, timeout: float = 2.0) -> bool:
        """Tell the resource manager this agent is stopping gracefully (to restart): send a
        heartbeat with ``stopping`` now and wait (at most ``timeout``) for its answer, so that
        the host gets the restart grace instead of being declared lost. True if answered."""
        if not self.registered.is_set():
            return False
        self.shutting_down = True
        target = self._sequence + 1
        self.poke()
        deadline = asyncio.get_running_loop().time() + timeout
        while self._acked_sequence < target:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return False
            self._acked.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._acked.wait(), timeout=left)
        return True

    async def run(self) -> None:
        """Register, heartbeat until the link breaks, register again, forever."""
        cap = _REGISTER_CAP_S
        while True:
            address, response = await self._register_retrying(cap)
            # Retry at least a few times within the grace the resource manager gave us, so
            # that after a failover we re-register before the new leader's fresh grace runs
            # out.
            cap = min(_REGISTER_CAP_S, max(response.lost_after_ms / 1000 / 4, _REGISTER_FIRST_S))
            try:
                await self._heartbeat(address, response)
            except _Reregister as exc:
                log.info("registering again: %s", exc)
            except Exception:  # never let the link die: register again
                log.exception("heartbeat stream to %s failed; registering again", address)
                # A pause, not a retry (registering is retried above): a bug that breaks
                # every heartbeat stream at once must not spin.
                await asyncio.sleep(_REGISTER_FIRST_S)
            self.registered.clear()

    async def _register_retrying(self, cap: float) -> tuple[str, rm_pb2.RegisterHostResponse]:
        """:meth:`_register` until it succeeds (tenacity): every ConnectionError retried,
        0.05 s doubling to ``cap`` apart; a fresh sequence per registration, so the waits
        start over after each success."""

        def failed(state: tenacity.RetryCallState) -> None:
            assert state.outcome is not None
            log.warning("registration failed: %s", state.outcome.exception())

        async for attempt in tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception_type(ConnectionError),
            wait=backoff(_REGISTER_FIRST_S, cap),
            before_sleep=failed,
        ):
            with attempt:
                return await self._register()
        raise AssertionError("unreachable")

    def _request(self) -> rm_pb2.RegisterHostRequest:
        cfg = self.agent.config
        return rm_pb2.RegisterHostRequest(
            host_id=cfg.host_id,
            agent_address=self.agent.address,
            devices=[d.to_proto() for d in self.agent.devices],
            labels=dict(cfg.labels),
            resource_group=cfg.resource_group,
            learners=self._learner_reports(mark_sequence=None),
        )

    async def _register(self) -> tuple[str, rm_pb2.RegisterHostResponse]:
        candidates = [a for a in [self.leader, *self.addresses] if a]
        tried: set[str] = set()
        problems: list[str] = []
        # Iteration, not a retry: each known address (the leader first, then any a standby
        # names) is tried once, at once; run() retries the whole with backoff.
        while candidates:
            address = candidates.pop(0)
            if address in tried:
                continue
            tried.add(address)
            stub = rm_grpc.ResourceManagerServiceStub(self._channels.get(address))
            try:
                response = await stub.RegisterHost(self._request(), timeout=RPC_TIMEOUT_S)
            except aio.AioRpcError as exc:
                hint = _leader_hint(exc)
                if hint:
                    candidates.insert(0, hint)
                problems.append(f"{address}: {exc.code().name} {exc.details()}")
                continue
            self.leader = address
            self.registrations += 1
            if response.incarnation != self.incarnation:
                log.info(
                    "registered with the resource manager at %s as incarnation %d%s",
                    address,
                    response.incarnation,
                    f" (was {self.incarnation})" if self.incarnation else "",
                )
            self.incarnation = response.incarnation
            self.agent.processes.adopt_incarnation(response.incarnation)
            self.registered.set()
            return address, response
        raise ConnectionError("; ".join(problems) or "no resource-manager address is configured")

    def _learner_reports(self, mark_sequence: int | None) -> list[resources_pb2.Learner]:
        reports = []
        for learner in self.agent.processes.learners():
            if learner.terminal:
                if learner.exit_acked:
                    continue
                if mark_sequence is not None and learner.exit_sent_seq is None:
                    learner.exit_sent_seq = mark_sequence
            reports.append(learner.to_proto())
        return reports

    def _beat(self) -> rm_pb2.HeartbeatRequest:
        self._sequence += 1
        return rm_pb2.HeartbeatRequest(
            host_id=self.agent.config.host_id,
            incarnation=self.incarnation,
            sequence=self._sequence,
            learners=self._learner_reports(mark_sequence=self._sequence),
            devices=[d.to_proto() for d in self.agent.sample_devices()],
            stopping=self.shutting_down,
        )

    def _acknowledge(self, response: rm_pb2.HeartbeatResponse) -> None:
        self._acked_sequence = max(self._acked_sequence, response.sequence)
        self._acked.set()
        for learner in self.agent.processes.learners():
            if learner.exit_sent_seq is not None and learner.exit_sent_seq <= response.sequence:
                learner.exit_acked = True
        for learner_id in response.stop_learner_ids:
            if learner_id in self._stopping:
                continue
            log.warning(
                "the resource manager does not trust learner %r (no allocation): stopping it",
                learner_id,
            )
            self._stopping.add(learner_id)
            task = asyncio.get_running_loop().create_task(self._stop(learner_id))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _stop(self, learner_id: str) -> None:
        try:
            await self.agent.processes.stop(
                learner_id, None, "stopped: no allocation in the resource manager's ledger"
            )
        except Exception as exc:
            log.warning("stopping untrusted learner %r failed: %s", learner_id, exc)
        finally:
            self._stopping.discard(learner_id)

    async def _heartbeat(self, address: str, registered: rm_pb2.RegisterHostResponse) -> None:
        interval = max(registered.heartbeat_interval_ms, 10) / 1000
        # Give up on a silent leader (frozen, partitioned) after half the grace, so that the
        # agent has re-registered with its successor before the successor's grace runs out.
        silence = max(registered.lost_after_ms / 2000, 2 * interval)
        stub = rm_grpc.ResourceManagerServiceStub(self._channels.get(address))
        # The beats go through a request iterator of our own that ends (a sentinel) before the
        # call is cancelled. With call.write() and client interceptors, grpc.aio feeds an
        # internal async generator from a task of its own; cancelling the call left that task
        # pending ("Task was destroyed but it is pending", "Task exception was never
        # retrieved: aclose(): asynchronous generator is already running") at every
        # re-registration.
        outbox: asyncio.Queue[rm_pb2.HeartbeatRequest | None] = asyncio.Queue()

        async def requests() -> AsyncIterator[rm_pb2.HeartbeatRequest]:
            while (beat := await outbox.get()) is not None:
                yield beat

        call = stub.Heartbeat(requests())

        async def send() -> None:
            while True:
                self._wake.clear()
                outbox.put_nowait(self._beat())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=interval)

        async def receive() -> None:
            while True:
                try:
                    response = await asyncio.wait_for(call.read(), timeout=silence)
                except TimeoutError:
                    raise _Reregister(
                        f"no heartbeat answer from {address} for {silence:g} s"
                    ) from None
                if response is aio.EOF:
                    raise _Reregister(f"{address} closed the heartbeat stream")
                self._acknowledge(response)

        tasks = [asyncio.ensure_future(send()), asyncio.ensure_future(receive())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                exc = task.exception()
                if exc is not None:
                    raise exc
        except aio.AioRpcError as exc:
            hint = _leader_hint(exc)
            if hint:
                self.leader = hint
            elif exc.code() == grpc.StatusCode.UNAVAILABLE:
                self.leader = None  # try every address
            raise _Reregister(f"{address}: {exc.code().name} {exc.details()}") from exc
        except (asyncio.InvalidStateError, ConnectionError) as exc:
            raise _Reregister(f"{address}: heartbeat stream broken ({exc})") from exc
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            outbox.put_nowait(None)  # the request iterator ends: grpc's feeder task finishes
            for _ in range(3):
                await asyncio.sleep(0)
            call.cancel()


# --------------------------------------------------------------------------------------------
# The agent
# --------------------------------------------------------------------------------------------


class HostAgent:
    """Devices, learner processes and the resource-manager link of one host."""

    def __init__(self, config: HostAgentConfig, devices: DeviceSource) -> None:
        self.config = config
        self.device_source = devices
        self.devices: list[DeviceInfo] = devices.discover()
        self.address = ""
        self.channels = _Channels(config.server.service_token, config.server.tls)
        sources: list[ArtifactSource] = []
        if config.artifact_dir:
            sources.append(DirectorySource(config.artifact_dir))
        if config.schedulers:
            sources.append(SchedulerSource(config.schedulers, self.channels))
        self.processes = ProcessManager(
            config.work_dir,
            ArtifactCache(config.work_dir / "artifacts", sources),
            host_id=config.host_id,
            stop_grace_s=config.stop_grace_s,
            on_exit=self._learner_exited,
            learner_env=config.learner_env(),
            warm_learners=(
                len(self.devices) if config.warm_learners is None else config.warm_learners
            ),
        )
        self.link = ResourceManagerLink(self, config.resource_managers, self.channels)
        self._tasks: list[asyncio.Task[Any]] = []

    def sample_devices(self) -> list[DeviceInfo]:
        sampled = self.device_source.sample()
        if sampled:
            self.devices = sampled
        return self.devices

    def _learner_exited(self, learner: Learner) -> None:
        self.link.poke()

    def start(self, address: str) -> None:
        """Clean up after a previous agent, then register (if resource managers are set)."""
        self.address = address
        self.config.work_dir.mkdir(parents=True, exist_ok=True)
        reap_orphans(self.processes.learners_dir)
        reap_warm(self.processes.warm.directory)
        self.processes.prepared.reset()
        self.processes.warm.start()
        loop = asyncio.get_running_loop()
        if self.config.resource_managers:
            self._tasks.append(loop.create_task(self.link.run(), name="agent-link"))
        else:
            log.warning("no --resource-manager given: this agent does not register")
        self._tasks.append(loop.create_task(self._forget_loop(), name="agent-forget"))

    async def _forget_loop(self) -> None:
        period = min(max(self.config.retain_exited_s / 4, 1.0), 60.0)
        while True:
            await asyncio.sleep(period)
            self.processes.forget_exited(
                self.config.retain_exited_s, reported=bool(self.config.resource_managers)
            )

    async def close(self, grace_s: float | None = None) -> None:
        """Stop every learner (SIGTERM, then SIGKILL after the grace; their exits are reported
        while the link still runs), tell the resource manager this host is restarting (a
        heartbeat with ``stopping``: it gets the restart grace), then stop the link."""
        if self._tasks:
            await self.processes.stop_all(grace_s)
            with contextlib.suppress(Exception):
                await self.link.announce_stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        await self.processes.stop_all(grace_s)
        await self.processes.warm.close()
        await self.processes.prepared.close()
        await self.channels.close()
        self.device_source.close()


def _ts(seconds: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


class HostAgentServicer(ha_grpc.HostAgentServiceServicer):
    """Thin handlers over :class:`ProcessManager`."""

    def __init__(self, agent: HostAgent) -> None:
        self.agent = agent

    async def StartLearner(
        self, request: ha_pb2.StartLearnerRequest, context: Any
    ) -> ha_pb2.StartLearnerResponse:
        token = request.fencing_token
        learner = await self.agent.processes.start(
            LaunchRequest(
                learner_id=request.learner_id,
                job_id=request.job_id,
                device_id=request.device_id,
                artifact_id=request.artifact_id,
                entry_point=request.entry_point,
                args=tuple(request.args),
                env=dict(request.env),
                allocation_id=request.allocation_id,
                fencing_election=token.election if request.HasField("fencing_token") else "",
                fencing_revision=token.revision,
            ),
            self.agent.devices,
        )
        return ha_pb2.StartLearnerResponse(learner=learner.to_proto())

    async def StopLearner(
        self, request: ha_pb2.StopLearnerRequest, context: Any
    ) -> ha_pb2.StopLearnerResponse:
        if not request.learner_id:
            raise InvalidField("learner_id", request.learner_id, "must not be empty")
        grace = 0.0
        if request.HasField("grace"):
            seconds, nanos = request.grace.seconds, request.grace.nanos
            if not (0 <= seconds <= MAX_STOP_GRACE_S and 0 <= nanos < 1_000_000_000):
                raise InvalidField(
                    "grace", f"{seconds}s {nanos}ns", f"must be between 0 and {MAX_STOP_GRACE_S} s"
                )
            grace = seconds + nanos / 1e9
        learner = await self.agent.processes.stop(
            request.learner_id, grace or None, "stopped by StopLearner"
        )
        return ha_pb2.StopLearnerResponse(learner=learner.to_proto())

    async def ListLearners(
        self, request: ha_pb2.ListLearnersRequest, context: Any
    ) -> ha_pb2.ListLearnersResponse:
        learners = self.agent.processes.learners(request.job_id)
        return ha_pb2.ListLearnersResponse(learners=[lr.to_proto() for lr in learners])

    async def StreamLearnerLogs(
        self, request: ha_pb2.StreamLearnerLogsRequest, context: Any
    ) -> AsyncIterator[ha_pb2.StreamLearnerLogsResponse]:
        if not request.learner_id:
            raise InvalidField("learner_id", request.learner_id, "must not be empty")
        if request.offset < 0:
            raise InvalidField("offset", request.offset, "must be >= 0")
        records = self.agent.processes.follow_log(
            request.learner_id, request.offset, request.follow
        )
        async for batch in records:
            now = _ts(time.time())
            yield ha_pb2.StreamLearnerLogsResponse(
                lines=[
                    resources_pb2.LogLine(
                        learner_id=request.learner_id,
                        stream=(
                            resources_pb2.LOG_STREAM_STDERR
                            if r.stream == STDERR
                            else resources_pb2.LOG_STREAM_STDOUT
                        ),
                        text=r.text,
                        time=_ts(r.time) if r.time else now,
                        offset=r.offset,
                        host_id=self.agent.config.host_id,
                    )
                    for r in batch
                ]
            )

    async def GetDeviceStatus(
        self, request: ha_pb2.GetDeviceStatusRequest, context: Any
    ) -> ha_pb2.GetDeviceStatusResponse:
        devices = await asyncio.to_thread(self.agent.sample_devices)
        return ha_pb2.GetDeviceStatusResponse(devices=[d.to_proto() for d in devices])


def bindings(agent: HostAgent) -> list[ServiceBinding]:
    return [
        ServiceBinding(
            SERVICE_NAME,
            ha_grpc.add_HostAgentServiceServicer_to_server,  # type: ignore[arg-type]
            HostAgentServicer(agent),
            ROLES,
        )
    ]
