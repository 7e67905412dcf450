"""Where the client finds the cluster and its credentials.

In order of precedence:

1. explicit arguments (``Client(endpoints=[...], token=...)``, CLI flags);
2. environment: ``SHOAL_ENDPOINTS`` (comma-separated scheduler host:port list),
   ``SHOAL_RM_ENDPOINTS`` (resource-manager list, for ``shoal hosts``), ``SHOAL_TOKEN``,
   ``SHOAL_TLS_CA``, ``SHOAL_TLS_CERT``, ``SHOAL_TLS_KEY``;
3. a config file: ``SHOAL_CONFIG`` or ``~/.config/shoal/config.json``; the embedded local cluster
   writes ``.shoal/cluster.json`` in its state directory and ``shoal cluster up`` points the CLI
   at it, so nothing is set by hand.

The file holds ``{"scheduler": ["h:p", ...], "resource_manager": ["h:p", ...], "token": "..."}``
(optionally ``"token_file"`` instead of ``"token"``, and for TLS ``"tls_ca"``, the cluster's CA,
and ``"tls_cert"``/``"tls_key"``, the client certificate a cluster with mutual TLS requires;
``shoal cluster up --tls`` writes all three).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CONFIG = Path("~/.config/shoal/config.json")
LOCAL_CLUSTER_FILE = Path(".shoal/cluster.json")


class ConfigError(ValueError):
    """The client configuration is missing or malformed (the message says which field)."""


@dataclass(frozen=True)
class ClientConfig:
    scheduler: tuple[str, ...]
    resource_manager: tuple[str, ...] = ()
    token: str | None = None
    tls_ca: str | None = None
    source: str = "arguments"
    tls_cert: str | None = None
    tls_key: str | None = None


def _split(value: str | None) -> tuple[str, ...]:
    return tuple(v.strip() for v in (value or "").split(",") if v.strip())


def config_path(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get("SHOAL_CONFIG"):
        return Path(env["SHOAL_CONFIG"]).expanduser()
    if LOCAL_CLUSTER_FILE.is_file():
        return LOCAL_CLUSTER_FILE
    return DEFAULT_CONFIG.expanduser()


def read_config_file(path: Path) -> dict[str, object]:
    try:
        data = json.loads(path.read_text())
    except OSError:
        return {}
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a JSON object")
    return data


def load_config(
    *,
    endpoints: str | None = None,
    rm_endpoints: str | None = None,
    token: str | None = None,
    env: Mapping[str, str] | None = None,
) -> ClientConfig:
    env = os.environ if env is None else env
    path = config_path(env)
    data = read_config_file(path)
    source = str(path) if data else "environment"

    def listed(key: str) -> tuple[str, ...]:
        value = data.get(key) or []
        if isinstance(value, str):
            return _split(value)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{key} in {path} must be a list of host:port strings")
        return tuple(value)

    scheduler = _split(endpoints) or _split(env.get("SHOAL_ENDPOINTS")) or listed("scheduler")
    rm = _split(rm_endpoints) or _split(env.get("SHOAL_RM_ENDPOINTS")) or listed("resource_manager")
    tok = token or env.get("SHOAL_TOKEN") or data.get("token")
    if not tok and data.get("token_file"):
        try:
            tok = Path(str(data["token_file"])).expanduser().read_text().strip()
        except OSError as exc:
            raise ConfigError(f"token_file ({data['token_file']}) cannot be read") from exc
    if not scheduler:
        raise ConfigError(
            "no scheduler endpoint: pass --endpoint, set SHOAL_ENDPOINTS, or start a local "
            "cluster with `shoal cluster up`"
        )
    tls = {
        name: env.get(f"SHOAL_{name.upper()}") or data.get(name)
        for name in ("tls_ca", "tls_cert", "tls_key")
    }
    if bool(tls["tls_cert"]) != bool(tls["tls_key"]):
        raise ConfigError(
            f"tls_cert ({tls['tls_cert']}) and tls_key ({tls['tls_key']}) must be set together"
        )
    return ClientConfig(
        scheduler=scheduler,
        resource_manager=rm,
        token=str(tok) if tok else None,
        tls_ca=str(tls["tls_ca"]) if tls["tls_ca"] else None,
        source=source,
        tls_cert=str(tls["tls_cert"]) if tls["tls_cert"] else None,
        tls_key=str(tls["tls_key"]) if tls["tls_key"] else None,
    )
