"""Where the client finds the cluster and its credentials.

In order of precedence:

1. explicit arguments (``Client(endpoints=[...], token=...)``, CLI flags);
2. environment: ``SHOAL_ENDPOINTS`` (comma-separated scheduler host:port list),
   ``SHOAL_RM_ENDPOINTS`` (resource-manager list, for ``shoal hosts``), ``SHOAL_TOKEN``,
   ``SHOAL_TLS_CA``, ``SHOAL_TLS_CERT``, ``SHOAL_TLS_KEY``;
3. a config file: ``SHOAL_CONFIG``; else the context ``SHOAL_CONTEXT`` names; else
   ``.shoal/cluster.json`` in the current directory (a local cluster started here); else the
   current context; else ``~/.config/shoal/config.json``.

Contexts (kubectl's): ``~/.config/shoal/contexts.json`` (``$XDG_CONFIG_HOME/shoal/`` when set)
maps a name to a config file, ``{"current": "local", "contexts": {"local": {"config":
"/abs/.shoal/cluster.json"}}}``. ``shoal cluster up`` registers its cluster there and makes it
current, so the CLI finds it from any directory; ``shoal config get-contexts | use-context``
switch. The embedded local cluster writes ``.shoal/cluster.json`` in its state directory,
with an ``"admin_token"`` too: whoever started it is its admin from the CLI (commands that
need the admin role, such as ``shoal hosts drain``, use that token).

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
from typing import Any

from shoal.contract import environment

DEFAULT_CONFIG = Path("~/.config/shoal/config.json")
LOCAL_CLUSTER_FILE = Path(".shoal/cluster.json")
CONTEXTS_FILE = "contexts.json"


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
    # How to get the admin role when a call is refused for lack of it (words for the user).
    admin_hint: str = ""


def user_config_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    base = env.get("XDG_CONFIG_HOME") or str(Path("~/.config").expanduser())
    return Path(base) / "shoal"


def read_contexts(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The contexts file: ``{"current": name, "contexts": {name: {"config": path}}}``."""
    path = user_config_dir(env) / CONTEXTS_FILE
    try:
        data = json.loads(path.read_text())
    except OSError:
        return {"current": "", "contexts": {}}
    except json.JSONDecodeError as exc:
        raise ConfigError(f"contexts file {path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("contexts", {}), dict):
        raise ConfigError(f"contexts file {path} must hold {{'current': ..., 'contexts': {{}}}}")
    data.setdefault("contexts", {})
    data.setdefault("current", "")
    return data


def write_contexts(data: dict[str, Any], env: Mapping[str, str] | None = None) -> Path:
    directory = user_config_dir(env)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / CONTEXTS_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return path


def set_context(
    name: str, config_file: Path, *, make_current: bool = True, env: Mapping[str, str] | None = None
) -> Path:
    """Register (or replace) context ``name`` pointing at ``config_file``."""
    if not name or any(c.isspace() for c in name):
        raise ConfigError(f"context name ({name!r}) must be a non-empty word")
    data = read_contexts(env)
    data["contexts"][name] = {"config": str(config_file.resolve())}
    if make_current:
        data["current"] = name
    return write_contexts(data, env)


def use_context(name: str, env: Mapping[str, str] | None = None) -> Path:
    data = read_contexts(env)
    if name not in data["contexts"]:
        known = ", ".join(sorted(data["contexts"])) or "none"
        raise ConfigError(f"context ({name!r}) is not known (contexts: {known})")
    data["current"] = name
    return write_contexts(data, env)


def remove_contexts_for(config_file: Path, env: Mapping[str, str] | None = None) -> list[str]:
    """Forget the contexts pointing at ``config_file`` (a local cluster that went down)."""
    data = read_contexts(env)
    target = str(config_file.resolve())
    gone = [n for n, c in data["contexts"].items() if c.get("config") == target]
    for name in gone:
        del data["contexts"][name]
        if data["current"] == name:
            data["current"] = ""
    if gone:
        write_contexts(data, env)
    return gone


def _context_file(name: str, env: Mapping[str, str]) -> Path:
    data = read_contexts(env)
    entry = data["contexts"].get(name)
    if not isinstance(entry, dict) or not entry.get("config"):
        known = ", ".join(sorted(data["contexts"])) or "none"
        raise ConfigError(f"context ({name!r}) is not known (contexts: {known})")
    return Path(str(entry["config"])).expanduser()


def _split(value: str | None) -> tuple[str, ...]:
    return tuple(v.strip() for v in (value or "").split(",") if v.strip())


def config_path(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get("SHOAL_CONFIG"):
        return Path(env["SHOAL_CONFIG"]).expanduser()
    if env.get("SHOAL_CONTEXT"):
        return _context_file(env["SHOAL_CONTEXT"], env)
    if LOCAL_CLUSTER_FILE.is_file():
        return LOCAL_CLUSTER_FILE
    current = read_contexts(env)["current"]
    if current:
        return _context_file(str(current), env)
    return user_config_dir(env) / "config.json"


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
    admin: bool = False,
) -> ClientConfig:
    """The client configuration. ``admin``: the caller needs the admin role, so the config
    file's ``admin_token`` is used unless a token was given explicitly (flag, SHOAL_TOKEN)."""
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
    explicit = token or env.get(environment.TOKEN)
    tok = explicit or (admin and data.get("admin_token")) or data.get("token")
    if data.get("admin_token"):
        hint = f'the admin token is "admin_token" in {path}; `shoal hosts` commands use it'
    elif data.get("state_dir"):
        hint = f"the admin token is in {data['state_dir']}/tokens: pass it with --token"
    else:
        hint = "ask an admin, or pass an admin token with --token or SHOAL_TOKEN"
    if not tok and data.get("token_file"):
        try:
            tok = Path(str(data["token_file"])).expanduser().read_text().strip()
        except OSError as exc:
            raise ConfigError(f"token_file ({data['token_file']}) cannot be read") from exc
    if not scheduler:
        missing = f" ({path} does not exist)" if not path.is_file() else ""
        raise ConfigError(
            f"no scheduler endpoint{missing}: pass --endpoint, set SHOAL_ENDPOINTS, pick a "
            "context (`shoal config get-contexts`), or start a local cluster with "
            "`shoal cluster up`"
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
        admin_hint=hint,
    )
