"""``shoal config get-contexts|use-context|current-context``: which cluster the CLI talks to."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from shoal.cli.common import config_app, console, emit, err_console
from shoal.cli.output import plain_table, print_table
from shoal.client import ConfigError


@config_app.command("get-contexts")
def config_get_contexts() -> None:
    """List the contexts (`shoal cluster up` registers one); * marks the current one."""
    from shoal.client.config import read_config_file, read_contexts

    try:
        data = read_contexts()
    except ConfigError as exc:
        err_console.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(1) from None
    current = os.environ.get("SHOAL_CONTEXT") or data["current"]
    rows = []
    for name, entry in sorted(data["contexts"].items()):
        path = Path(str(entry.get("config", "")))
        try:
            scheduler = ",".join(read_config_file(path).get("scheduler") or []) or "-"  # type: ignore[arg-type]
        except ConfigError:
            scheduler = "(invalid)"
        rows.append(
            {
                "name": name,
                "current": name == current,
                "config": str(path),
                "scheduler": scheduler if path.is_file() else "(file gone)",
            }
        )

    def render() -> None:
        table = plain_table("CURRENT", "NAME", "SCHEDULER", "CONFIG")
        for r in rows:
            table.add_row("*" if r["current"] else "", r["name"], r["scheduler"], r["config"])
        print_table(console, table)

    emit(rows, render)


@config_app.command("use-context")
def config_use_context(name: str) -> None:
    """Make NAME the current context (SHOAL_CONTEXT still overrides it)."""
    from shoal.client.config import use_context

    try:
        use_context(name)
    except ConfigError as exc:
        err_console.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(1) from None
    emit({"current": name}, lambda: console.print(f"current context: {name}", highlight=False))


@config_app.command("current-context")
def config_current_context() -> None:
    """Print the current context's name."""
    from shoal.client.config import read_contexts

    name = os.environ.get("SHOAL_CONTEXT") or read_contexts()["current"]
    if not name:
        err_console.print("[red]error:[/red] no current context (shoal config use-context NAME)")
        raise typer.Exit(1)
    emit({"current": name}, lambda: print(name))
