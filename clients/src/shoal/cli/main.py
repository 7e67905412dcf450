"""The ``shoal`` command: submit and manage jobs, look at hosts, run a local cluster.

Errors are one readable line on stderr and exit code 1 (2 for usage errors), never a traceback.
``-o json|yaml|wide|name`` (before or after the subcommand) prints for scripts; JSON numbers
are numbers. ``watch`` and ``submit --wait`` exit with the job's outcome: 0 COMPLETED,
1 FAILED, 3 CANCELLED (the reason on stderr).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import sys
import time
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from rich.table import Table
from typer.core import TyperGroup

from shoal.cli import simulate
from shoal.cli.output import (
    age,
    hoist_output_option,
    iso_time,
    plain_table,
    print_table,
    timestamp_seconds,
    to_data,
)
from shoal.client import AsyncClient, ConfigError, ShoalClientError, load_config
from shoal.client.packing import pack
from shoal.v1 import job_pb2

T = TypeVar("T")
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


class SyncModeOption(StrEnum):
    auto = "auto"
    parameter_server = "parameter-server"
    collective = "collective"


SYNC_MODES = {
    SyncModeOption.auto: job_pb2.SYNC_MODE_AUTO,
    SyncModeOption.parameter_server: job_pb2.SYNC_MODE_PARAMETER_SERVER,
    SyncModeOption.collective: job_pb2.SYNC_MODE_COLLECTIVE,
}


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


def jobs_table(jobs: list[job_pb2.Job], *, wide: bool = False) -> Table:
    columns = ["JOB", "NAME", "STATE", "PRIO", "WORKERS", "EPOCH", "ITER", "LOSS", "AGE"]
    if wide:
        columns += ["OWNER", "SYNC", "SAMPLES/S", "CREATED", "REASON"]
    table = plain_table(*columns)
    for j in jobs:
        p = j.progress
        row = [
            j.job_id,
            j.spec.name,
            state_name(j.state),
            str(j.spec.priority),
            f"{j.allocated_workers}/{j.spec.max_workers}",
            f"{p.epoch + (1 if p.iterations_per_epoch else 0)}/{j.spec.epochs}",
            str(p.completed_iterations),
            f"{p.last_loss:.4f}" if p.completed_iterations else "-",
            age(timestamp_seconds(j.create_time)),
        ]
        if wide:
            row += [
                j.owner,
                job_pb2.SyncMode.Name(j.effective_sync_mode or j.spec.sync_mode)
                .removeprefix("SYNC_MODE_")
                .lower(),
                f"{p.samples_per_second:.0f}",
                iso_time(timestamp_seconds(j.create_time)) or "-",
                j.state_reason or "-",
            ]
        table.add_row(*row)
    return table


@app.command()
def submit(
    model_dir: Annotated[Path, typer.Argument(help="Directory with the training script.")],
    entry_point: Annotated[
        str, typer.Option("--entry", help="Script inside the directory.")
    ] = "train.py",
    name: Annotated[str | None, typer.Option(help="Job name (default: directory name).")] = None,
    max_workers: Annotated[int, typer.Option(help="Most GPUs (learners) the job may use.")] = 1,
    min_workers: Annotated[int, typer.Option(help="Fewest learners the job runs with.")] = 1,
    priority: Annotated[int, typer.Option(help="Priority (1..1000000).")] = 5000,
    epochs: Annotated[int, typer.Option(help="Number of epochs.")] = 1,
    batch_size: Annotated[int, typer.Option(help="Global batch size.")] = 64,
    sync_mode: Annotated[
        SyncModeOption, typer.Option(help="How gradients are combined.")
    ] = SyncModeOption.auto,
    dataset: Annotated[list[str] | None, typer.Option(help="Dataset URI (repeatable).")] = None,
    checkpoint_every: Annotated[
        int, typer.Option(help="Checkpoint every N epochs (0: at the end).")
    ] = 1,
    seed: Annotated[int, typer.Option(help="Seed of the data order.")] = 0,
    arg: Annotated[
        list[str] | None, typer.Option(help="Argument for the script (repeatable).")
    ] = None,
    wait: Annotated[
        bool,
        typer.Option(
            "--wait",
            help="Show progress until the job ends; exit 0 completed, 1 failed, 3 cancelled.",
        ),
    ] = False,
    follow: Annotated[
        bool, typer.Option("--follow", help="Like --wait, and print the job's logs too.")
    ] = False,
) -> None:
    """Pack MODEL_DIR, upload it and submit a job that runs ENTRY in it."""
    if not model_dir.is_dir():
        err_console.print(
            f"[red]error:[/red] model directory ({str(model_dir)!r}) is not a directory"
        )
        raise typer.Exit(1)
    if not (model_dir / entry_point).is_file():
        err_console.print(
            f"[red]error:[/red] entry point ({entry_point!r}) is not a file in {model_dir}"
        )
        raise typer.Exit(1)

    quiet = state.output is not Output.table and state.output is not Output.wide
    bars = not quiet and err_console.is_terminal

    async def body(client: AsyncClient) -> job_pb2.Job:
        with err_console.status(f"packing {model_dir}...") if bars else contextlib.nullcontext():
            packed = await asyncio.to_thread(pack, model_dir)
        data = packed.data
        if not quiet:
            ignored = f", {packed.ignored} ignored" if packed.ignored else ""
            err_console.print(
                f"packed {model_dir}: {packed.files} file{'' if packed.files == 1 else 's'}, "
                f"{_size(packed.file_bytes)} "
                f"({_size(len(data))} compressed{ignored}; .gitignore and .shoalignore apply)",
                highlight=False,
            )
        with Progress(
            TextColumn("uploading {task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            console=err_console,
            transient=True,
            disable=not bars,
        ) as bar:
            task = bar.add_task(model_dir.name, total=len(data))
            artifact = await client.upload_artifact(
                data,
                name=model_dir.name,
                progress=lambda done, total: bar.update(task, completed=done),
            )
        spec = job_pb2.JobSpec(
            name=name or model_dir.resolve().name,
            entry_point=entry_point,
            artifact_id=artifact,
            args=arg or [],
            dataset_uris=dataset or [],
            batch_size=batch_size,
            epochs=epochs,
            min_workers=min_workers,
            max_workers=max_workers,
            priority=priority,
            sync_mode=SYNC_MODES[sync_mode],
            checkpoint_every=checkpoint_every,
            seed=seed,
        )
        return await client.submit_job(spec)

    job = run(body)
    emit(
        job,
        lambda: console.print(
            f"submitted [bold]{job.job_id}[/bold] ({job.spec.name}), {state_name(job.state)}",
            highlight=False,
        ),
    )
    if wait or follow:
        finish(job.job_id, run(lambda c: follow_job(c, job.job_id, logs=follow)))


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


@jobs_app.command("list")
def jobs_list(
    state_filter: Annotated[
        list[str] | None, typer.Option("--state", help="Only jobs in this state.")
    ] = None,
) -> None:
    """List your jobs (all jobs for admins), newest first."""
    states = []
    for s in state_filter or []:
        try:
            states.append(job_pb2.JobState.Value(f"JOB_STATE_{s.upper()}"))
        except ValueError:
            err_console.print(
                f"[red]error:[/red] state ({s!r}) must be one of queued, running, "
                "recovering, cancelling, completed, failed, cancelled"
            )
            raise typer.Exit(2) from None

    async def body(client: AsyncClient) -> list[job_pb2.Job]:
        return [j async for j in client.list_jobs(states=states)]

    jobs = run(body)

    def render() -> None:
        print_table(console, jobs_table(jobs))
        for j in jobs:  # what a job that is not training does about it
            if j.state == job_pb2.JOB_STATE_RECOVERING:
                console.print(f"{j.job_id} recovering: {j.state_reason}", highlight=False)

    emit(jobs, render, wide=lambda: print_table(console, jobs_table(jobs, wide=True)))


@jobs_app.command("get")
def jobs_get(job_id: str) -> None:
    """Show one job."""
    job = run(lambda c: c.get_job(job_id))

    def render(wide: bool = False) -> None:
        print_table(console, jobs_table([job], wide=wide))
        if job.state_reason:
            console.print(f"reason: {job.state_reason}", highlight=False, soft_wrap=True)
        for line in simulate.throughput_lines(job):  # the scheduler's throughput model
            console.print(line, highlight=False, soft_wrap=True)

    emit(job, render, wide=lambda: render(True))


FINAL_STATES = {job_pb2.JOB_STATE_COMPLETED, job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_CANCELLED}


def _status_line(job: job_pb2.Job) -> str:
    p = job.progress
    if job.state == job_pb2.JOB_STATE_RECOVERING:  # not training: say why and what is done
        return f"{state_name(job.state)}: {job.state_reason} | learners {job.allocated_workers}"
    return (
        f"{state_name(job.state)} | epoch {p.epoch + 1}/{job.spec.epochs} "
        f"iter {p.completed_iterations} | "
        f"loss {f'{p.last_loss:.4f}' if p.completed_iterations else '-'} | "
        f"learners {job.allocated_workers} | {p.samples_per_second:.0f} samples/s"
    )


async def follow_job(client: AsyncClient, job_id: str, *, logs: bool = False) -> job_pb2.Job | None:
    """Stream a job's progress until it ends (and its logs with ``logs``); the last state.
    A terminal gets a live bar; a pipe or file gets a line per change (at most one every
    5 s while the state stays), flushed at once; ``-o json`` a JSON event per line."""
    last: job_pb2.Job | None = None
    log_task = None
    if logs:
        log_task = asyncio.create_task(_print_logs(client, job_id, follow=True))
    try:
        if state.output in (Output.json, Output.yaml):
            async for event in client.watch_job(job_id):
                print(json.dumps(to_data(event)), flush=True)
                last = event.job
        elif console.is_terminal and not logs:
            with Progress(
                TextColumn("[bold]{task.fields[job]}[/bold]"),
                BarColumn(),
                TextColumn("{task.fields[status]}"),
                console=console,
            ) as bar:
                task = bar.add_task("", total=None, job=job_id, status="connecting")
                async for event in client.watch_job(job_id):
                    last = event.job
                    p = last.progress
                    total = (p.iterations_per_epoch * last.spec.epochs) or None
                    bar.update(
                        task,
                        total=total,
                        completed=p.completed_iterations,
                        status=_status_line(last),
                    )
        else:
            printed, printed_at, printed_state = "", 0.0, None
            async for event in client.watch_job(job_id):
                last = event.job
                line = _status_line(last)
                now = time.monotonic()
                if line != printed and (last.state != printed_state or now - printed_at >= 5.0):
                    stamp = time.strftime("%H:%M:%S")
                    print(f"{stamp} {job_id} {line}", flush=True)
                    printed, printed_at, printed_state = line, now, last.state
    finally:
        if log_task is not None:
            if last is not None and last.state in FINAL_STATES:
                # Let the last lines arrive, then stop.
                with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(asyncio.shield(log_task), timeout=3.0)
            log_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, ShoalClientError):
                await log_task
    return last


def finish(job_id: str, last: job_pb2.Job | None) -> None:
    """Say how the job ended and exit with it: 0 completed, 1 failed, 3 cancelled."""
    if last is None:
        return
    if state.output is Output.table or state.output is Output.wide:
        print(f"{job_id}: {state_name(last.state)}", flush=True)
    if last.state == job_pb2.JOB_STATE_FAILED:
        err_console.print(f"[red]{job_id} failed:[/red] {last.state_reason}", highlight=False)
        raise typer.Exit(EXIT_FAILED)
    if last.state == job_pb2.JOB_STATE_CANCELLED:
        err_console.print(
            f"{job_id} cancelled{': ' + last.state_reason if last.state_reason else ''}",
            highlight=False,
        )
        raise typer.Exit(EXIT_CANCELLED)


@jobs_app.command("watch")
def jobs_watch(
    job_id: str,
    logs: Annotated[bool, typer.Option("--logs", help="Print the job's logs too.")] = False,
) -> None:
    """Follow a job live until it ends; exit 0 if it completed, 1 if it failed (the reason on
    stderr), 3 if it was cancelled."""
    finish(job_id, run(lambda c: follow_job(c, job_id, logs=logs)))


def parse_since(text: str) -> float:
    """``30s``, ``5m``, ``2h``, ``1d`` (or plain seconds) -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    value = text.strip().lower()
    try:
        if value and value[-1] in units:
            seconds = float(value[:-1]) * units[value[-1]]
        else:
            seconds = float(value)
    except ValueError:
        seconds = -1
    if not seconds > 0:
        raise typer.BadParameter(f"--since ({text!r}) must be a duration such as 30s, 5m, 2h, 1d")
    return seconds


