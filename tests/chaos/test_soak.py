"""The random-fault soak in short (tests/chaos/soak.py): one minute of seeded faults on the
control plane, etcd and the host agents while three jobs of both sync modes train, then every
check of the soak: each job in exactly one terminal state (here: COMPLETED), its iterations
exact, its model equal to the single-process reference, no reachable host declared lost.
`make soak SOAK_MINUTES=30` runs the long one; SHOAL_SOAK_MINUTES changes this one's length."""

from __future__ import annotations

import json
import os

import pytest

from tests.chaos import soak

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(900)]


def test_a_short_seeded_soak_completes_every_job_exactly_and_equal_to_its_reference(tmp_path):
    minutes = float(os.environ.get("SHOAL_SOAK_MINUTES", "1"))
    out = tmp_path / "soak-report.json"
    status = soak.run(minutes, seed=3, out=out, state_dir=tmp_path / "cluster")
    report = json.loads(out.read_text())
    assert report["problems"] == [], report["problems"]
    assert status == 0
    assert report["faults_applied"], "the schedule applied no fault"
    assert [f for f in report["faults_applied"] if not f["ok"]] == []
    for key, job in report["jobs"].items():
        assert job["state"] == "JOB_STATE_COMPLETED", (key, job)
        assert job["iterations"] > 0
        assert job["model_max_abs_diff"] <= soak.MODEL_ATOL, (key, job)
