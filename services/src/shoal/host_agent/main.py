"""``shoal-service host-agent [flags]``: run the host agent of this host.

Flags (each also an environment variable; flags win), besides the server flags of
:mod:`shoal.runtime.config`:

=================================  =============================  ===============================
flag                               variable                       default
=================================  =============================  ===============================
``--host-id ID``                   SHOAL_HOST_ID                  the hostname
``--resource-managers ADDR[,...]`` SHOAL_RESOURCE_MANAGERS        none (the agent does not
                                                                  register)
``--schedulers ADDR[,...]``        SHOAL_SCHEDULERS               none (no artifact download)
``--artifact-dir DIR|URI``         SHOAL_ARTIFACT_DIR             none
``--simulate-gpus N``              SHOAL_SIMULATE_GPUS            unset: real GPUs through NVML
``--work-dir DIR``                 SHOAL_AGENT_WORK_DIR           <tmp>/shoal-host-agent-<host>
``--stop-grace SECONDS``           SHOAL_AGENT_STOP_GRACE_S       10
``--retain-exited SECONDS``        SHOAL_AGENT_RETAIN_EXITED_S    3600
``--label KEY=VALUE`` (repeat)     SHOAL_HOST_LABELS (k=v,k=v)    none
``--resource-group NAME``          SHOAL_RESOURCE_GROUP           default
``--learner-tls-cert FILE``        SHOAL_LEARNER_TLS_CERT         none; required with --tls-ca:
``--learner-tls-key FILE``         SHOAL_LEARNER_TLS_KEY          the certificate (kind learner)
                                                                  this host's learners present
``--warm-learners N|auto``         SHOAL_WARM_LEARNERS            auto: one warm learner process
                                                                  per device (0: all start cold)
=================================  =============================  ===============================
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from shoal.contract.errors import InvalidField
from shoal.host_agent.devices import make_device_source
from shoal.host_agent.metrics import register_metrics
from shoal.host_agent.service import ERRORS, HostAgent, HostAgentConfig, bindings
from shoal.runtime import metrics, telemetry
from shoal.runtime.config import add_server_flags, parse_number, server_config_from_args
from shoal.runtime.server import RunningServer
from shoal.runtime.service import run_service
from shoal.runtime.settings import Setting, add_settings

log = logging.getLogger(__name__)

NAME = "host-agent"


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "--host-id",
        "SHOAL_HOST_ID",
        socket.gethostname,
        "this host's id in the inventory",
        shown_default="the host name",
    ),
    Setting(
        "--resource-managers",
        "SHOAL_RESOURCE_MANAGERS",
        "",
        "comma-separated addresses of the resource-manager replicas",
        aliases=("--resource-manager",),
        dest="resource_managers",
    ),
    Setting(
        "--schedulers",
        "SHOAL_SCHEDULERS",
        "",
        "comma-separated job-scheduler addresses to download artifacts from",
        aliases=("--scheduler",),
        dest="schedulers",
    ),
    Setting(
        "--artifact-dir",
        "SHOAL_ARTIFACT_DIR",
        None,
        "directory or fsspec URI holding artifacts as <sha256>.tar.gz",
    ),
    Setting(
        "--simulate-gpus",
        "SHOAL_SIMULATE_GPUS",
        None,
        "expose N simulated GPUs instead of the real ones (learners run on CPU)",
    ),
    Setting(
        "--work-dir",
        "SHOAL_AGENT_WORK_DIR",
        None,
        "where learners' directories, artifacts and environments live",
        shown_default="<tmp>/shoal-host-agent-<host id>",
    ),
    Setting(
        "--stop-grace",
        "SHOAL_AGENT_STOP_GRACE_S",
        "10",
        "seconds between SIGTERM and SIGKILL when a learner is stopped",
    ),
    Setting(
        "--retain-exited",
        "SHOAL_AGENT_RETAIN_EXITED_S",
        "3600",
        "seconds an exited learner (and its directory) is kept after it was reported",
    ),
    Setting(
        "--label",
        "SHOAL_HOST_LABELS",
        None,
        "KEY=VALUE label of this host (repeatable; the variable: comma-separated)",
        repeated=True,
    ),
    Setting("--resource-group", "SHOAL_RESOURCE_GROUP", "", "this host's resource group"),
    Setting(
        "--learner-tls-cert",
        "SHOAL_LEARNER_TLS_CERT",
        None,
        "client certificate of this host's learners (a 'learner' one, never the agent's)",
    ),
    Setting("--learner-tls-key", "SHOAL_LEARNER_TLS_KEY", None, "its private key"),
    Setting(
        "--warm-learners",
        "SHOAL_WARM_LEARNERS",
        "auto",
        "warm learner processes (torch imported) kept ready: N, or auto (one per device)",
    ),
)
"""The settings of a host agent (docs/configuration.md is generated from them)."""


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"shoal-service {NAME}",
        description="The shoal host agent: devices, learner processes, logs.",
    )
    add_server_flags(parser, env)
    add_settings(parser.add_argument_group(NAME), SETTINGS, env)
    return parser


def _addresses(text: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in text.split(",") if a.strip())


def parse_config(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> HostAgentConfig:
    env = os.environ if env is None else env
    ns = build_parser(env).parse_args(argv)
    labels: dict[str, str] = {}
    for item in ns.label:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidField("label", item, "must be KEY=VALUE")
        labels[key] = value
    simulate = None
    if ns.simulate_gpus not in (None, ""):
        simulate = int(parse_number("simulate_gpus", ns.simulate_gpus, int))
    warm: int | None = None
    if str(ns.warm_learners).strip().lower() != "auto":
        warm = int(parse_number("warm_learners", ns.warm_learners, int))
    work_dir = ns.work_dir or str(Path(tempfile.gettempdir()) / f"shoal-host-agent-{ns.host_id}")
    return HostAgentConfig(
        server=server_config_from_args(NAME, ns),
        host_id=ns.host_id,
        work_dir=Path(work_dir),
        resource_managers=_addresses(ns.resource_managers),
        schedulers=_addresses(ns.schedulers),
        artifact_dir=ns.artifact_dir or None,
        simulate_gpus=simulate,
        stop_grace_s=parse_number("stop_grace", ns.stop_grace, float),
        retain_exited_s=parse_number("retain_exited", ns.retain_exited, float),
        labels=labels,
        resource_group=ns.resource_group,
        learner_tls_cert=ns.learner_tls_cert or None,
        learner_tls_key=ns.learner_tls_key or None,
        warm_learners=warm,
    )


async def serve(config: HostAgentConfig) -> None:
    telemetry.setup_tracing(NAME)
    endpoint = metrics.setup_metrics(NAME, config.server)
    agent = HostAgent(config, make_device_source(config.host_id, config.simulate_gpus))
    if endpoint is not None:
        register_metrics(agent)

    def started(running: RunningServer) -> None:
        address = config.server.advertise or running.address
        agent.start(address)
        log.info(
            "host agent %r serving on %s with %d device(s)",
            config.host_id,
            address,
            len(agent.devices),
        )

    await run_service(
        config.server, bindings(agent), errors=ERRORS, started=started, stopping=agent.close
    )


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = parse_config(argv)
    except InvalidField as exc:
        print(f"{NAME}: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve(config))
    return 0
