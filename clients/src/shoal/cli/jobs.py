"""``shoal submit`` and the commands that show or change a job:
``jobs list|get|priority|scale|cancel``."""

from __future__ import annotations

import asyncio
import contextlib
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from rich.table import Table

from shoal.cli import simulate
from shoal.cli.common import (
    app,
    console,
    emit,
    err_console,
    human_size,
    job_ref,
    jobs_app,
    quiet,
    run,
    state_name,
)
from shoal.cli.output import age, iso_time, plain_table, print_table, timestamp_seconds
from shoal.client import AsyncClient
from shoal.client.packing import pack
from shoal.v1 import job_pb2


class SyncModeOption(StrEnum):
    auto = "auto"
    parameter_server = "parameter-server"
    collective = "collective"


class BatchRuleOption(StrEnum):
    linear = "linear"
    sqrt = "sqrt"
    adascale = "adascale"


BATCH_RULES = {
    BatchRuleOption.linear: job_pb2.BATCH_SCALING_RULE_LINEAR,
    BatchRuleOption.sqrt: job_pb2.BATCH_SCALING_RULE_SQRT,
    BatchRuleOption.adascale: job_pb2.BATCH_SCALING_RULE_ADASCALE,
}

SYNC_MODES = {
    SyncModeOption.auto: job_pb2.SYNC_MODE_AUTO,
    SyncModeOption.parameter_server: job_pb2.SYNC_MODE_PARAMETER_SERVER,
    SyncModeOption.collective: job_pb2.SYNC_MODE_COLLECTIVE,
}


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
    adaptive_batch: Annotated[
        str | None,
        typer.Option(
            help="Opt in to the adaptive batch: the scheduler may pick the global batch in "
            "MIN:MAX with the world size to maximise goodput (trades the exact equivalence to "
            "one process for speed; docs/scheduling.md). --batch-size must lie in it.",
            metavar="MIN:MAX",
        ),
    ] = None,
    batch_rule: Annotated[
        BatchRuleOption,
        typer.Option(
            help="How the learning rate follows an adaptive batch B: lr x B/B0 "
            "(linear), lr x sqrt(B/B0) (sqrt) or lr x AdaScale's gain from the measured "
            "gradient noise scale (adascale), B0 the --batch-size."
        ),
    ] = BatchRuleOption.linear,
    keep_checkpoints: Annotated[
        int,
        typer.Option(
            help="Keep the job's newest N complete checkpoints, delete older ones (0: 3)."
        ),
    ] = 0,
    keep_every: Annotated[
        int,
        typer.Option(
            help="Also keep every Nth checkpoint for good (the checkpoints at epochs "
            "N x --checkpoint-every, 2N x ...; 0: none).",
            metavar="N",
        ),
    ] = 0,
    resume_from: Annotated[
        str | None,
        typer.Option(
            help="Start from another job's checkpoint: JOB (its newest), JOB/iter-K, JOB/K or "
            "JOB@K (see `shoal jobs checkpoints JOB`); --batch-size and --seed must be the same.",
            metavar="JOB[/CHECKPOINT]",
        ),
    ] = None,
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

    resume = resume_spec(resume_from) if resume_from is not None else ""
    adaptive = (
        adaptive_batch_spec(adaptive_batch, batch_rule) if adaptive_batch is not None else None
    )
    silent = quiet()
    bars = not silent and err_console.is_terminal

    async def body(client: AsyncClient) -> job_pb2.Job:
        with err_console.status(f"packing {model_dir}...") if bars else contextlib.nullcontext():
            packed = await asyncio.to_thread(pack, model_dir)
        data = packed.data
        if not silent:
            ignored = f", {packed.ignored} ignored" if packed.ignored else ""
            err_console.print(
                f"packed {model_dir}: {packed.files} file{'' if packed.files == 1 else 's'}, "
                f"{human_size(packed.file_bytes)} "
                f"({human_size(len(data))} compressed{ignored}; .gitignore and .shoalignore apply)",
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
            keep_checkpoints=keep_checkpoints,
            keep_every_nth_checkpoint=keep_every,
            resume_from=resume,
        )
        if adaptive is not None:
            spec.adaptive_batch.CopyFrom(adaptive)
        return await client.submit_job(spec)

    job = run(body)
    emit(
        job,
        lambda: console.print(
            f"submitted [bold]{job.job_id}[/bold] ({job.spec.name}), {state_name(job.state)}"
            + (f", resuming from {job.spec.resume_from}" if job.spec.resume_from else ""),
            highlight=False,
        ),
    )
    if wait or follow:
        from shoal.cli.follow import finish, follow_job  # registers its commands after these

        finish(job.job_id, run(lambda c: follow_job(c, job.job_id, logs=follow)))


