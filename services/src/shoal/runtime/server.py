"""The one server bootstrap of every shoal service (grpc ``examples/python`` style).

``await create_server(config, bindings)`` returns a started :class:`RunningServer` (port 0 in
tests picks a free port) with:

* grpc.aio with message-size limits from the config;
* gRPC health checking (every bound service and "" report SERVING once started);
* server reflection (grpcurl can list, describe and call everything);
* the OpenTelemetry server interceptor, then shoal's auth + error-table interceptor;
* TLS / mTLS when configured.

``await run_until_signalled(server)`` serves until SIGTERM or SIGINT, then turns health to
NOT_SERVING, lets in-flight calls finish within the grace, and stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shoal.runtime import telemetry
from shoal.runtime.auth import Authenticator, Credentials, MethodRoles, load_public_keys
from shoal.runtime.config import ServerConfig, etcd_store, parse_host_port
from shoal.runtime.errors import DEFAULT_TABLE, ErrorTable
from shoal.runtime.interceptors import ShoalServerInterceptor
from shoal.runtime.shedding import LoadShedder
from shoal.runtime.store import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServiceBinding:
    """One gRPC service to serve: its full name, its generated ``add_*_to_server`` function,
    the servicer, and which roles may call which of its methods."""

    name: str
    add: Callable[[object, aio.Server], None]
    servicer: object
    roles: MethodRoles


@dataclass
class RunningServer:
    server: aio.Server
    port: int
    host: str
    health: health.aio.HealthServicer
    service_names: tuple[str, ...]
    grace_s: float
    credentials: Credentials | None = None
    background: list[asyncio.Task[None]] = field(default_factory=list)
    owned_stores: list[Store] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace: float | None = None) -> None:
        await self.set_serving(False)
        await self.server.stop(self.grace_s if grace is None else grace)
        for task in self.background:
            task.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)
        self.background.clear()
        for store in self.owned_stores:
            with contextlib.suppress(Exception):
                await store.close()
        self.owned_stores.clear()


def grpc_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]


async def create_server(
    config: ServerConfig,
    bindings: Sequence[ServiceBinding],
    *,
    errors: ErrorTable = DEFAULT_TABLE,
    tokens: Authenticator | None = None,
    credentials_store: Store | None = None,
) -> RunningServer:
    """Build, start and return the server (see the module docstring).

    ``tokens``: authenticate with this instead of the config's credentials (tests).
    ``credentials_store``: watch the auth records in this store instead of opening an etcd
    connection of its own (with ``--etcd``)."""
    credentials: Credentials | None = None
    if tokens is None and (config.tokens_file is not None or not config.allow_no_auth):
        credentials = Credentials(
            tokens_file=config.tokens_file,
            learner_keys=(
                load_public_keys(config.learner_public_keys) if config.learner_public_keys else ()
            ),
        )
        tokens = credentials
    bind = config.tls is not None and config.tls.ca_file is not None
    interceptors = [
        LoadShedder(config.max_concurrent_calls, config.service_name),
        *telemetry.server_interceptors(),
        ShoalServerInterceptor(
            tokens=tokens,
            roles={b.name: b.roles for b in bindings},
            errors=errors,
            bind_certificates=bind,
        ),
    ]
    server = aio.server(
        interceptors=interceptors,  # type: ignore[arg-type]
        options=grpc_options(config.max_message_bytes),
    )
    for binding in bindings:
        binding.add(binding.servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = tuple(b.name for b in bindings)
    if config.reflection:
        reflection.enable_server_reflection(
            (*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
    host, port = parse_host_port("listen", config.listen)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if config.tls is not None:
        ca = Path(config.tls.ca_file).read_bytes() if config.tls.ca_file else None
        creds = grpc.ssl_server_credentials(
            [(Path(config.tls.key_file).read_bytes(), Path(config.tls.cert_file).read_bytes())],
            root_certificates=ca,
            require_client_auth=ca is not None,
        )
        bound = server.add_secure_port(address, creds)
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind {address}")
    await server.start()
    running = RunningServer(
        server, bound, host, health_servicer, names, config.shutdown_grace_s, credentials
    )
    if credentials is not None and config.etcd_endpoints:
        store = credentials_store
        if store is None:
            store = etcd_store(config)
            running.owned_stores.append(store)
        running.background.append(
            asyncio.create_task(credentials.watch(store), name="auth-records-watch")
        )
    await running.set_serving(True)
    log.info("%s serving %s on %s", config.service_name, ", ".join(names), running.address)
    return running


async def run_until_signalled(
    running: RunningServer, *, on_stop: Callable[[], object] | None = None
) -> None:
    """Serve until SIGTERM/SIGINT; then graceful shutdown. ``on_stop`` runs first (may be async)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    termination = asyncio.ensure_future(running.server.wait_for_termination())
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({termination, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        log.info("signal received: graceful shutdown (grace %.1f s)", running.grace_s)
        if on_stop is not None:
            result = on_stop()
            if asyncio.iscoroutine(result):
                await result
        await running.stop()
    for task in (termination, stopper):
        task.cancel()
