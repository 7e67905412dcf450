"""The dashboard, Prometheus and Grafana in compose/, checked on `docker-compose config`'s
resolved file (Compose 1.29, as in test_deploy_files.py) and with the real parsers: the web
dashboard's command by its own flag parser (it reaches both replicas and holds no secret),
Prometheus's scrape targets against the services and their metrics port, Grafana's provisioning
against its mounts, and every query of the Grafana dashboard parsed as PromQL (promql-parser)
and checked to name only metrics that shoal exports (docs/operations.md, "Reading metrics")."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml

from shoal.dashboard.config import parse_args
from tests.integration.test_deploy_files import (
    COMPOSE_DIR,
    RMS,
    SCHEDULERS,
    SHOAL,
    advertised,
    env_of,
    mounts,
    published_targets,
    secrets_of,
    simulated,
)

__all__ = ["simulated"]

ROOT = COMPOSE_DIR.parent
GRAFANA = COMPOSE_DIR / "grafana"
DASHBOARD_JSON = GRAFANA / "dashboards" / "shoal.json"
OPERATIONS = ROOT / "docs" / "operations.md"
# prometheus_client's own collectors and the OpenTelemetry exporter's resource metric, on
# every endpoint (docs/operations.md says so).
GENERIC = re.compile(r"^(process_\w+|python_\w+|target_info)$")


def documented_metrics() -> dict[str, str]:
    """Metric family -> type, from the table in docs/operations.md."""
    families = {}
    for line in OPERATIONS.read_text().splitlines():
        match = re.match(r"^\| `(shoal_\w+)` \| (\w+) \|", line)
        if match:
            families[match.group(1)] = match.group(2)
    assert len(families) > 8, "the metrics table of docs/operations.md was not found"
    return families


def exported_metrics() -> set[str]:
    """The series names shoal exports: each family, and a histogram's _bucket/_sum/_count."""
    names: set[str] = set()
    for name, kind in documented_metrics().items():
        names.add(name)
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # panels inside collapsed rows
    return out


def metric_names(expr: str) -> list[str]:
    """The metric names an expression selects, from its PromQL syntax tree (Grafana's
    variables replaced by values of their kind first)."""
    concrete = expr.replace("$__rate_interval", "1m").replace("$__interval", "1m")
    concrete = re.sub(r"\$\{?\w+\}?", "x", concrete)
    tree = promql_parser.parse(concrete)
    names: list[str] = []

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            names.append(node.name)

    promql_parser.walk(tree, visit)
    return names


def test_compose_serves_the_dashboard_to_both_replicas_without_a_credential(simulated):
    service = simulated["services"]["dashboard"]
    assert service["entrypoint"] == ["shoal-dashboard"]
    config = parse_args([str(a) for a in service["command"]], env={})
    assert list(config.scheduler) == advertised(simulated, SCHEDULERS)
    assert list(config.resource_manager) == advertised(simulated, RMS)
    assert config.host == "0.0.0.0"
    assert secrets_of(service) == set(), "the dashboard must hold no token"
    assert config.port in published_targets(service)
    assert any(str(p).startswith("127.0.0.1:") for p in service["ports"]), service["ports"]
    probe = " ".join(service["healthcheck"]["test"])
    assert f"http://127.0.0.1:{config.port}/healthz" in probe
    assert service["restart"] == "unless-stopped" and service["init"] is True


def test_prometheus_scrapes_every_shoal_process_on_its_metrics_port(simulated):
    services = simulated["services"]
    prometheus = services["prometheus"]
    config_path = mounts(prometheus)["/etc/prometheus/prometheus.yml"]
    scrape = yaml.safe_load(Path(config_path).read_text())
    assert any(
        a.startswith("--config.file=/etc/prometheus/prometheus.yml") for a in prometheus["command"]
    )
    targets = {
        target
        for job in scrape["scrape_configs"]
        for group in job["static_configs"]
        for target in group["targets"]
    }
    expected = set()
    for name in SHOAL:
        port = int(env_of(services[name])["SHOAL_METRICS_PORT"])
        assert port > 0, f"{name}: metrics on a fixed port for Prometheus"
        expected.add(f"{name}:{port}")
    assert targets == expected
    assert mounts(prometheus)["/prometheus"] in simulated["volumes"]


def test_grafana_is_provisioned_with_prometheus_and_the_shoal_dashboard(simulated):
    grafana = simulated["services"]["grafana"]
    where = mounts(grafana)
    provisioning = Path(where["/etc/grafana/provisioning"])
    assert provisioning == GRAFANA / "provisioning"
    datasources = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    assert 9090 not in published_targets(simulated["services"]["prometheus"])  # internal only
    providers = yaml.safe_load((provisioning / "dashboards" / "shoal.yaml").read_text())
    (provider,) = providers["providers"]
    dashboards_dir = provider["options"]["path"]
    assert Path(where[dashboards_dir]) == DASHBOARD_JSON.parent
    dashboard = json.loads(DASHBOARD_JSON.read_text())
    for panel in panels(dashboard):
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == source["uid"], panel["title"]
    assert env_of(grafana)["GF_AUTH_DISABLE_LOGIN_FORM"] == "true"  # nobody logs in as admin
    assert any(str(p).startswith("127.0.0.1:") for p in grafana["ports"]), grafana["ports"]


def test_every_grafana_query_names_only_metrics_that_shoal_exports():
    exported = exported_metrics()
    dashboard = json.loads(DASHBOARD_JSON.read_text())
    seen: set[str] = set()
    queries = 0
    for panel in panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel.get("targets"), f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            names = metric_names(target["expr"])
            assert names, f"{panel['title']!r}: {target['expr']!r} selects no metric"
            for name in names:
                assert name in exported or GENERIC.match(name), (
                    f"{panel['title']!r} queries {name!r}, which shoal does not export "
                    "(docs/operations.md, 'Reading metrics')"
                )
            seen.update(names)
            queries += 1
    for variable in dashboard["templating"]["list"]:
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else ""
        match = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", query)
        assert match and match.group(1) in exported, variable
    # Every metric family the docs list is on the dashboard somewhere.
    families = documented_metrics()
    shown = {re.sub(r"_(bucket|sum|count)$", "", n) if n not in families else n for n in seen}
    assert set(families) <= shown, set(families) - shown
    assert queries >= 15


@pytest.mark.parametrize(
    "expr",
    ["sum(shoal_gpus_alocated)", "rate(shoal_sync_iterations_total[1m])", "up"],
)
def test_the_check_catches_a_metric_that_is_not_exported(expr):
    exported = exported_metrics()
    assert not all(n in exported or GENERIC.match(n) for n in metric_names(expr))
