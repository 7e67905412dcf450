"""Service configuration: frozen dataclasses built once in ``main`` from flags and environment
variables (flags win), validated with messages that echo the field and the value.

Environment variables (each also a flag; declared in :data:`SERVER_SETTINGS`, from which
docs/configuration.md is generated):

=========================  ==========================  =========================================
variable                   flag                        meaning
=========================  ==========================  =========================================
SHOAL_LISTEN               --listen                    host:port to serve on (port 0: any free)
SHOAL_ADVERTISE            --advertise                 address others use to reach this replica
SHOAL_TOKENS_FILE          --tokens-file               bearer tokens file (see shoal.runtime.auth)
SHOAL_SERVICE_TOKEN        --service-token             token this service presents to others
SHOAL_ETCD_ENDPOINTS       --etcd                      comma-separated etcd host:port list
SHOAL_MAX_MESSAGE_MB       --max-message-mb            gRPC message size limit in MiB
SHOAL_SHUTDOWN_GRACE_S     --shutdown-grace            seconds to finish calls on SIGTERM
SHOAL_TLS_CERT/KEY/CA      --tls-cert/--tls-key/--tls-ca  this process's certificate and key (served
                                                       and presented to the services it calls)
                                                       and the cluster CA: with a CA, callers
                                                       must present a certificate it signed
                                                       (mTLS) and the services it calls are
                                                       verified against it
SHOAL_ETCD_CA/CERT/KEY     --etcd-ca/--etcd-cert/      etcd over TLS: its CA, and a client
                           --etcd-key                  certificate and key for mTLS
SHOAL_LEARNER_PUBLIC_KEYS  --learner-public-keys       PEM file of Ed25519 public keys that verify
                                                       learner credentials (beside the ones the
                                                       schedulers publish in etcd)
SHOAL_NO_REFLECTION        --no-reflection             do not serve gRPC server reflection
SHOAL_METRICS_PORT         --metrics-port              Prometheus /metrics port on the --listen
                                                       host (0: any free port, logged; unset or
                                                       empty: no metrics endpoint)
=========================  ==========================  =========================================
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal.contract import environment
from shoal.contract.errors import InvalidField
from shoal.runtime.settings import Setting, add_settings

if TYPE_CHECKING:
    from shoal.runtime.store import EtcdStore

MiB = 1024 * 1024


def parse_host_port(field_name: str, value: str) -> tuple[str, int]:
    host, sep, port_text = value.rpartition(":")
    if not sep or not host:
        raise InvalidField(field_name, value, "must be HOST:PORT")
    try:
        port = int(port_text)
    except ValueError:
        raise InvalidField(field_name, value, "must end in a numeric port") from None
    if not 0 <= port <= 65535:
        raise InvalidField(field_name, value, "port must be in 0..65535")
    return host.strip("[]"), port


@dataclass(frozen=True)
class TLSConfig:
    cert_file: str
    key_file: str
    ca_file: str | None = None  # set: clients must present a certificate signed by it (mTLS)

    def validate(self) -> None:
        for name in ("cert_file", "key_file", "ca_file"):
            value = getattr(self, name)
            if value is not None and not Path(value).is_file():
                raise InvalidField(f"tls.{name}", value, "is not a readable file")


@dataclass(frozen=True)
class EtcdTLSConfig:
    """TLS to etcd: the CA that signed etcd's certificate, and a client certificate (mTLS)."""

    ca_file: str
    cert_file: str | None = None
    key_file: str | None = None

    def validate(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise InvalidField("etcd_tls", "cert/key", "needs both --etcd-cert and --etcd-key")
        for name in ("ca_file", "cert_file", "key_file"):
            value = getattr(self, name)
            if value is not None and not Path(value).is_file():
                raise InvalidField(f"etcd_tls.{name}", value, "is not a readable file")


@dataclass(frozen=True)
class ServerConfig:
    """What every shoal server needs. Services embed it in their own config."""

    service_name: str
    listen: str = "127.0.0.1:0"
    advertise: str | None = None
    tokens_file: str | None = None
    service_token: str | None = None
    allow_no_auth: bool = False
    etcd_endpoints: tuple[str, ...] = ()
    max_message_bytes: int = 64 * MiB
    shutdown_grace_s: float = 5.0
    tls: TLSConfig | None = None
    metrics_port: int | None = None  # None: no /metrics endpoint; 0: any free port
    extra: Mapping[str, str] = field(default_factory=dict)
    etcd_tls: EtcdTLSConfig | None = None
    learner_public_keys: str | None = None
    reflection: bool = True
    max_concurrent_calls: int = 0  # unary calls in flight before shedding (0: no limit)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not self.service_name:
            raise InvalidField("service_name", self.service_name, "must not be empty")
        parse_host_port("listen", self.listen)
        if self.advertise is not None:
            parse_host_port("advertise", self.advertise)
        for ep in self.etcd_endpoints:
            parse_host_port("etcd_endpoints", ep)
        if not 1 * MiB <= self.max_message_bytes <= 1024 * MiB:
            raise InvalidField("max_message_bytes", self.max_message_bytes, "must be 1..1024 MiB")
        if not 0 <= self.max_concurrent_calls <= 1_000_000:
            raise InvalidField(
                "max_concurrent_calls", self.max_concurrent_calls, "must be in 0..1000000"
            )
        if not 0 <= self.shutdown_grace_s <= 600:
            raise InvalidField("shutdown_grace_s", self.shutdown_grace_s, "must be in 0..600")
        if self.tokens_file is None and not self.allow_no_auth:
            raise InvalidField(
                "tokens_file", None, "is required (or pass --insecure-no-auth for a test bed)"
            )
        if self.tokens_file is not None and not Path(self.tokens_file).is_file():
            raise InvalidField("tokens_file", self.tokens_file, "is not a readable file")
        if self.tls is not None:
            self.tls.validate()
        if self.etcd_tls is not None:
            self.etcd_tls.validate()
        if self.learner_public_keys is not None and not Path(self.learner_public_keys).is_file():
            raise InvalidField(
                "learner_public_keys", self.learner_public_keys, "is not a readable file"
            )
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise InvalidField(
                "metrics_port",
                self.metrics_port,
                "must be in 0..65535 (0: any free port; leave it unset for no metrics endpoint)",
            )


SERVER_SETTINGS: tuple[Setting, ...] = (
    Setting("--listen", "SHOAL_LISTEN", "127.0.0.1:0", "host:port to serve on (port 0: any free)"),
    Setting("--advertise", "SHOAL_ADVERTISE", None, "address others use to reach this replica"),
    Setting("--tokens-file", "SHOAL_TOKENS_FILE", None, "bearer tokens file (shoal.runtime.auth)"),
    Setting("--service-token", "SHOAL_SERVICE_TOKEN", None, "token this service presents"),
    Setting("--insecure-no-auth", None, None, "accept calls without tokens", switch=True),
    Setting("--etcd", "SHOAL_ETCD_ENDPOINTS", "", "comma-separated etcd host:port list"),
    Setting("--max-message-mb", "SHOAL_MAX_MESSAGE_MB", "64", "gRPC message size limit, MiB"),
    Setting(
        "--shutdown-grace", "SHOAL_SHUTDOWN_GRACE_S", "5", "seconds to finish calls on SIGTERM"
    ),
    Setting(
        "--tls-cert",
        environment.TLS_CERT,
        None,
        "this process's certificate (served, and presented to the services it calls)",
    ),
    Setting("--tls-key", environment.TLS_KEY, None, "the key of --tls-cert"),
    Setting(
        "--tls-ca",
        environment.TLS_CA,
        None,
        "the cluster CA: callers must present a certificate it signed (mTLS) and the services "
        "this one calls are verified against it",
    ),
    Setting("--etcd-ca", "SHOAL_ETCD_CA", None, "CA of etcd's certificate"),
    Setting("--etcd-cert", "SHOAL_ETCD_CERT", None, "client cert for etcd"),
    Setting("--etcd-key", "SHOAL_ETCD_KEY", None, "client key for etcd"),
    Setting(
        "--learner-public-keys",
        "SHOAL_LEARNER_PUBLIC_KEYS",
        None,
        "PEM file of Ed25519 public keys that verify learner credentials",
    ),
    Setting(
        "--max-concurrent-calls",
        "SHOAL_MAX_CONCURRENT_CALLS",
        "0",
        "unary calls in flight before new ones are shed with RESOURCE_EXHAUSTED "
        "(0: no limit; streams, RegisterHost and health checks are never shed)",
    ),
    Setting(
        "--no-reflection",
        "SHOAL_NO_REFLECTION",
        None,
        "do not serve gRPC server reflection",
        switch=True,
    ),
    Setting(
        "--metrics-port",
        "SHOAL_METRICS_PORT",
        None,
        "serve Prometheus metrics on http://LISTEN_HOST:PORT/metrics (0: any free port; "
        "unset or empty: no metrics endpoint)",
    ),
)
"""The settings every service has (docs/configuration.md is generated from them)."""


def add_server_flags(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """Flags shared by every service; defaults come from the environment."""
    add_settings(parser.add_argument_group("server"), SERVER_SETTINGS, env)


def parse_number(field_name: str, text: str, kind: type[int] | type[float]) -> int | float:
    """``kind(text)``, or InvalidField naming the field and the value."""
    try:
        return kind(text)
    except (TypeError, ValueError):
        article = "an integer" if kind is int else "a number"
        raise InvalidField(field_name, text, f"must be {article}") from None


def server_config_from_args(service_name: str, ns: argparse.Namespace) -> ServerConfig:
    tls = None
    if ns.tls_cert or ns.tls_key:
        if not (ns.tls_cert and ns.tls_key):
            raise InvalidField("tls", "cert/key", "needs both --tls-cert and --tls-key")
        tls = TLSConfig(ns.tls_cert, ns.tls_key, ns.tls_ca)
    etcd_tls = None
    if getattr(ns, "etcd_ca", None) or getattr(ns, "etcd_cert", None):
        if not ns.etcd_ca:
            raise InvalidField("etcd_tls", "cert/key", "needs --etcd-ca beside --etcd-cert")
        etcd_tls = EtcdTLSConfig(ns.etcd_ca, ns.etcd_cert, ns.etcd_key)
    service_token = ns.service_token
    if service_token and service_token.startswith("@"):
        try:
            service_token = Path(service_token[1:]).read_text().strip()
        except OSError as exc:
            raise InvalidField(
                "service_token", service_token, f"cannot be read: {exc.strerror}"
            ) from exc
    return ServerConfig(
        service_name=service_name,
        listen=ns.listen,
        advertise=ns.advertise,
        tokens_file=ns.tokens_file,
        service_token=service_token,
        allow_no_auth=ns.insecure_no_auth,
        etcd_endpoints=tuple(e.strip() for e in ns.etcd.split(",") if e.strip()),
        max_message_bytes=int(parse_number("max_message_mb", ns.max_message_mb, float) * MiB),
        shutdown_grace_s=float(parse_number("shutdown_grace_s", ns.shutdown_grace, float)),
        tls=tls,
        metrics_port=_optional_port("metrics_port", getattr(ns, "metrics_port", None)),
        etcd_tls=etcd_tls,
        learner_public_keys=getattr(ns, "learner_public_keys", None) or None,
        reflection=not getattr(ns, "no_reflection", False),
        max_concurrent_calls=int(
            parse_number(
                "max_concurrent_calls", getattr(ns, "max_concurrent_calls", "0") or "0", int
            )
        ),
    )


def etcd_store(config: ServerConfig, **options: Any) -> EtcdStore:
    """The etcd store of ``config``'s endpoints, over TLS when ``--etcd-ca`` is set: every
    service opens its etcd connections with this."""
    from shoal.runtime.store import EtcdStore

    tls = config.etcd_tls
    if tls is not None:
        options.setdefault("ca_cert", tls.ca_file)
        if tls.cert_file:
            options.setdefault("cert_cert", tls.cert_file)
            options.setdefault("cert_key", tls.key_file)
    return EtcdStore(list(config.etcd_endpoints), **options)


def _optional_port(field_name: str, text: str | None) -> int | None:
    """None for an unset or empty flag, else the port (range checked by ServerConfig)."""
    if text is None or not str(text).strip():
        return None
    return int(parse_number(field_name, str(text).strip(), int))


def parse_server_config(
    service_name: str, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> ServerConfig:
    """Build a ServerConfig for a service that has no flags of its own."""
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(prog=service_name)
    add_server_flags(parser, env)
    return server_config_from_args(service_name, parser.parse_args(argv))
