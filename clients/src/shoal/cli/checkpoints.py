"""A job's files: ``jobs download`` (the model or a checkpoint) and ``jobs checkpoints``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from shoal.cli.common import (
    console,
    emit,
    err_console,
    human_size,
    job_ref,
    jobs_app,
    quiet,
    run,
)
from shoal.cli.output import age, plain_table, print_table, timestamp_seconds
from shoal.client import AsyncClient, ShoalClientError


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
    job_id = job_ref(job_id)
    silent = quiet()
    bars = not silent and err_console.is_terminal
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


@jobs_app.command("checkpoints")
def jobs_checkpoints(job_id: str) -> None:
    """List a job's complete checkpoints and their files."""
    job_id = job_ref(job_id)
    checkpoints = run(lambda c: c.list_checkpoints(job_id))

    def render() -> None:
        table = plain_table("CHECKPOINT", "ITERATION", "EPOCH", "AGE", "SIZE", "FILES")
        for c in checkpoints:
            table.add_row(
                c.name + (" (latest)" if c.latest else ""),
                str(c.iteration),
                str(c.epoch),
                age(timestamp_seconds(c.create_time)),
                human_size(c.size_bytes),
                " ".join(f.name for f in c.files),
            )
        print_table(console, table)

    emit(checkpoints, render)
