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

from shoal.contract.processes import pid_alive

cluster_app = typer.Typer(help="Run a whole shoal cluster on this machine.", no_args_is_help=True)
console = Console()
err = Console(stderr=True, soft_wrap=True)
StateDir = Annotated[Path, typer.Option(help="Where the cluster keeps state, logs, storage.")]
FoundStateDir = Annotated[
    Path | None,
    typer.Option(
        help="The cluster's state directory (default: ./.shoal if a cluster runs there, else "
        "the current context's cluster)."
    ),
]


def _found_state_dir(state_dir: Path | None) -> Path:
    """``--state-dir``, else ``./.shoal`` when a cluster runs here, else the state directory of
    the current context's local cluster (so `status` and `down` work from any directory)."""
    if state_dir is not None:
        return state_dir
    here = Path(".shoal")
    if (here / "cluster.json").is_file():
        return here
    from shoal.client.config import ConfigError, config_path, read_config_file

    try:
        data = read_config_file(config_path())
    except ConfigError:
        return here
    found = data.get("state_dir")
    return Path(str(found)) if found else here


def _free_context_name(name: str, config_file: Path) -> str:
    """``name``, or ``name-2``, ``name-3``... when ``name`` already points at another cluster
    that is still there (a second local cluster never hides the first)."""
    from shoal.client.config import read_contexts

    contexts = read_contexts()["contexts"]
    target = str(config_file.resolve())
    candidate, n = name, 1
    while True:
        entry = contexts.get(candidate)
        other = str(entry.get("config", "")) if isinstance(entry, dict) else ""
        if not other or other == target or not Path(other).is_file():
            return candidate
        n += 1
        candidate = f"{name}-{n}"


def _read_state(state_dir: Path) -> dict[str, object] | None:
    try:
        return json.loads((state_dir / "cluster.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@cluster_app.command()
def up(
    state_dir: StateDir = Path(".shoal"),
    hosts: Annotated[int, typer.Option(help="Host agents.")] = 2,
    gpus_per_host: Annotated[int, typer.Option(help="Simulated GPUs per host.")] = 4,
    shards: Annotated[int, typer.Option(help="Parameter-sync shards.")] = 2,
    policy: Annotated[str, typer.Option(help="FIFO, FAIRSHARE or PRIORITY.")] = "PRIORITY",
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the cluster.")] = 120.0,
    restart: Annotated[
        bool,
        typer.Option(help="Restart a crashed service process (bounded backoff)."),
    ] = True,
    stall_timeout: Annotated[
        float | None,
        typer.Option(help="The job-scheduler's --stall-timeout, seconds (default: its own)."),
    ] = None,
    context: Annotated[
        str,
        typer.Option(
            help="Name of the context registered in ~/.config/shoal/contexts.json (made "
            "current), so the CLI finds this cluster from any directory."
        ),
    ] = "local",
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
    if state and pid_alive(int(state.get("supervisor_pid", 0) or 0)):
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
            *([] if restart else ["--no-restart"]),
            *(["--stall-timeout", str(stall_timeout)] if stall_timeout is not None else []),
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
                err.print(
                    f"[red]error:[/red] the cluster failed to start: see {state_dir}/logs/; "
                    "the last lines of its log:",
                    highlight=False,
                )
                err.print(
                    _tail(state_dir / "logs" / "supervisor.log"), highlight=False, markup=False
                )
                raise typer.Exit(1)
            if time.monotonic() > deadline:
                proc.terminate()
                err.print(f"[red]error:[/red] the cluster did not start in {timeout:.0f} s")
                err.print(
                    _tail(state_dir / "logs" / "supervisor.log"), highlight=False, markup=False
                )
                raise typer.Exit(1)
            time.sleep(0.2)
    from shoal.client.config import ConfigError, set_context

    try:
        name = _free_context_name(context, state_dir / "cluster.json")
        set_context(name, state_dir / "cluster.json")
        registered = f"context {name!r} (current)"
    except (ConfigError, OSError) as exc:
        registered = f"no context registered: {exc}"
    console.print(
        f"cluster up: {hosts} hosts x {gpus_per_host} GPUs, {shards} shards"
        f"{', mutual TLS' if tls else ''}; "
        f"state and logs in {state_dir}/ (shoal cluster status | down); {registered}; "
        f"you are its admin (the admin token is in {state_dir}/cluster.json)",
        highlight=False,
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
def status(state_dir: FoundStateDir = None) -> None:
    """Show the local cluster's processes, whether they are alive, and their metrics URLs."""
    state_dir = _found_state_dir(state_dir)
    state = _read_state(state_dir)
    if state is None:
        console.print(f"no cluster running in {state_dir}")
        raise typer.Exit(1)
    metrics = dict(state.get("metrics") or {})  # type: ignore[call-overload]
    services = dict(state.get("services") or {})  # type: ignore[call-overload]
    table = Table("PROCESS", "PID", "ALIVE", "METRICS")
    table.add_row(
        "supervisor", str(state["supervisor_pid"]), str(pid_alive(int(state["supervisor_pid"]))), ""
    )
    # Restarts by the supervisor, in a table of their own (the URLs above stay on one line).
    restarts = Table("PROCESS", "STATE", "RESTARTS", "LAST EXIT")
    for name, pid in dict(state["pids"]).items():  # type: ignore[arg-type]
        alive = pid_alive(int(pid)) if pid else False
        table.add_row(name, str(pid), str(alive), str(metrics.get(name, "")))
        if name not in services:
            continue  # the dashboard: not restarted
        info = dict(services[name] or {})
        supervised = str(info.get("state", ""))
        if not alive and supervised == "running":
            supervised = "exited (restart pending)" if state.get("supervised") else "exited"
        last_exit = info.get("last_exit_code")
        restarts.add_row(
            name,
            supervised,
            str(info.get("restarts", "")),
            "" if last_exit is None else str(last_exit),
        )
    console.print(table)
    if services:
        console.print(restarts)
    console.print(f"scheduler: {', '.join(state['scheduler'])}")  # type: ignore[arg-type]
    _print_dashboard(state_dir, state)


@cluster_app.command()
def down(
    state_dir: FoundStateDir = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for a clean stop.")] = 60.0,
) -> None:
    """Stop every process of the local cluster; nothing is left behind."""
    state_dir = _found_state_dir(state_dir)
    state = _read_state(state_dir)
    if state is None:
        console.print(f"no cluster running in {state_dir}")
        return
    pids = [int(p) for p in dict(state["pids"]).values()]  # type: ignore[arg-type]
    supervisor = int(state["supervisor_pid"])  # type: ignore[arg-type]
    if pid_alive(supervisor):
        os.kill(supervisor, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in [supervisor, *pids]) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in [supervisor, *pids] if pid_alive(p)]
    for pid in left:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    from shoal.client.config import ConfigError, remove_contexts_for

    try:
        remove_contexts_for(state_dir / "cluster.json")
    except (ConfigError, OSError):
        pass
    (state_dir / "cluster.json").unlink(missing_ok=True)
    console.print("cluster down" + (f" (killed {len(left)} stuck processes)" if left else ""))
