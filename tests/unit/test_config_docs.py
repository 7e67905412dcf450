"""docs/configuration.md is generated from the services' declared settings and current; the
parsers built from those settings honour flag > variable > default (issue 15)."""

from __future__ import annotations

import importlib.util
import pathlib

from shoal.param_sync.main import SETTINGS as SHARD_SETTINGS, parse_config
from shoal.runtime.config import SERVER_SETTINGS
from shoal.scheduler.main import SETTINGS as SCHEDULER_SETTINGS

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("config_docs", ROOT / "tools" / "config_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_configuration_page_is_generated_from_the_declared_settings() -> None:
    fix = "run: python tools/config_docs.py --write"
    assert (ROOT / "docs/configuration.md").read_text() == _tool().page(), fix


def test_every_declared_setting_is_documented_once_with_its_variable() -> None:
    text = (ROOT / "docs/configuration.md").read_text()
    for settings in (SERVER_SETTINGS, SCHEDULER_SETTINGS, SHARD_SETTINGS):
        flags = [s.flag for s in settings]
        assert len(flags) == len(set(flags))
        for s in settings:
            assert f"`{s.flag}`" in text
            if s.env:
                assert f"`{s.env}`" in text and s.env.startswith("SHOAL_")


def test_a_flag_wins_over_its_variable_which_wins_over_the_default() -> None:
    auth = ["--insecure-no-auth"]
    assert parse_config(auth, env={}).registration_ttl_s == 5.0
    env = {"SHOAL_REGISTRATION_TTL_S": "7", "SHOAL_NO_REFLECTION": "1"}
    from_env = parse_config(auth, env=env)
    assert from_env.registration_ttl_s == 7.0 and from_env.server.reflection is False
    assert parse_config([*auth, "--registration-ttl", "9"], env=env).registration_ttl_s == 9.0
