"""``shoal-service parameter-sync``: one parameter-sync shard process.

Flags (each also an environment variable; flags win), beside the server flags of
:mod:`shoal.runtime.config`: :data:`SETTINGS`, documented in docs/configuration.md (generated
from them by ``tools/config_docs.py``).

With ``--etcd`` the shard registers ``/shoal/v1/parameter-sync/shards/<I>`` = its address
(UTF-8) under a lease it keeps alive, so the key disappears a few seconds after the process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shoal.contract import environment
from shoal.contract.keys import SHARDS_PREFIX, shard_key
from shoal.contract.shm import sweep_stale
from shoal.contract.wire import MAX_CHUNK_BYTES, MIN_CHUNK_BYTES
from shoal.param_sync.service import (
    ERRORS,
    ROLES,
    SERVICE_NAME,
    ParameterSyncServicer,
    ShardOptions,
    add_servicer,
)
from shoal.param_sync.shard import warm_up
from shoal.runtime import metrics, telemetry
from shoal.runtime.config import (
    MiB,
    ServerConfig,
    add_server_flags,
    etcd_store,
    parse_host_port,
    server_config_from_args,
)
from shoal.runtime.errors import InvalidField
from shoal.runtime.procs import set_dumpable
from shoal.runtime.server import RunningServer, ServiceBinding
from shoal.runtime.service import run_service
from shoal.runtime.settings import Setting, add_settings

__all__ = [
    "REGISTRY_PREFIX",
    "SETTINGS",
    "ParamSyncConfig",
    "build_parser",
    "main",
    "parse_config",
    "registry_key",
    "serve",
]

log = logging.getLogger(__name__)

REGISTRY_PREFIX = SHARDS_PREFIX  # the key schema: shoal.contract.keys


def registry_key(shard_index: int) -> str:
    return shard_key(shard_index)


@dataclass(frozen=True)
class ParamSyncConfig:
    """Everything a shard process needs, built once from flags and environment."""

    server: ServerConfig
    shard_index: int = 0
    storage_uri: str = ""
    chunk_bytes: int = 1 * MiB
    step_group_bytes: int = 4 * MiB
    registration_ttl_s: float = 5.0
    rendezvous_port: int = 0
    shard_probe_s: float = 1.0
    replication: bool = True
    promote_after_s: float = 2.0
    shm_lane: bool = True
    dumpable: bool = False

    def __post_init__(self) -> None:
        if self.shard_index < 0:
            raise InvalidField("shard_index", self.shard_index, "must be >= 0")
        if not MIN_CHUNK_BYTES <= self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise InvalidField("chunk_bytes", self.chunk_bytes, "must be 1..4 MiB")
        if not 0 <= self.step_group_bytes <= 1024 * MiB:
            raise InvalidField(
                "step_group_bytes", self.step_group_bytes, "must be 0..1024 MiB (0: whole)"
            )
        if self.chunk_bytes + 64 * 1024 > self.server.max_message_bytes:
            raise InvalidField(
                "max_message_bytes", self.server.max_message_bytes, "must exceed the chunk size"
            )
        if not 1 <= self.registration_ttl_s <= 300:
            raise InvalidField("registration_ttl_s", self.registration_ttl_s, "must be 1..300")
        if not 0.1 <= self.shard_probe_s <= 60:
            raise InvalidField("shard_probe_s", self.shard_probe_s, "must be 0.1..60")
        if not 0 <= self.promote_after_s <= 3600:
            raise InvalidField("promote_after_s", self.promote_after_s, "must be 0..3600")


SETTINGS: tuple[Setting, ...] = (
    Setting("--shard-index", "SHOAL_SHARD_INDEX", "0", "this shard's index, 0-based"),
    Setting(
        "--storage-uri",
        environment.STORAGE_URI,
        "",
        "fsspec URI of checkpoints and metrics when OpenJob gives none",
    ),
    Setting(
        "--chunk-mb", "SHOAL_SYNC_CHUNK_MB", "1", "chunk size of parameter streams in MiB, 1-4"
    ),
    Setting(
        "--step-group-mb",
        "SHOAL_STEP_GROUP_MB",
        "4",
        "MiB: a commit steps its slice in groups of about this size, in the model's order, "
        "and each learner's SyncStep answer sends a chunk as soon as its bytes are stepped "
        "(the header at once); 0 steps the whole slice before the first chunk leaves. "
        "Optimizers other than SGD, Adam, AdamW, Adamax, NAdam, RAdam, Adagrad, Adadelta, "
        "RMSprop, Rprop and ASGD (or with fused kernels, or foreach ones of NAdam, RAdam, "
        "ASGD) are always stepped whole",
    ),
    Setting(
        "--registration-ttl",
        "SHOAL_REGISTRATION_TTL_S",
        "5",
        "seconds: lease TTL of the etcd registration",
    ),
    Setting(
        "--rendezvous-port",
        "SHOAL_RENDEZVOUS_PORT",
        "0",
        "TCP port of the torch.distributed store that collective-mode jobs coordinated "
        "here rendezvous through; 0 picks a free port",
    ),
    Setting(
        "--shard-probe",
        "SHOAL_SHARD_PROBE_S",
        "1",
        "seconds between a coordinator's probes of the other shards of its jobs; a shard "
        "found without its slice (restarted) makes the job rewind to its latest checkpoint",
    ),
    Setting(
        "--replication",
        "SHOAL_REPLICATION",
        "on",
        "on or off: keep a replica of each slice of the jobs this shard coordinates on the "
        "next shard, so that a restarted shard loses no committed iteration; off rewinds to "
        "the latest checkpoint instead",
    ),
    Setting(
        "--promote-after",
        "SHOAL_PROMOTE_AFTER_S",
        "2",
        "seconds a lost shard may stay down, once its loss is detected, before its backup "
        "takes its slices over; a restart within it is restored in place",
    ),
    Setting(
        "--shm-lane",
        "SHOAL_SHM_LANE",
        "on",
        "on or off: learners on this shard's host move their SyncStep bytes through a "
        "nameless shared-memory segment instead of gRPC chunks",
    ),
    Setting(
        "--dumpable",
        "SHOAL_SHARD_DUMPABLE",
        "off",
        "on or off: off (the default) makes the shard process non-dumpable "
        "(prctl PR_SET_DUMPABLE 0), so that other processes of its user (learners of any "
        "job) can neither ptrace it nor read its memory or open its descriptors through "
        "/proc; it also writes no core dump and refuses debuggers (py-spy, gdb) not run as "
        "root. on keeps it dumpable, for debugging",
    ),
)
"""The settings of a shard process (docs/configuration.md is generated from them)."""


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    """The flags of a shard process; defaults come from ``env``."""
    parser = argparse.ArgumentParser(prog="shoal-service parameter-sync")
    add_settings(parser.add_argument_group("parameter-sync"), SETTINGS, env)
    add_server_flags(parser, env)
    return parser


def parse_config(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> ParamSyncConfig:
    env = os.environ if env is None else env
    ns = build_parser(env).parse_args(argv)
    server = server_config_from_args("parameter-sync", ns)
    try:
        index = int(ns.shard_index)
    except ValueError:
        raise InvalidField("shard_index", ns.shard_index, "must be an integer") from None
    try:
        rendezvous_port = int(ns.rendezvous_port)
    except ValueError:
        raise InvalidField("rendezvous_port", ns.rendezvous_port, "must be an integer") from None
    if not 0 <= rendezvous_port <= 65535:
        raise InvalidField("rendezvous_port", rendezvous_port, "must be in [0, 65535]")
    try:
        chunk = int(float(ns.chunk_mb) * MiB)
        ttl = float(ns.registration_ttl)
    except ValueError as exc:
        raise InvalidField("chunk_mb/registration_ttl", ns.chunk_mb, f"{exc}") from None
    try:
        step_group = float(ns.step_group_mb)
    except ValueError:
        raise InvalidField("step_group_mb", ns.step_group_mb, "must be a number of MiB") from None
    if not (math.isfinite(step_group) and 0 <= step_group <= 1024):
        raise InvalidField("step_group_mb", ns.step_group_mb, "must be 0..1024 MiB (0: whole)")
    replication = str(ns.replication).strip().lower()
    if replication not in ("on", "off", "true", "false", "1", "0"):
        raise InvalidField("replication", ns.replication, "must be on or off")
    shm_lane = str(ns.shm_lane).strip().lower()
    if shm_lane not in ("on", "off", "true", "false", "1", "0"):
        raise InvalidField("shm_lane", ns.shm_lane, "must be on or off")
    dumpable = str(ns.dumpable).strip().lower()
    if dumpable not in ("on", "off", "true", "false", "1", "0"):
        raise InvalidField("dumpable", ns.dumpable, "must be on or off")
    try:
        probe = float(ns.shard_probe)
    except ValueError:
        raise InvalidField("shard_probe", ns.shard_probe, "must be a number of seconds") from None
    try:
        promote_after = float(ns.promote_after)
    except ValueError:
        raise InvalidField(
            "promote_after", ns.promote_after, "must be a number of seconds"
        ) from None
    return ParamSyncConfig(
        server=server,
        shard_index=index,
        storage_uri=ns.storage_uri,
        chunk_bytes=chunk,
        step_group_bytes=int(step_group * MiB),
        registration_ttl_s=ttl,
        rendezvous_port=rendezvous_port,
        shard_probe_s=probe,
        replication=replication in ("on", "true", "1"),
        promote_after_s=promote_after,
        shm_lane=shm_lane in ("on", "true", "1"),
        dumpable=dumpable in ("on", "true", "1"),
    )


def _advertised(config: ParamSyncConfig, running: RunningServer) -> str:
    if config.server.advertise:
        return config.server.advertise
    host, _ = parse_host_port("listen", config.server.listen)
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"{host}:{running.port}"


async def _register(config: ParamSyncConfig, address: str, stop: asyncio.Event) -> None:
    """Keep ``/shoal/v1/parameter-sync/shards/<I>`` = address alive under a lease."""
    from shoal.runtime.store import LeaseExpired, StoreError

    key = registry_key(config.shard_index)
    ttl = config.registration_ttl_s
    async with etcd_store(config.server, timeout=3.0) as store:
        lease = 0
        while not stop.is_set():
            try:
                if not lease:
                    lease = await store.grant_lease(ttl)
                    await store.put(key, address.encode(), lease=lease)
                    log.info("registered %s = %s", key, address)
                else:
                    await store.refresh_lease(lease)
            except LeaseExpired:
                lease = 0
                continue
            except StoreError as exc:
                log.warning("etcd registration: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=ttl / 3)
        if lease:
            with contextlib.suppress(StoreError):
                await store.revoke_lease(lease)


async def serve(config: ParamSyncConfig) -> None:
    """Serve one shard on the shared skeleton (:func:`shoal.runtime.service.run_service`).

    The etcd registration is this shard's own: a lease it keeps alive under its index, not a
    leader election, so it is started here once the server listens (its address is then known)
    and stopped before the server drains."""
    if not config.dumpable:
        try:
            set_dumpable(False)
        except OSError as exc:
            log.warning("the shard stays dumpable: %s", exc)
        else:
            log.info("not dumpable: processes of this user cannot read its memory (--dumpable)")
    telemetry.setup_tracing(f"parameter-sync-{config.shard_index}")
    warm_up()
    if config.shm_lane:
        for name in sweep_stale():
            log.info("removed the stale shared-memory segment %s (its shard is gone)", name)
    metrics.setup_metrics(f"parameter-sync-{config.shard_index}", config.server)
    servicer = ParameterSyncServicer(
        ShardOptions(
            shard_index=config.shard_index,
            storage_uri=config.storage_uri,
            service_token=config.server.service_token,
            tls=config.server.tls,
            chunk_bytes=config.chunk_bytes,
            step_group_bytes=config.step_group_bytes,
            peer_message_bytes=config.server.max_message_bytes,
            rendezvous_port=config.rendezvous_port,
            shard_probe_s=config.shard_probe_s,
            replication=config.replication,
            promote_after_s=config.promote_after_s,
            shm_lane=config.shm_lane,
        )
    )
    stop = asyncio.Event()
    registration: asyncio.Task[None] | None = None

    def started(running: RunningServer) -> None:
        nonlocal registration
        address = _advertised(config, running)
        log.info("parameter-sync shard %d at %s", config.shard_index, address)
        if config.server.etcd_endpoints:
            registration = asyncio.create_task(_register(config, address, stop))

    async def stopping() -> None:
        stop.set()
        if registration is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(registration, timeout=5)

    await run_service(
        config.server,
        [ServiceBinding(SERVICE_NAME, add_servicer, servicer, ROLES)],
        errors=ERRORS,
        started=started,
        stopping=stopping,
        closed=servicer.close,
        announce=True,
    )


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = parse_config(argv)
    except InvalidField as exc:
        print(f"shoal-service parameter-sync: {exc}", flush=True)
        return 2
    if not logging.getLogger().handlers:
        logging.basicConfig(level=os.environ.get(environment.LOG_LEVEL, "INFO").upper())
    asyncio.run(serve(config))
    return 0
