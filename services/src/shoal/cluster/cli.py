"""``shoal cluster up | status | down``: the embedded local cluster from the command line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

cluster_app = typer.Typer(help="Run a whole shoal cluster on this machine.", no_args_is_help=True)
console = Console()
err = Console(stderr=True, soft_wrap=True)
StateDir = Annotated[Path, typer.Option(help="Where the cluster keeps state, logs, storage.")]


def _read_state(state_dir: Path) -> dict[str, object] | None:
    try:
        return json.loads((state_dir / "cluster.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@cluster_app.command()
def up(
    state_dir: StateDir = Path(".shoal"),
    hosts: Annotated[int, typer.Option(help="Host agents.")] = 2,
    gpus_per_host: Annotated[int, typer.Option(help="Simulated GPUs per host.")] = 4,
    shards: Annotated[int, typer.Option(help="Parameter-sync shards.")] = 2,
    policy: Annotated[str, typer.Option(help="FIFO, FAIRSHARE or PRIORITY.")] = "PRIORITY",
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the cluster.")] = 120.0,
    dashboard: Annotated[bool, typer.Option(help="Serve the web dashboard too.")] = True,
    tls: Annotated[
        bool,
        typer.Option(
            "--tls",
            help="Mutual TLS on every hop: a cluster CA and per-process certificates in "
            "STATE_DIR/tls; the CLI's certificate is named in STATE_DIR/cluster.json.",
        ),
    ] = False,
    replication: Annotated[
        bool,
        typer.Option(
            "--replication/--no-replication",
            help="Keep a backup replica of each parameter-sync slice on another shard, so that "
            "a lost shard loses no committed iteration (on by default; off rewinds to the "
            "latest checkpoint instead). Sets SHOAL_REPLICATION for the shards.",
        ),
    ] = True,
) -> None:
    """Start etcd and every service in the background; the CLI then finds them by itself."""
    state = _read_state(state_dir)
    if state and _alive(int(state.get("supervisor_pid", 0) or 0)):
        err.print(
            f"[red]error:[/red] a cluster is already running in {state_dir} (shoal cluster down)"
        )
        raise typer.Exit(1)
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "logs").mkdir(exist_ok=True)
    log = (state_dir / "logs" / "supervisor.log").open("ab")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shoal.cluster.supervisor",
            "--state-dir",
            str(state_dir),
            "--hosts",
            str(hosts),
            "--gpus-per-host",
            str(gpus_per_host),
            "--shards",
            str(shards),
            "--policy",
            policy,
            *([] if dashboard else ["--no-dashboard"]),
            *(["--tls"] if tls else []),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        # The supervisor's services inherit it: the shards' --replication default.
        env={**os.environ, "SHOAL_REPLICATION": "on" if replication else "off"},
    )
    log.close()
    deadline = time.monotonic() + timeout
    with console.status("starting etcd and the services..."):
        while _read_state(state_dir) is None:
            if proc.poll() is not None:
                err.print(f"[red]error:[/red] the cluster failed to start: see {state_dir}/logs/")
                raise typer.Exit(1)
            if time.monotonic() > deadline:
                proc.terminate()
                err.print(f"[red]error:[/red] the cluster did not start in {timeout:.0f} s")
                raise typer.Exit(1)
            time.sleep(0.2)
    console.print(
        f"cluster up: {hosts} hosts x {gpus_per_host} GPUs, {shards} shards"
        f"{', mutual TLS' if tls else ''}; "
        f"state and logs in {state_dir}/ (shoal cluster status | down)"
    )
    _print_dashboard(state_dir, _read_state(state_dir) or {})


def _print_dashboard(state_dir: Path, state: dict[str, object]) -> None:
    if state.get("dashboard"):
        console.print(
            f"dashboard: {state['dashboard']} (log in with the token in {state_dir}/cluster.json)",
            soft_wrap=True,
            highlight=False,
        )


@cluster_app.command()
def status(state_dir: StateDir = Path(".shoal")) -> None:
    """Show the local cluster's processes, whether they are alive, and their metrics URLs."""
    state = _read_state(state_dir)
    if state is None:
        console.print(f"no cluster running in {state_dir}")
        raise typer.Exit(1)
    metrics = dict(state.get("metrics") or {})  # type: ignore[call-overload]
    table = Table("PROCESS", "PID", "ALIVE", "METRICS")
    table.add_row(
        "supervisor", str(state["supervisor_pid"]), str(_alive(int(state["supervisor_pid"]))), ""
    )
    for name, pid in dict(state["pids"]).items():  # type: ignore[arg-type]
        table.add_row(name, str(pid), str(_alive(int(pid))), str(metrics.get(name, "")))
    console.print(table)
    console.print(f"scheduler: {', '.join(state['scheduler'])}")  # type: ignore[arg-type]
    _print_dashboard(state_dir, state)


@cluster_app.command()
def down(
    state_dir: StateDir = Path(".shoal"),
    timeout: Annotated[float, typer.Option(help="Seconds to wait for a clean stop.")] = 60.0,
) -> None:
    """Stop every process of the local cluster; nothing is left behind."""
    state = _read_state(state_dir)
    if state is None:
        console.print(f"no cluster running in {state_dir}")
        return
    pids = [int(p) for p in dict(state["pids"]).values()]  # type: ignore[arg-type]
    supervisor = int(state["supervisor_pid"])  # type: ignore[arg-type]
    if _alive(supervisor):
        os.kill(supervisor, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in [supervisor, *pids]) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in [supervisor, *pids] if _alive(p)]
    for pid in left:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    (state_dir / "cluster.json").unlink(missing_ok=True)
    console.print("cluster down" + (f" (killed {len(left)} stuck processes)" if left else ""))
