"""The user's day on the CLI against a real local cluster (issue 18): a script that raises is
explained (its exception in the job's reason, `submit --wait` exiting 1, the traceback once in
the logs), a script that exits 0 without calling train() fails instead of restarting forever,
the CLI finds the cluster from another directory through its context, `-o` goes after the
subcommand, and the person who started the cluster drains a host without editing anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

BIN = Path(sys.executable).parent

CRASH = """
def forward(x):
    raise ValueError(f"shapes {x} and (5,) do not match")

forward((3, 4))
"""
NO_TRAIN = 'print("loaded the model; forgot to call train()")\n'


def shoal(*args: str, env: dict[str, str], cwd: Path, check: bool = True):
    out = subprocess.run(
        [str(BIN / "shoal"), *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=240
    )
    if check:
        assert out.returncode == 0, out.stdout + out.stderr
    return out


def test_failures_are_explained_and_the_cli_finds_its_cluster_from_anywhere(tmp_path):
    project, elsewhere = tmp_path / "project", tmp_path / "mycnn"
    for d in (project, elsewhere):
        d.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")
    (elsewhere / "crash").mkdir()
    (elsewhere / "crash" / "train.py").write_text(CRASH)
    (elsewhere / "notrain").mkdir()
    (elsewhere / "notrain" / "train.py").write_text(NO_TRAIN)
    up = shoal(
        "cluster", "up", "--hosts", "2", "--gpus-per-host", "1", "--shards", "1",
        "--no-dashboard", env=env, cwd=project,
    )  # fmt: skip
    assert "context 'local' (current)" in up.stdout.replace("\n", " ")
    try:
        # From another directory: the context finds the cluster; -o after the subcommand.
        contexts = json.loads(
            shoal("config", "get-contexts", "-o", "json", env=env, cwd=elsewhere).stdout
        )
        assert [c["name"] for c in contexts if c["current"]] == ["local"]
        assert json.loads(shoal("jobs", "list", "-o", "json", env=env, cwd=elsewhere).stdout) == []

        crashed = shoal(
            "submit", "crash", "--max-workers", "2", "--wait", env=env, cwd=elsewhere, check=False
        )
        assert crashed.returncode == 1, crashed.stdout + crashed.stderr
        reason = " ".join(crashed.stderr.split())
        assert "ValueError: shapes (3, 4) and (5,) do not match" in reason
        assert "train.py:5 in <module>" in reason and "train.py:3 in forward" in reason
        job_id = crashed.stdout.split()[1]
        job = json.loads(shoal("jobs", "get", job_id, "-o", "json", env=env, cwd=elsewhere).stdout)
        assert job["state"] == "JOB_STATE_FAILED"
        assert "ValueError" in job["state_reason"]
        assert isinstance(job["progress"]["completed_iterations"], int)
        logs = shoal("jobs", "logs", job_id, env=env, cwd=elsewhere).stdout
        assert logs.count("Traceback (most recent call last):") == 1, logs
        assert "(the same traceback again, 2 times so far)" in logs, logs

        idle = shoal("submit", "notrain", "--wait", env=env, cwd=elsewhere, check=False)
        assert idle.returncode == 1, idle.stdout + idle.stderr
        assert "without calling Trainer.train()" in " ".join(idle.stderr.split())

        # The person who started the cluster is its admin from the CLI.
        drained = shoal("hosts", "drain", "host-1", "-o", "json", env=env, cwd=elsewhere)
        assert json.loads(drained.stdout)["host_id"] == "host-1"
    finally:
        # From the other directory too: the context names the cluster's state directory.
        down = shoal("cluster", "down", env=env, cwd=elsewhere, check=False)
        if down.returncode != 0 or "cluster down" not in down.stdout:
            shoal("cluster", "down", env=env, cwd=project, check=False)
    assert "cluster down" in down.stdout, down.stdout + down.stderr
    gone = shoal("config", "get-contexts", "-o", "json", env=env, cwd=elsewhere)
    assert json.loads(gone.stdout) == []
