"""The ``shoal`` command: submit and manage jobs, look at hosts, run a local cluster.

Errors are one readable line on stderr and exit code 1 (2 for usage errors), never a traceback.
``--output json`` prints machine-readable JSON for scripts.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from google.protobuf.json_format import MessageToDict
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from rich.table import Table

from shoal.client import AsyncClient, ConfigError, ShoalClientError, load_config, pack_directory
from shoal.v1 import job_pb2

T = TypeVar("T")
console = Console()
err_console = Console(stderr=True, soft_wrap=True)  # errors stay on one line

app = typer.Typer(help="shoal: elastic distributed deep-learning training.", no_args_is_help=True)
jobs_app = typer.Typer(help="Inspect and manage jobs.", no_args_is_help=True)
hosts_app = typer.Typer(help="Inspect and manage hosts.", no_args_is_help=True)
app.add_typer(jobs_app, name="jobs")
app.add_typer(hosts_app, name="hosts")


class Output(StrEnum):
    table = "table"
    json = "json"
    csv = "csv"  # `shoal jobs metrics` only


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


@app.callback()
def _global(
    endpoint: Annotated[str | None, typer.Option(help="Scheduler host:port (comma list).")] = None,
    rm_endpoint: Annotated[
        str | None, typer.Option(help="Resource-manager host:port list.")
    ] = None,
    token: Annotated[str | None, typer.Option(help="Bearer token (default: SHOAL_TOKEN).")] = None,
    output: Annotated[Output, typer.Option("--output", "-o", help="Output format.")] = Output.table,
) -> None:
    state.endpoint, state.rm_endpoint, state.token, state.output = (
        endpoint,
        rm_endpoint,
        token,
        output,
    )


def run(body: Callable[[AsyncClient], Any]) -> Any:
    """Run ``body(client)`` with a configured client; errors become one line and exit 1."""

    async def main() -> Any:
        config = load_config(
            endpoints=state.endpoint, rm_endpoints=state.rm_endpoint, token=state.token
        )
        async with AsyncClient(config) as client:
            return await body(client)

    try:
        return asyncio.run(main())
    except (ShoalClientError, ConfigError) as exc:
        err_console.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


def emit(message: Any, render: Callable[[], None]) -> None:
    if state.output is Output.csv:
        err_console.print("[red]error:[/red] --output csv is for `shoal jobs metrics` only")
        raise typer.Exit(2)
    if state.output is Output.json:
        if isinstance(message, list):
            data = [MessageToDict(m, preserving_proto_field_name=True) for m in message]
        else:
            data = MessageToDict(message, preserving_proto_field_name=True)
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        render()


def state_name(value: int) -> str:
    return job_pb2.JobState.Name(value).removeprefix("JOB_STATE_").lower()


def jobs_table(jobs: list[job_pb2.Job]) -> Table:
    table = Table("JOB", "NAME", "STATE", "PRIO", "WORKERS", "EPOCH", "ITER", "LOSS", "OWNER")
    for j in jobs:
        p = j.progress
        table.add_row(
            j.job_id,
            j.spec.name,
            state_name(j.state),
            str(j.spec.priority),
            f"{j.allocated_workers}/{j.spec.max_workers}",
            f"{p.epoch + (1 if p.iterations_per_epoch else 0)}/{j.spec.epochs}",
            str(p.completed_iterations),
            f"{p.last_loss:.4f}" if p.completed_iterations else "-",
            j.owner,
        )
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

    async def body(client: AsyncClient) -> job_pb2.Job:
        data = pack_directory(model_dir)
        with Progress(
            TextColumn("uploading {task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            console=err_console,
            transient=True,
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
            f"submitted [bold]{job.job_id}[/bold] ({job.spec.name}), {state_name(job.state)}"
        ),
    )


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
        console.print(jobs_table(jobs))
        for j in jobs:  # what a job that is not training does about it
            if j.state == job_pb2.JOB_STATE_RECOVERING:
                console.print(f"{j.job_id} recovering: {j.state_reason}", highlight=False)

    emit(jobs, render)


@jobs_app.command("get")
def jobs_get(job_id: str) -> None:
    """Show one job."""
    job = run(lambda c: c.get_job(job_id))

    def render() -> None:
        console.print(jobs_table([job]))
        if job.state_reason:
            console.print(f"reason: {job.state_reason}")

    emit(job, render)


@jobs_app.command("watch")
def jobs_watch(job_id: str) -> None:
    """Follow a job live: epoch, iteration, loss, learners, until it ends."""

    async def body(client: AsyncClient) -> job_pb2.Job | None:
        last: job_pb2.Job | None = None
        if state.output is Output.json:
            async for event in client.watch_job(job_id):
                print(
                    json.dumps(MessageToDict(event, preserving_proto_field_name=True)), flush=True
                )
                last = event.job
            return last
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
                status = (
                    f"{state_name(last.state)} | epoch {p.epoch + 1}/{last.spec.epochs} "
                    f"iter {p.completed_iterations} | loss {p.last_loss:.4f} | "
                    f"learners {last.allocated_workers} | {p.samples_per_second:.0f} samples/s"
                )
                if last.state == job_pb2.JOB_STATE_RECOVERING:
                    status = f"{state_name(last.state)}: {last.state_reason}"
                bar.update(task, total=total, completed=p.completed_iterations, status=status)
        return last

    last = run(body)
    if last is not None and state.output is Output.table:
        console.print(f"{job_id}: {state_name(last.state)} {last.state_reason}".rstrip())


@jobs_app.command("logs")
def jobs_logs(
    job_id: str,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new lines.")
    ] = False,
    learner: Annotated[str, typer.Option(help="Only this learner.")] = "",
    tail: Annotated[int, typer.Option(help="Only the last N lines before following.")] = 0,
) -> None:
    """Print the job's learners' logs, merged."""

    async def body(client: AsyncClient) -> None:
        async for line in client.stream_logs(
            job_id, follow=follow, learner_id=learner, tail_lines=tail
        ):
            if state.output is Output.json:
                print(json.dumps(MessageToDict(line, preserving_proto_field_name=True)), flush=True)
            else:
                print(f"[{line.learner_id}] {line.text}", flush=True)

    run(body)


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
    out: Annotated[Path | None, typer.Option("--out", help="Destination file.")] = None,
) -> None:
    """Download a job's final model (one safetensors file)."""
    dest = out or Path(f"{job_id}.safetensors")
    size = run(lambda c: c.download_model(job_id, dest))
    console.print(f"wrote {dest} ({size} bytes)")


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
        return iteration_rows(metrics.iterations, per_epoch), epoch_rows(metrics.epochs)

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
        table = Table("CHECKPOINT", "ITERATION", "EPOCH", "SIZE", "FILES")
        for c in checkpoints:
            table.add_row(
                c.name + (" (latest)" if c.latest else ""),
                str(c.iteration),
                str(c.epoch),
                f"{c.size_bytes / 2**20:.1f} MiB",
                " ".join(f.name for f in c.files),
            )
        console.print(table)

    emit(checkpoints, render)


