"""The process behind ``shoal cluster up``: starts a LocalCluster, records it in
``<state_dir>/cluster.json``, and keeps it until SIGTERM/SIGINT (``shoal cluster down``), then
stops every process it started. Meanwhile it restarts a service process that crashed, with a
bounded backoff (``shoal.cluster.local.RestartPolicy``; logged here, counted in cluster.json and
shown by ``shoal cluster status``). If the supervisor itself is killed, its children die with it
(PR_SET_PDEATHSIG), so a local cluster never leaves processes behind."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from shoal.cluster.local import ClusterSpec, LocalCluster


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shoal-cluster-supervisor")
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--gpus-per-host", type=int, default=4)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--policy", default="PRIORITY")
    parser.add_argument("--no-dashboard", action="store_true", help="Do not serve the dashboard.")
    parser.add_argument("--tls", action="store_true", help="mutual TLS on every hop")
    parser.add_argument(
        "--no-restart", action="store_true", help="Do not restart crashed service processes."
    )
    parser.add_argument(
        "--stall-timeout", type=float, default=None, help="The job-scheduler's --stall-timeout."
    )
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s supervisor %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    spec = ClusterSpec(
        state_dir=ns.state_dir,
        hosts=ns.hosts,
        gpus_per_host=ns.gpus_per_host,
        shards=ns.shards,
        replicas=ns.replicas,
        policy=ns.policy,
        dashboard=not ns.no_dashboard,
        tls=ns.tls,
        supervise=not ns.no_restart,
        scheduler_flags=(
            ("--stall-timeout", str(ns.stall_timeout)) if ns.stall_timeout is not None else ()
        ),
    )
    cluster = LocalCluster(spec)
    cluster.supervisor_pid = os.getpid()
    state_file = cluster.state_dir / "cluster.json"
    try:
        cluster.start()
        cluster.write_client_config(state_file)
        logging.info("cluster up: %s", json.dumps(cluster.client_config_dict()["pids"]))
        while not stop.wait(1.0):
            pass  # the cluster's own thread restarts crashed services (spec.supervise)
    finally:
        cluster.stop()
        state_file.unlink(missing_ok=True)
        logging.info("cluster down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