def adaptive_batch_spec(text: str, rule: BatchRuleOption) -> job_pb2.AdaptiveBatch:
    """``--adaptive-batch MIN:MAX`` as JobSpec.adaptive_batch (the scheduler checks the
    bounds against --batch-size)."""
    lo, sep, hi = text.partition(":")
    if not sep or not lo.strip().isdigit() or not hi.strip().isdigit():
        raise typer.BadParameter(
            f"--adaptive-batch ({text!r}) must be MIN:MAX, two positive integers",
            param_hint="--adaptive-batch",
        )
    return job_pb2.AdaptiveBatch(
        min_global_batch=int(lo),
        max_global_batch=int(hi),
        rule=BATCH_RULES[rule],
    )


def batch_line(job: job_pb2.Job) -> str | None:
    """``shoal jobs get``'s line on the global batch: in use, and an adaptive batch's bounds,
    rule and the scheduler's pick."""
    in_use = job.progress.global_batch or job.spec.batch_size
    if not job.spec.HasField("adaptive_batch"):
        return None
    ab = job.spec.adaptive_batch
    rule = job_pb2.BatchScalingRule.Name(ab.rule).removeprefix("BATCH_SCALING_RULE_").lower()
    pick = (
        f"; goodput pick at {job.progress.world_size or job.target_workers} learners: "
        f"{job.adaptive_batch_size}"
        if job.adaptive_batch_size
        else ""
    )
    p = job.progress
    noise = (
        f"; gradient noise scale {p.gradient_noise_scale:.4g} samples "
        f"(over {p.gradient_noise_samples} iterations)"
        if p.gradient_noise_scale > 0
        else f"; gradient noise scale not measured yet ({p.gradient_noise_samples} iterations)"
    )
    return (
        f"batch: {in_use} in use (declared {job.spec.batch_size}, adaptive "
        f"{ab.min_global_batch}..{ab.max_global_batch}, lr rule {rule}{pick}{noise})"
    )


def resume_spec(text: str) -> str:
    """``--resume-from`` as JobSpec.resume_from: "JOB" or "JOB/iter-K" (``JOB/K`` and
    ``JOB@K`` are accepted too)."""
    job_id, sep, which = text.replace("@", "/", 1).partition("/")
    if not job_id or (sep and not which):
        raise typer.BadParameter(
            f"--resume-from ({text!r}) must be JOB, JOB/iter-K or JOB@K", param_hint="--resume-from"
        )
    if which.isdigit():
        which = f"iter-{int(which)}"
    job_id = job_ref(job_id)
    return f"{job_id}/{which}" if which else job_id


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
    job_id = job_ref(job_id)
    job = run(lambda c: c.get_job(job_id))

    def render(wide: bool = False) -> None:
        print_table(console, jobs_table([job], wide=wide))
        if job.state_reason:
            console.print(f"reason: {job.state_reason}", highlight=False, soft_wrap=True)
        if (line := batch_line(job)) is not None:
            console.print(line, highlight=False, soft_wrap=True)
        for line in simulate.throughput_lines(job):  # the scheduler's throughput model
            console.print(line, highlight=False, soft_wrap=True)

    emit(job, render, wide=lambda: render(True))


@jobs_app.command("priority")
def jobs_priority(job_id: str, priority: int) -> None:
    """Change a job's priority; shares follow at the next iteration boundaries."""
    job_id = job_ref(job_id)
    job = run(lambda c: c.update_job(job_id, priority=priority))
    emit(job, lambda: console.print(f"{job_id}: priority {job.spec.priority}"))


@jobs_app.command("scale")
def jobs_scale(job_id: str, max_workers: int) -> None:
    """Change a job's max workers."""
    job_id = job_ref(job_id)
    job = run(lambda c: c.update_job(job_id, max_workers=max_workers))
    emit(job, lambda: console.print(f"{job_id}: max workers {job.spec.max_workers}"))


@jobs_app.command("cancel")
def jobs_cancel(job_id: str) -> None:
    """Cancel a job: its learners stop and its devices are freed."""
    job_id = job_ref(job_id)
    job = run(lambda c: c.cancel_job(job_id))
    emit(job, lambda: console.print(f"{job_id}: {state_name(job.state)}"))
