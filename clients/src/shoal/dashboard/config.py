"""The dashboard's settings: one frozen dataclass built once in ``main`` and validated there.

The dashboard holds no credential of its own. It needs to know where the services are (the
scheduler and resource-manager endpoints: flags, or the same environment and config file as the
CLI, whose token it ignores) and how to reach them (``--tls-ca``); each user logs in with their
own token and every API call is made with it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from shoal.client.config import ConfigError, load_config

__all__ = ["DashboardConfig", "parse_args"]

DEFAULT_LISTEN = "127.0.0.1:8480"


def _split(value: str | None) -> tuple[str, ...]:
    return tuple(v.strip() for v in (value or "").split(",") if v.strip())


def _host_port(field_name: str, value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{field_name} ({value!r}) must be HOST:PORT with a port in 0..65535")
    return host.strip("[]") or "0.0.0.0", int(port)


@dataclass(frozen=True)
class DashboardConfig:
    """What the dashboard serves and which services it talks to. Validated on construction:
    a bad value raises ConfigError naming the field and the value."""

    scheduler: tuple[str, ...]
    resource_manager: tuple[str, ...] = ()
    listen: str = DEFAULT_LISTEN
    tls_ca: str | None = None  # CA of the services' certificates (they serve TLS)
    tls_cert: str | None = None  # serve HTTPS with this certificate ...
    tls_key: str | None = None  # ... and key
    client_cert: str | None = None  # the certificate shown to services that require one ...
    client_key: str | None = None  # ... and its key (it carries the users' tokens, not its own)
    poll_interval_s: float = 1.0
    session_idle_s: float = 8 * 3600.0
    session_max_age_s: float = 24 * 3600.0
    call_timeout_s: float = 10.0
    access_log: bool = False

    def __post_init__(self) -> None:
        if not self.scheduler:
            raise ConfigError(
                "scheduler (()) must name at least one scheduler host:port: pass --scheduler, "
                "set SHOAL_ENDPOINTS, or run it next to a `shoal cluster up` cluster"
            )
        for name in ("scheduler", "resource_manager"):
            for address in getattr(self, name):
                _host_port(name, address)
        _host_port("listen", self.listen)
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError(
                f"tls_cert ({self.tls_cert!r}) and tls_key ({self.tls_key!r}) must be given "
                "together"
            )
        if bool(self.client_cert) != bool(self.client_key):
            raise ConfigError(
                f"client_cert ({self.client_cert!r}) and client_key ({self.client_key!r}) must "
                "be given together"
            )
        for name in ("tls_ca", "tls_cert", "tls_key", "client_cert", "client_key"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ConfigError(f"{name} ({path!r}) is not a readable file")
        for name, low in (
            ("poll_interval_s", 0.05),
            ("session_idle_s", 1.0),
            ("session_max_age_s", 1.0),
            ("call_timeout_s", 0.1),
        ):
            value = getattr(self, name)
            if not low <= value <= 7 * 24 * 3600:
                raise ConfigError(f"{name} ({value!r}) must be between {low} and one week")

    @property
    def host(self) -> str:
        return _host_port("listen", self.listen)[0]

    @property
    def port(self) -> int:
        return _host_port("listen", self.listen)[1]

    @property
    def https(self) -> bool:
        return bool(self.tls_cert)


def parse_args(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> DashboardConfig:
    """``shoal-dashboard`` flags -> DashboardConfig (endpoints default to the CLI's config)."""
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(
        prog="shoal-dashboard",
        description="The shoal web dashboard: jobs, GPUs per job over time, the cluster, each "
        "job's metrics, learners, logs and checkpoints, live. Users log in with their token.",
    )
    parser.add_argument(
        "--listen",
        default=env.get("SHOAL_DASHBOARD_LISTEN", DEFAULT_LISTEN),
        help=f"HOST:PORT to serve on (default {DEFAULT_LISTEN}; SHOAL_DASHBOARD_LISTEN).",
    )
    parser.add_argument("--scheduler", help="Scheduler host:port list (default: as the CLI).")
    parser.add_argument(
        "--resource-manager", help="Resource-manager host:port list (default: as the CLI)."
    )
    parser.add_argument("--tls-ca", help="CA certificate of the services (they serve TLS).")
    parser.add_argument("--tls-cert", help="Serve HTTPS with this certificate (PEM).")
    parser.add_argument("--tls-key", help="The private key of --tls-cert (PEM).")
    parser.add_argument(
        "--client-cert",
        help="Client certificate (PEM) to present to services that require mutual TLS; a user "
        "certificate: it carries each logged-in user's token, never a credential of its own.",
    )
    parser.add_argument("--client-key", help="The private key of --client-cert (PEM).")
    parser.add_argument(
        "--poll-interval",
        type=float,
        default=1.0,
        help="Seconds between the reads that feed the live pages (default 1).",
    )
    parser.add_argument(
        "--session-idle",
        type=float,
        default=8 * 3600.0,
        help="Log a browser out after this many seconds without a request (default 8 h).",
    )
    parser.add_argument("--access-log", action="store_true", help="Log every HTTP request.")
    ns = parser.parse_args(argv)
    scheduler = _split(ns.scheduler)
    rm = _split(ns.resource_manager)
    tls_ca = ns.tls_ca
    client_cert, client_key = ns.client_cert, ns.client_key
    if not scheduler:
        client = load_config(env=env)  # raises ConfigError naming what is missing
        scheduler = client.scheduler
        rm = rm or client.resource_manager
        tls_ca = tls_ca or client.tls_ca
        if not client_cert:
            client_cert, client_key = client.tls_cert, client.tls_key
    return DashboardConfig(
        scheduler=scheduler,
        resource_manager=rm,
        listen=ns.listen,
        tls_ca=tls_ca,
        tls_cert=ns.tls_cert,
        tls_key=ns.tls_key,
        client_cert=client_cert,
        client_key=client_key,
        poll_interval_s=ns.poll_interval,
        session_idle_s=ns.session_idle,
        access_log=ns.access_log,
    )