_WORK_DIR = re.compile(r'File "(?:[^"]*/work/)?([^"]*)"')


class TracebackFolder:
    """Prints a Python traceback the first time it is seen; the same traceback again (from
    another learner or another attempt) becomes one line with a count."""

    def __init__(self, emit_line: Callable[[str, str], None]) -> None:
        self.emit_line = emit_line
        self.open: dict[str, list[tuple[str, str]]] = {}  # learner -> (prefix, text) of a block
        self.seen: dict[str, int] = {}

    def feed(self, learner: str, prefix: str, text: str) -> None:
        block = self.open.get(learner)
        if block is None:
            if text.startswith("Traceback (most recent call last):"):
                self.open[learner] = [(prefix, text)]
            else:
                self.emit_line(prefix, text)
            return
        block.append((prefix, text))
        if not text or text.startswith((" ", "\t", "Traceback ")):
            return
        if text.startswith(("During handling", "The above exception")):
            return
        self._close(learner)

    def _close(self, learner: str) -> None:
        block = self.open.pop(learner)
        # Each learner runs in its own directory: compare the frames without it.
        key = "\n".join(_WORK_DIR.sub(r'File "\1"', t) for _, t in block)
        count = self.seen.get(key, 0) + 1
        self.seen[key] = count
        if count == 1:
            for prefix, text in block:
                self.emit_line(prefix, text)
        else:
            prefix, last = block[-1]
            self.emit_line(prefix, f"(the same traceback again, {count} times so far) {last}")

    def flush(self) -> None:
        for learner in list(self.open):
            for prefix, text in self.open.pop(learner):
                self.emit_line(prefix, text)


