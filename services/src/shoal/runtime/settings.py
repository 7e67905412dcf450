"""Declared configuration: each service lists its settings once (:class:`Setting`: the flag, the
environment variable, the default, what it means), and the parser and the documentation are
both generated from that list.

* :func:`add_settings` adds the flags to an argparse group, each defaulting to its variable
  (flags win over variables, variables over defaults).
* :func:`settings_markdown` renders the table of docs/configuration.md, which
  ``python tools/config_docs.py --write`` regenerates (a unit test fails when it is stale).

Parsing and validating the values stays with each service's frozen config dataclass
(``shoal.runtime.config``): errors name the field and the value.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Setting", "add_settings", "settings_markdown"]


@dataclass(frozen=True)
class Setting:
    """One setting of a service."""

    flag: str
    """The long flag (``--shard-index``)."""
    env: str | None
    """The environment variable that sets it when the flag is not given (None: none)."""
    default: str | Callable[[], str] | None
    """The default as text (parsed like a given value), computed when the parser is built if
    callable; None: unset."""
    help: str = ""
    aliases: tuple[str, ...] = ()
    dest: str | None = None
    switch: bool = False
    """A flag without a value (``store_true``); its variable turns it on unless empty, ``0`` or
    ``false``."""
    shown_default: str | None = None
    """The default as documented, when it is computed (``file://<cwd>/.shoal/storage``)."""
    repeated: bool = False
    """A flag given once per value (``--label A=1 --label B=2``); its variable holds the values
    comma-separated and they come first."""

    def documented_default(self) -> str:
        if self.shown_default is not None:
            return self.shown_default
        if self.switch:
            return "off"
        if self.repeated:
            return "none"
        if self.default is None or callable(self.default):
            return "unset"
        return self.default if self.default != "" else '""'


def add_settings(
    group: argparse._ActionsContainer, settings: Sequence[Setting], env: Mapping[str, str]
) -> None:
    """Add each setting's flag to ``group``, defaulting to its variable in ``env``."""
    for s in settings:
        names = (s.flag, *s.aliases)
        extra: dict[str, Any] = {"dest": s.dest} if s.dest else {}
        text = f"{s.help} (${s.env})" if s.help and s.env else (s.help or None)
        if s.switch:
            on = bool(s.env) and env.get(s.env or "", "") not in ("", "0", "false")
            group.add_argument(*names, action="store_true", default=on, help=text, **extra)
            continue
        if s.repeated:
            given = [x for x in env.get(s.env or "", "").split(",") if x] if s.env else []
            group.add_argument(*names, action="append", default=given, help=text, **extra)
            continue
        default = s.default() if callable(s.default) else s.default
        if s.env is not None:
            default = env.get(s.env, default)
        group.add_argument(*names, default=default, help=text, **extra)


def settings_markdown(settings: Sequence[Setting]) -> str:
    """A markdown table of ``settings``: flag, variable, default, meaning."""
    lines = ["| flag | variable | default | meaning |", "|---|---|---|---|"]
    for s in settings:
        flags = ", ".join(f"`{f}`" for f in (s.flag, *s.aliases))
        variable = f"`{s.env}`" if s.env else ""
        meaning = s.help.replace("|", "\\|")
        lines.append(f"| {flags} | {variable} | `{s.documented_default()}` | {meaning} |")
    return "\n".join(lines)
