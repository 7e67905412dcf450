"""What every command of the ``shoal`` CLI shares: the top-level ``app`` and its command groups,
the global options (``state``), ``run`` (a client call with errors as one line) and ``emit``
(print per ``-o``).

Commands live in the modules beside this one (jobs, follow, checkpoints, metrics, hosts,
contexts); each registers its commands on ``app`` or on one of its groups when imported, and
``shoal.cli.main`` imports them all.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from collections.abc import Callable
from enum import StrEnum
from typing import Annotated, Any

import typer
from rich.console import Console
from typer.core import TyperGroup

from shoal.cli.output import hoist_output_option, to_data
from shoal.client import AsyncClient, ConfigError, ShoalClientError, load_config
from shoal.v1 import job_pb2

console = Console()
err_console = Console(stderr=True, soft_wrap=True)  # errors stay on one line


class ShoalGroup(TyperGroup):
    """The top-level command: ``-o FORMAT`` is accepted anywhere (kubectl's habit)."""

    def main(self, args: Any = None, *a: Any, **kw: Any) -> Any:
        argv = sys.argv[1:] if args is None else list(args)
        return super().main(hoist_output_option(argv), *a, **kw)


app = typer.Typer(
    help="shoal: elastic distributed deep-learning training.",
    no_args_is_help=True,
    cls=ShoalGroup,
)
jobs_app = typer.Typer(help="Inspect and manage jobs.", no_args_is_help=True)
hosts_app = typer.Typer(help="Inspect and manage hosts.", no_args_is_help=True)
app.add_typer(jobs_app, name="jobs")
app.add_typer(hosts_app, name="hosts")
config_app = typer.Typer(
    help="Contexts: which cluster the CLI talks to (kubectl's config contexts).",
    no_args_is_help=True,
)
app.add_typer(config_app, name="config")


class Output(StrEnum):
    table = "table"
    wide = "wide"  # the table with every column
    json = "json"
    yaml = "yaml"
    name = "name"  # just the ids, one a line (kubectl's -o name)
    csv = "csv"  # `shoal jobs metrics` only


# Exit codes of `watch` and `submit --wait`: the job's outcome.
EXIT_FAILED = 1
EXIT_CANCELLED = 3


class State:
    endpoint: str | None = None
    rm_endpoint: str | None = None
    token: str | None = None
    output: Output = Output.table


state = State()


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            number = version("shoal-client")
        except PackageNotFoundError:
            number = "unknown"
        print(f"shoal {number}")
        raise typer.Exit(0)


@app.callback()
def _global(
    endpoint: Annotated[str | None, typer.Option(help="Scheduler host:port (comma list).")] = None,
    rm_endpoint: Annotated[
        str | None, typer.Option(help="Resource-manager host:port list.")
    ] = None,
    token: Annotated[str | None, typer.Option(help="Bearer token (default: SHOAL_TOKEN).")] = None,
    output: Annotated[
        Output,
        typer.Option(
            "--output", "-o", help="Output format (before or after the subcommand).", metavar="FMT"
        ),
    ] = Output.table,
    version: Annotated[
        bool,
        typer.Option(
            "--version", help="Print the version and exit.", is_eager=True, callback=_version
        ),
    ] = False,
) -> None:
    state.endpoint, state.rm_endpoint, state.token, state.output = (
        endpoint,
        rm_endpoint,
        token,
        output,
    )


def run(body: Callable[[AsyncClient], Any], *, admin: bool = False) -> Any:
    """Run ``body(client)`` with a configured client; errors become one line and exit 1.
    ``admin``: the call needs the admin role, so the context's ``admin_token`` (the local
    cluster's owner has one) is used when there is one."""
    hint = ""

    async def main() -> Any:
        nonlocal hint
        config = load_config(
            endpoints=state.endpoint,
            rm_endpoints=state.rm_endpoint,
            token=state.token,
            admin=admin,
        )
        hint = config.admin_hint
        async with AsyncClient(config) as client:
            return await body(client)

    try:
        return asyncio.run(main())
    except ShoalClientError as exc:
        extra = ""
        if exc.code == "PERMISSION_DENIED" and "needs role" in exc.message:
            extra = f" ({hint})" if hint else ""
        err_console.print(f"[red]error:[/red] {exc}{extra}", highlight=False)
        raise typer.Exit(1) from None
    except ConfigError as exc:
        err_console.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


def _ids(message: Any) -> list[str]:
    items = message if isinstance(message, list) else [message]
    names = []
    for m in items:
        for field in ("job_id", "host_id", "name", "artifact_id", "path"):
            value = getattr(m, field, None) if not isinstance(m, dict) else m.get(field)
            if value:
                names.append(str(value))
                break
    return names


def print_data(data: Any) -> None:
    """Print data (messages, lists, dicts) as JSON or YAML, per ``-o``."""
    data = to_data(data)
    if state.output is Output.yaml:
        try:
            import yaml
        except ImportError:
            err_console.print("[red]error:[/red] -o yaml needs PyYAML (pip install pyyaml)")
            raise typer.Exit(2) from None
        print(yaml.safe_dump(data, sort_keys=True), end="", flush=True)
    else:
        print(json.dumps(data, indent=2, sort_keys=True), flush=True)


def emit(
    message: Any, render: Callable[[], None], *, wide: Callable[[], None] | None = None
) -> None:
    if state.output is Output.csv:
        err_console.print("[red]error:[/red] --output csv is for `shoal jobs metrics` only")
        raise typer.Exit(2)
    if state.output in (Output.json, Output.yaml):
        print_data(message)
    elif state.output is Output.name:
        for name in _ids(message):
            print(name)
    elif state.output is Output.wide and wide is not None:
        wide()
    else:
        render()


def state_name(value: int) -> str:
    return job_pb2.JobState.Name(value).removeprefix("JOB_STATE_").lower()


FINAL_STATES = {job_pb2.JOB_STATE_COMPLETED, job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_CANCELLED}


def quiet() -> bool:
    """Whether ``-o`` asked for data rather than a table (no chatter, no progress bars)."""
    return state.output is not Output.table and state.output is not Output.wide


def human_size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


# A job id as the scheduler makes it: used as is, without asking the cluster.
_FULL_JOB_ID = re.compile(r"job-[0-9a-f]{12}")
_AMBIGUOUS_SHOWN = 10


async def resolve_job_id(client: AsyncClient, text: str) -> str:
    """The job id that ``text`` names: a whole id, or a unique prefix of one among the jobs
    the caller can see, with or without ``job-`` (docker's and git's habit: ``job-35e`` or
    ``35e``). An exact id wins over a prefix; none matching leaves ``text`` as it is (the
    server says it is not found); several matching is an error naming them."""
    if not text or _FULL_JOB_ID.fullmatch(text):
        return text
    ids = [j.job_id async for j in client.list_jobs()]
    if text in ids:
        return text
    matches = sorted({i for i in ids if i.startswith(text) or i.startswith(f"job-{text}")})
    if len(matches) == 1:
        return matches[0]
    if not matches:
        return text
    shown = ", ".join(matches[:_AMBIGUOUS_SHOWN])
    more = f" and {len(matches) - _AMBIGUOUS_SHOWN} more" if len(matches) > _AMBIGUOUS_SHOWN else ""
    raise ShoalClientError(
        "INVALID_ARGUMENT",
        f"job id prefix ({text!r}) is ambiguous: it matches {shown}{more}; give more characters",
    )


def job_ref(text: str) -> str:
    """:func:`resolve_job_id` for a command's JOB argument (errors are one line, exit 1)."""
    if _FULL_JOB_ID.fullmatch(text):
        return text
    return str(run(lambda c: resolve_job_id(c, text)))