async def _print_logs(
    client: AsyncClient,
    job_id: str,
    *,
    follow: bool,
    learner: str = "",
    tail: int = 0,
    since: float = 0.0,
    grep: str = "",
) -> None:
    pattern = re.compile(grep) if grep else None
    cutoff = time.time() - since if since else 0.0

    def out(prefix: str, text: str) -> None:
        print(f"{prefix}{text}", flush=True)

    folder = TracebackFolder(out)
    try:
        async for line in client.stream_logs(
            job_id, follow=follow, learner_id=learner, tail_lines=tail
        ):
            written = timestamp_seconds(line.time)
            if cutoff and written and written < cutoff:
                continue
            if pattern is not None and not pattern.search(line.text):
                continue
            if state.output in (Output.json, Output.yaml):
                print(json.dumps(to_data(line)), flush=True)
                continue
            stamp = iso_time(written)[11:23] if written else "--:--:--.---"
            where = f"{line.learner_id} {line.host_id}" if line.host_id else line.learner_id
            prefix = f"{stamp} [{where}] "
            if pattern is not None:
                out(prefix, line.text)  # a filtered view keeps every matching line
            else:
                folder.feed(line.learner_id, prefix, line.text)
    finally:
        folder.flush()


@jobs_app.command("logs")
def jobs_logs(
    job_id: str,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new lines.")
    ] = False,
    learner: Annotated[str, typer.Option(help="Only this learner.")] = "",
    tail: Annotated[int, typer.Option(help="Only the last N lines before following.")] = 0,
    since: Annotated[
        str | None, typer.Option(help="Only lines written in the last 30s / 5m / 2h / 1d.")
    ] = None,
    grep: Annotated[
        str | None, typer.Option(help="Only lines matching this regular expression.")
    ] = None,
) -> None:
    """Print the job's learners' logs merged by the time each line was written (UTC time,
    learner id, text). A traceback repeated by several learners or attempts is printed once,
    then counted."""
    if grep:
        try:
            re.compile(grep)
        except re.error as exc:
            raise typer.BadParameter(
                f"--grep ({grep!r}) is not a regular expression: {exc}"
            ) from None
    seconds = parse_since(since) if since else 0.0
    run(
        lambda c: _print_logs(
            c, job_id, follow=follow, learner=learner, tail=tail, since=seconds, grep=grep or ""
        )
    )


