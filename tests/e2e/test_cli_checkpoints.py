"""Checkpoints a user can use (issue 18, item 10), against a real local cluster driven through
the `shoal` command: a job keeps only its newest `--keep-checkpoints` checkpoints, `shoal jobs
checkpoints` lists what is left, one downloads with `jobs download --checkpoint`, and `shoal
submit --resume-from JOB@K` starts a new job from a checkpoint that ends with the same model as
the job that never stopped. Bad `--resume-from` values are refused naming what is wrong. A job
that carries requirements.txt shows its environment's build in `shoal jobs logs` (issue 19);
it shares this test's cluster, which is the costly part."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.integration.test_host_agent import tiny_wheel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

BIN = Path(sys.executable).parent

# 448 samples, batch 64: 7 iterations an epoch, so checkpoints iter-7, iter-14, iter-21.
TRAIN = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

from shoal.learner import ElasticTrainer


def get_datasets():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(512, 1, generator=g)
    y = 3 * x - 1 + 0.05 * torch.randn(512, 1, generator=g)
    return TensorDataset(x[:448], y[:448]), TensorDataset(x[448:], y[448:])


torch.manual_seed(0)
trainer = ElasticTrainer(nn.Linear(1, 1), get_datasets, nn.MSELoss(), ("SGD", {"lr": 0.2}))
trainer.train(epochs=3, batch_size=64)
"""


def shoal(*args: str, env: dict[str, str], cwd: Path, check: bool = True):
    out = subprocess.run(
        [str(BIN / "shoal"), *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=240
    )
    if check:
        assert out.returncode == 0, out.stdout + out.stderr
    return out


def test_retention_listing_download_and_resume_from_a_checkpoint(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")
    (tmp_path / "lin").mkdir()
    (tmp_path / "lin" / "train.py").write_text(TRAIN)
    up = shoal(
        "cluster", "up", "--hosts", "1", "--gpus-per-host", "1", "--shards", "1",
        "--no-dashboard", env=env, cwd=tmp_path,
    )  # fmt: skip
    assert "cluster up" in up.stdout or "context" in up.stdout, up.stdout
    try:
        common = ["--epochs", "3", "--batch-size", "64", "--checkpoint-every", "1"]
        first = shoal(
            "submit", "lin", *common, "--keep-checkpoints", "2", "--wait", env=env, cwd=tmp_path
        )
        job_a = first.stdout.split()[1]

        # Retention: of iter-7, iter-14 and iter-21 the newest two are left.
        listed = json.loads(
            shoal("jobs", "checkpoints", job_a, "-o", "json", env=env, cwd=tmp_path).stdout
        )
        assert [c["name"] for c in listed] == ["iter-14", "iter-21"], listed
        assert listed[-1]["latest"] is True and listed[0]["iteration"] == 14
        assert all(c["size_bytes"] > 0 for c in listed)

        # One checkpoint's files, by iteration.
        got = json.loads(
            shoal(
                "jobs", "download", job_a, "--checkpoint", "14", "--out", str(tmp_path / "c14"),
                "-o", "json", env=env, cwd=tmp_path,
            ).stdout
        )  # fmt: skip
        assert got["checkpoint"] == "iter-14" and (tmp_path / "c14" / "manifest.json").is_file()
        assert json.loads((tmp_path / "c14" / "manifest.json").read_text())["iteration"] == 14

        # Refusals name the value: a deleted checkpoint, a different batch size.
        gone = shoal(
            "submit",
            "lin",
            *common,
            "--resume-from",
            f"{job_a}@7",
            env=env,
            cwd=tmp_path,
            check=False,
        )
        assert gone.returncode == 1, gone.stdout + gone.stderr
        assert "checkpoint 'iter-7' of job" in gone.stderr, gone.stderr
        assert "(it has: iter-14, iter-21)" in gone.stderr, gone.stderr
        other = shoal(
            "submit", "lin", "--epochs", "3", "--batch-size", "32", "--resume-from", job_a,
            env=env, cwd=tmp_path, check=False,
        )  # fmt: skip
        assert other.returncode == 1 and "spec.batch_size" in other.stderr, other.stderr
        assert "(64)" in other.stderr, other.stderr

        # Resumed from iter-14 (end of epoch 2), the new job runs epoch 3 only and ends with
        # the model of the job that never stopped.
        second = shoal(
            "submit", "lin", *common, "--resume-from", f"{job_a}/iter-14", "--wait",
            env=env, cwd=tmp_path,
        )  # fmt: skip
        assert f"resuming from {job_a}/iter-14" in second.stdout, second.stdout
        job_b = second.stdout.split()[1]
        b = json.loads(shoal("jobs", "get", job_b, "-o", "json", env=env, cwd=tmp_path).stdout)
        assert b["progress"]["completed_iterations"] == 21, b["progress"]
        for job in (job_a, job_b):
            shoal(
                "jobs", "download", job, "--out", str(tmp_path / f"{job}.st"), env=env, cwd=tmp_path
            )
        model_a = load_file(str(tmp_path / f"{job_a}.st"))
        model_b = load_file(str(tmp_path / f"{job_b}.st"))
        assert model_a.keys() == model_b.keys() and model_a
        for name, tensor in model_a.items():
            torch.testing.assert_close(model_b[name], tensor, rtol=0, atol=1e-6)
        names = [
            c["name"]
            for c in json.loads(
                shoal("jobs", "checkpoints", job_b, "-o", "json", env=env, cwd=tmp_path).stdout
            )
        ]
        assert names[0] == "iter-14" and names[-1] == "iter-21", names

        # A job that brings its own package (issue 19): the environment's build is in its logs.
        wheel_name, wheel = tiny_wheel()
        (tmp_path / "withenv" / "wheels").mkdir(parents=True)
        (tmp_path / "withenv" / "wheels" / wheel_name).write_bytes(wheel)
        (tmp_path / "withenv" / "requirements.txt").write_text(f"./wheels/{wheel_name}\n")
        (tmp_path / "withenv" / "train.py").write_text("import shoal_tinypkg\n" + TRAIN)
        third = shoal("submit", "withenv", "--epochs", "1", "--wait", env=env, cwd=tmp_path)
        logs = shoal("jobs", "logs", third.stdout.split()[1], env=env, cwd=tmp_path).stdout
        built = [line for line in logs.splitlines() if "] [shoal env] " in line]
        assert "(requirements.txt): building" in built[0], logs
        assert any(line.endswith("Successfully installed shoal-tinypkg-0.1") for line in built)
        assert re.search(r"\[shoal env\] environment [0-9a-f]{12}: ready in [0-9.]+ s", logs)
    finally:
        shoal("cluster", "down", env=env, cwd=tmp_path, check=False)
