"""Service metrics: OpenTelemetry metrics, served to Prometheus over HTTP.

Every service process calls :func:`setup_metrics` once at start-up. With ``--metrics-port``
(``SHOAL_METRICS_PORT``) set it installs an OpenTelemetry ``MeterProvider`` whose only reader is
a ``PrometheusMetricReader``, and serves prometheus_client's registry (the OpenTelemetry
instruments plus the process and Python collectors: ``process_cpu_seconds_total``,
``process_resident_memory_bytes``, ...) on ``http://HOST:PORT/metrics``, HOST being the host of
``--listen``. Port 0 binds any free port; the URL is logged and returned. Without the flag no
provider is installed: every instrument is the API's no-op, so the code that records metrics
never needs to ask whether metrics are on.

Instruments are created with :func:`meter` (``opentelemetry.metrics.get_meter``): one created
before :func:`setup_metrics` (at import time, for instance) starts recording once the provider
is installed. Observable instruments read a service's in-memory state in their callbacks, which
run on the HTTP server's thread at scrape time; :func:`observer` wraps such a reader so that
a dict changing size under it (the event loop keeps running) reads again instead of failing
the scrape, and any other error is logged and yields nothing.

Naming: ``shoal_`` prefix, the unit as suffix (``_seconds``), counters end in ``_total`` on
the wire (the exporter adds it). See docs/operations.md, "Reading metrics", for every metric.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import metrics as otel_metrics
from opentelemetry.metrics import CallbackOptions, Observation

from shoal.contract.errors import InvalidField
from shoal.runtime.config import ServerConfig, parse_host_port

__all__ = [
    "DURATION_BUCKETS_S",
    "LATENCY_BUCKETS_S",
    "MetricsEndpoint",
    "meter",
    "observer",
    "setup_metrics",
    "shutdown_metrics",
]

log = logging.getLogger(__name__)

#: Histogram bounds (seconds) for fast operations: a sync round, an RPC.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
#: Histogram bounds (seconds) for slow operations: a rescale (learner start-up included).
DURATION_BUCKETS_S: tuple[float, ...] = (
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)

Reading = Iterable[tuple[float, Mapping[str, str]]]

_state: dict[str, MetricsEndpoint] = {}


@dataclass
class MetricsEndpoint:
    """A running /metrics endpoint of this process."""

    host: str  # bound host
    port: int  # bound port (the real one when 0 was asked)
    url: str  # what to scrape (advertised host, or this machine's name for a wildcard bind)
    _server: Any
    _provider: Any

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._provider.shutdown()


def _url_host(config: ServerConfig, bound_host: str) -> str:
    if config.advertise:
        host, _ = parse_host_port("advertise", config.advertise)
    elif bound_host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()
    else:
        host = bound_host
    return f"[{host}]" if ":" in host else host


def setup_metrics(service_name: str, config: ServerConfig) -> MetricsEndpoint | None:
    """Serve this process's metrics if ``config.metrics_port`` is set (once per process: a
    second call returns the first endpoint). Returns the endpoint, or None when disabled.

    Raises :class:`InvalidField` naming ``metrics_port`` when the port cannot be bound."""
    if config.metrics_port is None:
        return None
    if "endpoint" in _state:
        return _state["endpoint"]
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.resources import Resource
    from prometheus_client import start_http_server

    host, _ = parse_host_port("listen", config.listen)
    bind = host or "0.0.0.0"
    try:
        server, _thread = start_http_server(config.metrics_port, addr=bind)
    except OSError as exc:
        raise InvalidField(
            "metrics_port", config.metrics_port, f"cannot be bound on {bind}: {exc.strerror}"
        ) from exc
    port = int(server.server_port)
    # Scope labels (otel_scope_name, ...) on every series are noise here: one scope per
    # service, and the metric names say where they come from.
    reader = PrometheusMetricReader(scope_info_enabled=False)
    provider = MeterProvider(
        resource=Resource.create({"service.name": service_name}), metric_readers=[reader]
    )
    otel_metrics.set_meter_provider(provider)
    url = f"http://{_url_host(config, bind)}:{port}/metrics"
    endpoint = MetricsEndpoint(bind, port, url, server, provider)
    _state["endpoint"] = endpoint
    log.info("%s metrics on %s (bound %s:%d)", service_name, url, bind, port)
    return endpoint


def shutdown_metrics() -> None:
    """Stop the endpoint (call at process exit; nothing happens when metrics are off)."""
    endpoint = _state.pop("endpoint", None)
    if endpoint is not None:
        endpoint.close()


def meter(name: str) -> otel_metrics.Meter:
    """The meter of module ``name`` (a no-op until :func:`setup_metrics` installs a provider)."""
    return otel_metrics.get_meter(name)


def observer(
    read: Callable[[], Reading], *, what: str = ""
) -> Callable[[CallbackOptions], Iterable[Observation]]:
    """An observable instrument's callback from ``read() -> [(value, labels), ...]``.

    ``read`` runs on the scrape thread while the event loop goes on mutating the state it
    reads: a ``RuntimeError`` (a dict or set changed size during iteration) reads again, up
    to three times; any other error is logged and the scrape gets no points for it."""

    def callback(options: CallbackOptions) -> Iterable[Observation]:
        for _ in range(3):
            try:
                return [Observation(value, dict(labels)) for value, labels in read()]
            except RuntimeError:
                continue
            except Exception:
                log.exception("metrics: reading %s failed", what or read)
                return []
        log.warning("metrics: %s kept changing while read; skipped this scrape", what or read)
        return []

    return callback
