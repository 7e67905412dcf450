"""A job's numbers: ``jobs metrics``, ``jobs chart`` and ``jobs tensorboard``."""

from __future__ import annotations

import asyncio
import json
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from shoal.cli.common import (
    FINAL_STATES,
    Output,
    console,
    err_console,
    job_ref,
    jobs_app,
    run,
    state,
)
from shoal.client import AsyncClient


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
    job_ids = [job_ref(j) for j in job_ids or []]
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
    job_id = job_ref(job_id)
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
    job_id = job_ref(job_id)
    from shoal.client.tensorboard import EventWriter

    async def body(client: AsyncClient) -> tuple[Path, int]:
        await client.get_job(job_id)  # NOT_FOUND before anything is written
        writer = EventWriter(logdir, job_id)
        try:
            while True:
                job = await client.get_job(job_id)
                done = job.state in FINAL_STATES
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