@jobs_app.command("priority")
def jobs_priority(job_id: str, priority: int) -> None:
    """Change a job's priority; shares follow at the next iteration boundaries."""
    job = run(lambda c: c.update_job(job_id, priority=priority))
    emit(job, lambda: console.print(f"{job_id}: priority {job.spec.priority}"))


@jobs_app.command("scale")
def jobs_scale(job_id: str, max_workers: int) -> None:
    """Change a job's max workers."""
    job = run(lambda c: c.update_job(job_id, max_workers=max_workers))
    emit(job, lambda: console.print(f"{job_id}: max workers {job.spec.max_workers}"))


@jobs_app.command("cancel")
def jobs_cancel(job_id: str) -> None:
    """Cancel a job: its learners stop and its devices are freed."""
    job = run(lambda c: c.cancel_job(job_id))
    emit(job, lambda: console.print(f"{job_id}: {state_name(job.state)}"))


@jobs_app.command("download")
def jobs_download(
    job_id: str,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out", help="Destination file (a directory with --checkpoint; default: JOB-NAME/)."
        ),
    ] = None,
    checkpoint: Annotated[
        str | None,
        typer.Option(
            "--checkpoint",
            help="Download this checkpoint's files instead: its iteration (e.g. 46), its name "
            "(iter-46) or 'latest' (see `shoal jobs checkpoints`).",
        ),
    ] = None,
) -> None:
    """Download a job's final model (one safetensors file), or one of its checkpoints."""
    quiet = state.output is not Output.table and state.output is not Output.wide
    bars = not quiet and err_console.is_terminal
    if checkpoint is not None:
        _download_checkpoint(job_id, checkpoint, out, bars)
        return
    dest = out or Path(f"{job_id}.safetensors")

    async def body(client: AsyncClient) -> int:
        with Progress(
            TextColumn(f"downloading {dest}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            console=err_console,
            transient=True,
            disable=not bars,
        ) as bar:
            task = bar.add_task("", total=None)
            return await client.download_model(
                job_id,
                dest,
                progress=lambda done, total: bar.update(task, completed=done, total=total or None),
            )

    size = run(body)
    emit(
        {"job_id": job_id, "path": str(dest), "size_bytes": size},
        lambda: console.print(f"wrote {dest} ({size} bytes)", highlight=False),
    )


def _download_checkpoint(job_id: str, wanted: str, out: Path | None, bars: bool) -> None:
    async def body(client: AsyncClient) -> tuple[Any, Path, int]:
        checkpoints = await client.list_checkpoints(job_id)
        chosen = None
        for c in checkpoints:
            if (
                wanted in (c.name, str(c.iteration))
                or (wanted == "latest" and c.latest)
                or (wanted.isdigit() and c.name == f"iter-{wanted}")
            ):
                chosen = c
        if chosen is None:
            names = ", ".join(c.name for c in checkpoints) or "none"
            raise ShoalClientError(
                "NOT_FOUND", f"checkpoint ({wanted!r}) is not one of {job_id}'s ({names})"
            )
        dest = out or Path(f"{job_id}-{chosen.name}")
        total = 0
        with Progress(
            TextColumn("downloading {task.description}"),
            BarColumn(),
            DownloadColumn(),
            console=err_console,
            transient=True,
            disable=not bars,
        ) as bar:
            task = bar.add_task(chosen.name, total=chosen.size_bytes or None)
            for f in chosen.files:
                if f.name in ("", ".", "..") or Path(f.name).name != f.name:
                    raise ShoalClientError(
                        "DATA_LOSS", f"checkpoint file name ({f.name!r}) is not a plain name"
                    )
                total += await client.download_checkpoint_file(
                    job_id, chosen.name, f.name, dest / f.name
                )
                bar.update(task, completed=total)
        return chosen, dest, total

    chosen, dest, total = run(body)
    emit(
        {
            "job_id": job_id,
            "checkpoint": chosen.name,
            "iteration": chosen.iteration,
            "path": str(dest),
            "files": [f.name for f in chosen.files],
            "size_bytes": total,
        },
        lambda: console.print(
            f"wrote {chosen.name} of {job_id} to {dest}/ ({len(chosen.files)} files, "
            f"{total} bytes)",
            highlight=False,
        ),
    )


@jobs_app.command("chart")
def jobs_chart(
    job_ids: Annotated[
        list[str] | None, typer.Argument(help="Jobs (default: all visible).")
    ] = None,
    out: Annotated[Path, typer.Option("--out", help="Allocation chart PNG.")] = Path(
        "allocation.png"
    ),
    loss_out: Annotated[Path, typer.Option("--loss-out", help="Loss curves PNG.")] = Path(
        "loss.png"
    ),
) -> None:
    """Draw GPUs per job over time, and the jobs' loss curves, as PNG files."""
    from shoal.client import charts

    async def body(client: AsyncClient) -> tuple[Path, Path]:
        events = []
        ids = list(job_ids or [])
        if ids:
            for job_id in ids:
                events.extend(await client.allocation_history(job_id))
        else:
            events = await client.allocation_history("")
            ids = sorted({e.job_id for e in events})
        curves = {}
        for job_id in ids:
            job = await client.get_job(job_id)
            metrics = await client.get_metrics(job_id)
            per_epoch = job.progress.iterations_per_epoch or 1
            curves[f"{job_id} ({job.spec.name})"] = charts.loss_points(
                metrics.iterations, per_epoch
            )
        return (
            charts.draw_allocation_chart(charts.allocation_series(events), out),
            charts.draw_loss_curves(curves, loss_out),
        )

    chart, loss = run(body)
    console.print(f"wrote {chart} and {loss}")


class Per(StrEnum):
    iteration = "iteration"
    epoch = "epoch"


@jobs_app.command("metrics")
def jobs_metrics(
    job_id: str,
    per: Annotated[
        Per, typer.Option(help="With --output csv: one row per iteration or per epoch.")
    ] = Per.iteration,
    tail: Annotated[int, typer.Option(help="Table: the last N iterations (0: all).")] = 20,
) -> None:
    """Print a job's metrics: per epoch (evaluation) and per iteration (loss, throughput and
    every other metric the job reports). `-o json` both; `-o csv --per iteration|epoch` one."""
    import csv
    import datetime as dt

    from shoal.client.metrics import epoch_rows, iteration_rows

    async def body(client: AsyncClient) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        job, metrics = await asyncio.gather(client.get_job(job_id), client.get_metrics(job_id))
        per_epoch = job.progress.iterations_per_epoch
        return iteration_rows(metrics.iterations, per_epoch), epoch_rows(
            metrics.epochs, metrics.iterations
        )

    iterations, epochs = run(body)

    def iso(t: float) -> str:
        return dt.datetime.fromtimestamp(t, dt.UTC).isoformat() if t else ""

    for row in [*iterations, *epochs]:
        row["time"] = iso(row["time"])
    if state.output is Output.json:
        print(json.dumps({"job_id": job_id, "iterations": iterations, "epochs": epochs}, indent=2))
        return
    if state.output is Output.csv:
        rows = iterations if per is Per.iteration else epochs
        columns: dict[str, None] = {}
        for row in rows:
            columns.update(dict.fromkeys(row))
        writer = csv.DictWriter(sys.stdout, fieldnames=list(columns), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        return

    def table(rows: list[dict[str, Any]], title: str, skip: tuple[str, ...] = ()) -> Table:
        names = [n for n in dict.fromkeys(k for r in rows for k in r) if n not in skip]
        out = Table(*[n.upper() for n in names], title=title, title_justify="left")
        for row in rows:
            out.add_row(
                *[
                    ""
                    if row.get(n) is None
                    else f"{row[n]:.4g}"
                    if isinstance(row[n], float)
                    else str(row[n])
                    for n in names
                ]
            )
        return out

    if epochs:
        console.print(table(epochs, "per epoch", skip=("time",)))
    shown = iterations[-tail:] if tail > 0 else iterations
    if shown:
        console.print(
            table(shown, f"per iteration (last {len(shown)} of {len(iterations)})", ("time",))
        )
    if not iterations and not epochs:
        console.print(f"{job_id}: no metrics yet")


@jobs_app.command("tensorboard")
def jobs_tensorboard(
    job_id: str,
    logdir: Annotated[
        Path, typer.Option("--logdir", help="TensorBoard log directory (the run is LOGDIR/JOB).")
    ],
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep adding new metrics until the job ends.")
    ] = False,
    interval: Annotated[float, typer.Option(help="Seconds between reads with --follow.")] = 5.0,
) -> None:
    """Write a job's metrics and rescale events as TensorBoard event files."""
    from shoal.client.tensorboard import EventWriter

    final = {job_pb2.JOB_STATE_COMPLETED, job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_CANCELLED}

    async def body(client: AsyncClient) -> tuple[Path, int]:
        await client.get_job(job_id)  # NOT_FOUND before anything is written
        writer = EventWriter(logdir, job_id)
        try:
            while True:
                job = await client.get_job(job_id)
                done = job.state in final
                metrics = await client.get_metrics(job_id, after_iteration=writer.iterations)
                writer.add_iterations(metrics.iterations, job.progress.iterations_per_epoch)
                writer.add_epochs(metrics.epochs)
                events = await client.allocation_history(job_id)
                writer.add_allocations(events, until=None if done else writer.last_time)
                writer.flush()
                if not follow or done:
                    return writer.path, writer.iterations
                await asyncio.sleep(interval)
        finally:
            writer.close()

    try:
        path, count = run(body)
    except RuntimeError as exc:  # tensorboardX missing
        err_console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None
    console.print(f"wrote {count} iterations of {job_id} to {path} (tensorboard --logdir {logdir})")


@jobs_app.command("checkpoints")
def jobs_checkpoints(job_id: str) -> None:
    """List a job's complete checkpoints and their files."""
    checkpoints = run(lambda c: c.list_checkpoints(job_id))

    def render() -> None:
        table = plain_table("CHECKPOINT", "ITERATION", "EPOCH", "AGE", "SIZE", "FILES")
        for c in checkpoints:
            table.add_row(
                c.name + (" (latest)" if c.latest else ""),
                str(c.iteration),
                str(c.epoch),
                age(timestamp_seconds(c.create_time)),
                _size(c.size_bytes),
                " ".join(f.name for f in c.files),
            )
        print_table(console, table)

    emit(checkpoints, render)


@hosts_app.command("list")
def hosts_list(
    include_lost: Annotated[bool, typer.Option(help="Show lost hosts too.")] = False,
) -> None:
    """List hosts, their devices and what runs on them."""
    hosts = run(lambda c: c.list_hosts(include_lost=include_lost))

    def render() -> None:
        from shoal.v1 import resources_pb2

        table = plain_table("HOST", "STATE", "CORDONED", "DEVICES", "ALLOCATED", "JOBS", "AGENT")
        for h in hosts:
            jobs = sorted({d.allocation.job_id for d in h.devices if d.allocation.job_id})
            table.add_row(
                h.host_id,
                resources_pb2.HostState.Name(h.state).removeprefix("HOST_STATE_").lower(),
                "draining" if h.draining else ("yes" if h.cordoned else "no"),
                str(len(h.devices)),
                str(sum(1 for d in h.devices if d.allocation.allocation_id)),
                ",".join(jobs) or "-",
                h.agent_address,
            )
        print_table(console, table)

    emit(hosts, render)


@hosts_app.command("cordon")
def hosts_cordon(
    host_id: str, undo: Annotated[bool, typer.Option("--undo", help="Uncordon.")] = False
) -> None:
    """Stop placing learners on a host (or allow it again with --undo)."""
    host = run(lambda c: c.cordon_host(host_id, cordon=not undo), admin=True)
    emit(host, lambda: console.print(f"{host_id}: {'cordoned' if host.cordoned else 'uncordoned'}"))


@hosts_app.command("drain")
def hosts_drain(host_id: str) -> None:
    """Cordon a host and move its learners elsewhere at their next boundaries."""
    host = run(lambda c: c.drain_host(host_id), admin=True)
    emit(host, lambda: console.print(f"{host_id}: draining"))


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


def _cluster_app() -> typer.Typer | None:
    try:
        from shoal.cluster.cli import cluster_app
    except ImportError:
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


if __name__ == "__main__":
    sys.exit(main())
