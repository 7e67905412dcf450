"""``shoal hosts list|cordon|drain``."""

from __future__ import annotations

from typing import Annotated

import typer

from shoal.cli.common import console, emit, hosts_app, run
from shoal.cli.output import plain_table, print_table


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
