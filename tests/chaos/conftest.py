"""Fixtures of the chaos suite: one real cluster per module (three etcd members, two replicas
of the resource manager and of the job scheduler, one parameter-sync shard, two hosts with two
simulated GPUs each) with two jobs training on it."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chaos.harness import TINY_MODEL, ChaosCluster, job_spec

RESULTS = os.environ.get("SHOAL_CHAOS_RESULTS", "")


@pytest.fixture(scope="module")
def chaos(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChaosCluster]:
    c = ChaosCluster.start(tmp_path_factory.mktemp("chaos") / "cluster")
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def two_jobs(chaos: ChaosCluster) -> tuple[str, str]:
    """Two jobs training, two learners each (all four GPUs)."""
    artifact = chaos.client.upload_directory(TINY_MODEL)
    a = chaos.client.submit_job(job_spec("chaos-a", artifact, max_workers=2)).job_id
    b = chaos.client.submit_job(job_spec("chaos-b", artifact, max_workers=2)).job_id
    for job in (a, b):
        chaos.wait_workers(job, 2, timeout=240)
        chaos.wait_training(job, 5, timeout=240)
    return a, b


@pytest.fixture
def record() -> Iterator[dict]:
    """A scenario's measured numbers; appended as one JSON line to $SHOAL_CHAOS_RESULTS (when
    set), which docs/operations.md's failure table quotes."""
    numbers: dict = {}
    yield numbers
    if RESULTS and numbers:
        with Path(RESULTS).open("a") as out:
            out.write(json.dumps({"time": time.time(), **numbers}) + "\n")
