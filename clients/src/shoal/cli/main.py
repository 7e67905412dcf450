"""The ``shoal`` command: submit and manage jobs, look at hosts, run a local cluster.

Errors are one readable line on stderr and exit code 1 (2 for usage errors), never a traceback.
``-o json|yaml|wide|name`` (before or after the subcommand) prints for scripts; JSON numbers
are numbers. ``watch`` and ``submit --wait`` exit with the job's outcome: 0 COMPLETED,
1 FAILED, 3 CANCELLED (the reason on stderr).

Where the commands are: ``shoal.cli.common`` holds ``app``, its groups (``jobs_app``,
``hosts_app``, ``config_app``), the global options and ``run``/``emit``. Each module named in
``COMMAND_MODULES`` registers its commands on them with ``@app.command()`` /
``@jobs_app.command(...)`` when imported, in that order (the order of ``--help``). A new
command: a function in one of these modules, or a new module ``shoal.cli.<name>`` added to
``COMMAND_MODULES``; a new group: ``app.add_typer(group, name=...)`` in its module. A module
that registers through a function instead (``simulate.register(app)``) is called below.
"""

from __future__ import annotations

import importlib
import sys

import typer

from shoal.cli import simulate
from shoal.cli.common import app

# The modules of shoal.cli that register commands (see above), in --help's order.
COMMAND_MODULES = ("jobs", "follow", "checkpoints", "metrics", "hosts", "contexts")
for _name in COMMAND_MODULES:
    importlib.import_module(f"shoal.cli.{_name}")


def _cluster_app() -> typer.Typer | None:
    try:
        from shoal.cluster.cli import cluster_app
    except ImportError:  # the services distribution is not installed
        return None
    return cluster_app


_cluster = _cluster_app()
if _cluster is not None:
    app.add_typer(_cluster, name="cluster")
simulate.register(app)  # `shoal simulate` (shoal/cli/simulate.py)


def main(argv: list[str] | None = None) -> int:
    try:
        app(args=argv, prog_name="shoal", standalone_mode=True)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


__all__ = ["COMMAND_MODULES", "app", "main"]

if __name__ == "__main__":
    sys.exit(main())
