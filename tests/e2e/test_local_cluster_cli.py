"""The embedded local cluster from the command line, used as a person would: `shoal cluster
up`, the CLI finding it by itself, grpcurl as an external client (list, describe, Health,
SubmitJob with a JSON body), `shoal cluster status`, and `shoal cluster down` leaving no
process behind."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from shoal.client import Client, load_config
from tests.support import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]


def shoal(*args: str, env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [str(BIN / "shoal"), *args], capture_output=True, text=True, env=env, timeout=180
    )
    if check:
        assert out.returncode == 0, out.stdout + out.stderr
    return out


def grpcurl(*args: str) -> str:
    out = subprocess.run(
        [str(BIN / "grpcurl"), "-plaintext", *args], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def grpcurl_leader(addresses: list[str], *args: str) -> str:
    """Call the replicated scheduler as any gRPC client must: a standby answers Unavailable
    naming the leader (also in the `shoal-leader` trailer); follow it."""
    address, last = addresses[0], ""
    for _ in range(10):
        out = subprocess.run(
            [str(BIN / "grpcurl"), "-plaintext", *args[:-1], address, args[-1]],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if out.returncode == 0:
            return out.stdout
        last = out.stderr
        hint = re.search(r"the leader is at (\S+)", out.stderr)
        if not hint:
            break
        address = hint.group(1)
    raise AssertionError(last)


FINAL = {"JOB_STATE_COMPLETED", "JOB_STATE_FAILED", "JOB_STATE_CANCELLED"}


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_cluster_up_serves_the_cli_and_grpcurl_and_down_leaves_nothing(tmp_path):
    state_dir = tmp_path / "state"
    env = {**os.environ, "SHOAL_CONFIG": str(state_dir / "cluster.json")}
    env.pop("SHOAL_ENDPOINTS", None)
    up = shoal(
        "cluster",
        "up",
        "--state-dir",
        str(state_dir),
        "--hosts",
        "2",
        "--gpus-per-host",
        "2",
        "--shards",
        "1",
        env=env,
    )
    state = json.loads((state_dir / "cluster.json").read_text())
    # The web dashboard is served too: its URL is printed, recorded and its process listed.
    assert state["dashboard"].startswith("http://127.0.0.1:")
    assert f"dashboard: {state['dashboard']}" in up.stdout.replace("\n", "")
    assert "dashboard" in state["pids"]
    pids = [int(p) for p in state["pids"].values()] + [int(state["supervisor_pid"])]
    try:
        hosts = wait_until(
            lambda: (lambda h: h if len(h) == 2 else None)(
                json.loads(shoal("-o", "json", "hosts", "list", env=env).stdout)
            ),
            timeout=60,
            what="two hosts registered",
        )
        assert sorted(len(h["devices"]) for h in hosts) == [2, 2]
        status = shoal("cluster", "status", "--state-dir", str(state_dir), env=env).stdout
        assert "job-scheduler-0" in status and "False" not in status
        assert state["dashboard"] in status.replace("\n", "")
        with urllib.request.urlopen(state["dashboard"] + "healthz", timeout=10) as reply:
            assert reply.read() == b"ok"
        # Every service process serves Prometheus metrics; status shows where. (The dashboard
        # is a client of the API, not a service: it serves none.)
        assert set(state["metrics"]) == set(state["pids"]) - {"dashboard"}
        for url in state["metrics"].values():
            assert url in status
        with urllib.request.urlopen(state["metrics"]["resource-manager-0"], timeout=10) as reply:
            assert 'shoal_leader{election="resource-manager"}' in reply.read().decode()

        # grpcurl, a real external client, against the scheduler leader.
        with Client(load_config(env=env)) as client:
            artifact = client.upload_directory(ROOT / "examples" / "digits")
            for address in state["scheduler"]:
                listed = grpcurl(address, "list").split()
                assert "shoal.v1.JobSchedulerService" in listed
                health = json.loads(
                    grpcurl("-d", '{"service": ""}', address, "grpc.health.v1.Health/Check")
                )
                assert health == {"status": "SERVING"}
            described = grpcurl(state["scheduler"][0], "describe", "shoal.v1.JobSchedulerService")
            assert "rpc SubmitJob" in described
            body = {
                "request_id": "grpcurl-1",
                "spec": {
                    "name": "from-grpcurl",
                    "entry_point": "train.py",
                    "artifact_id": artifact,
                    "batch_size": 64,
                    "epochs": 1,
                    "max_workers": 1,
                },
            }
            reply = json.loads(
                grpcurl_leader(
                    state["scheduler"],
                    "-H",
                    f"authorization: Bearer {state['token']}",
                    "-d",
                    json.dumps(body),
                    "shoal.v1.JobSchedulerService/SubmitJob",
                )
            )
            job_id = reply["job"]["job_id"]
            got = json.loads(shoal("-o", "json", "jobs", "get", job_id, env=env).stdout)
            assert got["spec"]["name"] == "from-grpcurl"
            shoal("jobs", "cancel", job_id, env=env)

        # Collective mode through the whole stack: the scheduler starts the learners with
        # SHOAL_SYNC_BACKEND=collective and they train in gloo groups. (Whether the second
        # learner joins before the first has finished the small job depends on start-up
        # times; groups of several learners are tested in test_collective_training.py.)
        submitted = json.loads(
            shoal(
                "-o", "json", "submit", str(ROOT / "examples" / "digits"),
                "--name", "collective", "--sync-mode", "collective", "--epochs", "1",
                "--min-workers", "2", "--max-workers", "2", "--batch-size", "128",
                env=env,
            ).stdout
        )  # fmt: skip
        job_id = submitted["job_id"]
        done = wait_until(
            lambda: (lambda j: j if j["state"] in FINAL else None)(
                json.loads(shoal("-o", "json", "jobs", "get", job_id, env=env).stdout)
            ),
            timeout=240,
            what="the collective job finished",
        )
        logs = shoal("jobs", "logs", job_id, env=env).stdout
        assert done["state"] == "JOB_STATE_COMPLETED", logs[-3000:]
        assert done["effective_sync_mode"] == "SYNC_MODE_COLLECTIVE"
        assert "gloo group of" in logs and "(collective)" in logs
    finally:
        shoal("cluster", "down", "--state-dir", str(state_dir), env=env, check=False)
    wait_until(lambda: not any(alive(p) for p in pids), timeout=30, what="no process left")
    assert not (state_dir / "cluster.json").exists()
