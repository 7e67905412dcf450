"""``shoal-service resource-manager [flags]``: run one resource-manager replica.

Run two or more on the same etcd for leader + standby. Flags (each also an environment
variable; flags win), besides the server flags of :mod:`shoal.runtime.config`:

=================================  =====================================  =================
flag                               variable                               default
=================================  =====================================  =================
``--heartbeat-interval SECONDS``   SHOAL_RM_HEARTBEAT_INTERVAL_S          1.0
``--host-grace SECONDS`` (alias    SHOAL_RM_HOST_GRACE_S                  3.0
``--host-lost-after``)
``--host-restart-grace SECONDS``   SHOAL_RM_HOST_RESTART_GRACE_S          30.0
``--election-ttl SECONDS``         SHOAL_RM_ELECTION_TTL_S                5.0
``--scheduler-election NAME``      SHOAL_RM_SCHEDULER_ELECTION            job-scheduler
=================================  =====================================  =================

Without ``--etcd`` the replica keeps its state in memory (a single-replica test bed: nothing
survives a restart).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Mapping, Sequence

from shoal.contract.errors import InvalidField
from shoal.resource_manager.metrics import register_metrics
from shoal.resource_manager.service import (
    ERRORS,
    ResourceManager,
    ResourceManagerConfig,
    bindings,
)
from shoal.runtime import metrics, telemetry
from shoal.runtime.config import add_server_flags, etcd_store, server_config_from_args
from shoal.runtime.server import RunningServer
from shoal.runtime.service import run_service
from shoal.runtime.settings import Setting, add_settings
from shoal.runtime.store import MemoryStore, Store

log = logging.getLogger(__name__)

NAME = "resource-manager"


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "--heartbeat-interval",
        "SHOAL_RM_HEARTBEAT_INTERVAL_S",
        "1.0",
        "seconds between the heartbeats agents send (told to them at registration)",
    ),
    Setting(
        "--host-grace",
        "SHOAL_RM_HOST_GRACE_S",
        "3.0",
        "seconds without a heartbeat after which a host is declared lost",
        aliases=("--host-lost-after",),
        dest="host_grace",
    ),
    Setting(
        "--host-restart-grace",
        "SHOAL_RM_HOST_RESTART_GRACE_S",
        "30.0",
        "seconds of silence allowed to a host agent that stopped gracefully (SIGTERM) "
        "to restart, before its host is declared lost",
        dest="host_restart_grace",
    ),
    Setting(
        "--election-ttl",
        "SHOAL_RM_ELECTION_TTL_S",
        "5.0",
        "lease TTL of the leader election (a standby takes over within about this)",
    ),
    Setting(
        "--scheduler-election",
        "SHOAL_RM_SCHEDULER_ELECTION",
        "job-scheduler",
        "election whose leader's fencing token AcquireDevices/ReleaseDevices must carry",
    ),
)
"""The resource manager's settings (docs/configuration.md is generated from them)."""


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"shoal-service {NAME}",
        description="The shoal resource manager: inventory, host liveness, allocation ledger.",
    )
    add_server_flags(parser, env)
    add_settings(parser.add_argument_group(NAME), SETTINGS, env)
    return parser


def _seconds(field_name: str, text: str) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        raise InvalidField(field_name, text, "must be a number of seconds") from None


def parse_config(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> ResourceManagerConfig:
    env = os.environ if env is None else env
    ns = build_parser(env).parse_args(argv)
    return ResourceManagerConfig(
        server=server_config_from_args(NAME, ns),
        heartbeat_interval_s=_seconds("heartbeat_interval", ns.heartbeat_interval),
        host_grace_s=_seconds("host_grace", ns.host_grace),
        host_restart_grace_s=_seconds("host_restart_grace", ns.host_restart_grace),
        election_ttl_s=_seconds("election_ttl", ns.election_ttl),
        scheduler_election=ns.scheduler_election,
    )


def make_store(config: ResourceManagerConfig) -> Store:
    if config.server.etcd_endpoints:
        return etcd_store(config.server)
    log.warning("no --etcd given: state is kept in memory and lost when this process ends")
    return MemoryStore()


async def serve(config: ResourceManagerConfig) -> None:
    telemetry.setup_tracing(NAME)
    endpoint = metrics.setup_metrics(NAME, config.server)
    store = make_store(config)
    rm = ResourceManager(config, store)
    if endpoint is not None:
        register_metrics(rm)

    def started(running: RunningServer) -> None:
        address = config.server.advertise or running.address
        rm.start(address)
        log.info("%s replica %s campaigning for leadership", NAME, address)

    await run_service(
        config.server,
        bindings(rm),
        errors=ERRORS,
        started=started,
        stopping=rm.close,
        closed=store.close,
    )


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = parse_config(argv)
    except InvalidField as exc:
        print(f"{NAME}: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve(config))
    return 0
