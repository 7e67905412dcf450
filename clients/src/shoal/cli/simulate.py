"""``shoal simulate``: replay a workload through the scheduler's policies, offline.

The replay runs the scheduler's own policy and placement code (``shoal.scheduler.tracesim``,
in the shoal-services distribution); nothing is contacted. See docs/scheduling.md.

Also here: the throughput lines ``shoal jobs get`` prints under a job (``throughput_lines``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from shoal.cli.output import plain_table, print_table
from shoal.v1 import job_pb2

__all__ = ["register", "throughput_lines"]

DEFAULT_POLICIES = "fifo,fairshare,priority,goodput,priority+las,goodput+las"


def throughput_lines(job: job_pb2.Job, *, limit: int = 8) -> list[str]:
    """What the scheduler's model predicts for ``job``, for ``shoal jobs get`` (empty before
    the scheduler observed the job)."""
    if not job.HasField("throughput") or not job.throughput.points:
        return []
    model = job.throughput
    points = list(model.points)
    keep = [p for p in points if p.observed]
    keep += [p for p in points if not p.observed and (p.world_size & (p.world_size - 1)) == 0]
    if points[-1] not in keep:
        keep.append(points[-1])
    shown = sorted({p.world_size: p for p in keep}.values(), key=lambda p: p.world_size)[:limit]
    cells = ", ".join(
        f"{p.world_size}: {p.samples_per_second:.4g}{'' if p.observed else '?'}" for p in shown
    )
    pause = "measured" if model.rescale_pause_measured else "prior"
    lines = [
        f"samples/s by learners (?: predicted): {cells}",
        f"model: iteration = {model.overhead_seconds:.3g} + {model.compute_seconds:.3g}/w "
        f"+ [w>1]({model.sync_seconds:.3g} + {model.sync_per_worker_seconds:.3g}(w-1)) s; "
        f"rescale pause {model.rescale_pause_seconds:.3g} s ({pause}); "
        f"attained {model.attained_device_seconds:.0f} device-s",
    ]
    split = [p for p in points if p.compute_seconds > 0][:limit]
    if split:  # what the learners measured of an iteration, per world size
        lines.append(
            "learners' compute/sync s per iteration: "
            + ", ".join(
                f"{p.world_size}: {p.compute_seconds:.3g}/{p.sync_seconds:.3g}" for p in split
            )
        )
    return lines


def simulate(
    trace: Annotated[Path, typer.Argument(help="Workload CSV (docs/scheduling.md).")],
    gpus: Annotated[int, typer.Option(help="Devices of the simulated cluster.")] = 16,
    gpus_per_host: Annotated[int, typer.Option(help="Devices per host.")] = 4,
    policies: Annotated[
        str,
        typer.Option(help="Comma list: fifo, fairshare, priority, goodput; +las: with classes."),
    ] = DEFAULT_POLICIES,
    interval: Annotated[float, typer.Option(help="Scheduling tick, seconds.")] = 60.0,
    hold_time: Annotated[float, typer.Option(help="Anti-thrash hold time, seconds.")] = 30.0,
    fair_fraction: Annotated[
        float, typer.Option(help="GOODPUT: least fraction of the PRIORITY share.")
    ] = 0.5,
    service_thresholds: Annotated[
        str, typer.Option(help="+las: attained-service thresholds, device-seconds, comma list.")
    ] = "3600,36000",
    rescale_horizon: Annotated[
        float,
        typer.Option(help="GOODPUT: resize only if the gain over this many s beats the pause."),
    ] = 0.0,
) -> None:
    """Replay a workload through each policy; print JCT and utilisation side by side."""
    from shoal.cli.common import Output, err_console, print_data, state

    try:
        from shoal.scheduler import tracesim
    except ImportError:
        err_console.print(
            "[red]error:[/red] shoal simulate runs the scheduler's policy code: install "
            "shoal-services (pip install shoal-services)"
        )
        raise typer.Exit(2) from None
    try:
        text = trace.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        err_console.print(f"[red]error:[/red] trace ({str(trace)!r}) cannot be read: {exc}")
        raise typer.Exit(2) from None
    try:
        thresholds = tuple(float(t) for t in service_thresholds.split(",") if t.strip())
    except ValueError:
        err_console.print(
            f"[red]error:[/red] service_thresholds ({service_thresholds!r}) must be numbers"
        )
        raise typer.Exit(2) from None
    try:
        jobs = tracesim.read_trace(text)
    except ValueError as exc:
        err_console.print(f"[red]error:[/red] trace {str(trace)!r}: {exc}")
        raise typer.Exit(2) from None
    try:
        runs = tracesim.parse_policies(policies, thresholds)
        results = [
            tracesim.replay(
                jobs,
                run,
                gpus=gpus,
                gpus_per_host=gpus_per_host,
                interval_s=interval,
                hold_time_s=hold_time,
                fair_fraction=fair_fraction,
                rescale_horizon_s=rescale_horizon,
            )
            for run in runs
        ]
    except ValueError as exc:
        err_console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    rows: list[dict[str, Any]] = [r.summary() for r in results]
    if state.output in (Output.json, Output.yaml):
        print_data({"trace": str(trace), "gpus": gpus, "results": rows})
        return
    console = Console()
    table = plain_table(
        "POLICY", "MEAN JCT", "P50 JCT", "P95 JCT", "MAKESPAN", "UTIL", "RESCALES", "WORST SLOWDOWN"
    )
    for row in rows:
        table.add_row(
            str(row["policy"]),
            f"{row['mean_jct_s']:.0f} s",
            f"{row['p50_jct_s']:.0f} s",
            f"{row['p95_jct_s']:.0f} s",
            f"{row['makespan_s']:.0f} s",
            f"{row['utilisation']:.0%}",
            str(row["rescales"]),
            f"{row['worst_slowdown']:.1f}x",
        )
    console.print(f"{trace}: {len(jobs)} jobs on {gpus} gpus ({gpus_per_host} per host)")
    print_table(console, table)


def register(app: typer.Typer) -> None:
    """Add ``simulate`` to the top-level CLI."""
    app.command("simulate")(simulate)