@hosts_app.command("list")
def hosts_list(
    include_lost: Annotated[bool, typer.Option(help="Show lost hosts too.")] = False,
) -> None:
    """List hosts, their devices and what runs on them."""
    hosts = run(lambda c: c.list_hosts(include_lost=include_lost))

    def render() -> None:
        from shoal.v1 import resources_pb2

        table = Table("HOST", "STATE", "CORDONED", "DEVICES", "ALLOCATED", "JOBS", "AGENT")
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
        console.print(table)

    emit(hosts, render)


@hosts_app.command("cordon")
def hosts_cordon(
    host_id: str, undo: Annotated[bool, typer.Option("--undo", help="Uncordon.")] = False
) -> None:
    """Stop placing learners on a host (or allow it again with --undo)."""
    host = run(lambda c: c.cordon_host(host_id, cordon=not undo))
    emit(host, lambda: console.print(f"{host_id}: {'cordoned' if host.cordoned else 'uncordoned'}"))


@hosts_app.command("drain")
def hosts_drain(host_id: str) -> None:
    """Cordon a host and move its learners elsewhere at their next boundaries."""
    host = run(lambda c: c.drain_host(host_id))
    emit(host, lambda: console.print(f"{host_id}: draining"))


def _cluster_app() -> typer.Typer | None:
    try:
        from shoal.cluster.cli import cluster_app
    except ImportError:
        return None
    return cluster_app


_cluster = _cluster_app()
if _cluster is not None:
    app.add_typer(_cluster, name="cluster")


def main(argv: list[str] | None = None) -> int:
    try:
        app(args=argv, prog_name="shoal", standalone_mode=True)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
