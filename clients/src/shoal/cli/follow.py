"""Following a job: ``jobs watch`` (and ``submit --wait/--follow``) and ``jobs logs``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import Callable
from typing import Annotated

import typer
from rich.progress import BarColumn, Progress, TextColumn

from shoal.cli.common import (
    EXIT_CANCELLED,
    EXIT_FAILED,
    FINAL_STATES,
    Output,
    console,
    err_console,
    job_ref,
    jobs_app,
    run,
    state,
    state_name,
)
from shoal.cli.output import iso_time, timestamp_seconds, to_data
from shoal.client import AsyncClient, ShoalClientError
from shoal.v1 import job_pb2


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
    job_id = job_ref(job_id)
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
    job_id = job_ref(job_id)
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
