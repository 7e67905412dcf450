"""The same-host lane with real processes: two shard processes and three learner processes on
this host, two learners on the lane (the default) and one with ``SHOAL_SHM_LANE=off`` (gRPC
streams), in one job. The lane is used (both sides log it, each descriptor is handed once, the
headers, and the Boundaries to the coordinator's process, go on the lanes' control
connections; the two lane learners read their answers from one answer segment per shard,
mapped read-only), the job still equals single-process training (atol 1e-5), and no lane
segment of the shards has a name under /dev/shm at any time (watched while the job runs) or
after it.
The shards step each tensor as its own group (``--step-group-mb``), so the gRPC learner's
answers are sent group by group."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

import pytest
import torch

from shoal.contract.shm import PREFIX, SHM_DIR
from shoal.v1 import parameter_sync_service_pb2 as ps_pb2
from tests.integration._param_sync_cluster import DataPlane, reference_training
from tests.support import make_tokens, wait_until

BATCH, EPOCHS, ATOL = 64, 1, 1e-5
# The lane needs a writable /dev/shm (every Linux host; a container may lack one).
pytestmark = pytest.mark.skipif(
    not os.access(SHM_DIR, os.W_OK), reason=f"{SHM_DIR} is not writable here"
)
LANE_OPEN = "shared-memory lane to shard"


def memfd_fds_and_maps(pid: int, label: str) -> tuple[int, int] | None:
    """Descriptors of process ``pid`` that are memfd segments labelled ``label``, and its
    mappings of them (None where /proc does not let this user look: a non-dumpable shard,
    unless root)."""
    fds = 0
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(FileNotFoundError):
                fds += os.readlink(f"/proc/{pid}/fd/{fd}").startswith(f"/memfd:{label}")
        maps = Path(f"/proc/{pid}/maps").read_text().count(f"/memfd:{label}")
    except PermissionError:
        return None
    return fds, maps


def lane_fds_and_maps(pid: int) -> tuple[int, int] | None:
    """:func:`memfd_fds_and_maps` of the learners' lane segments."""
    return memfd_fds_and_maps(pid, "shoal-lane")


def answer_fds_and_maps(pid: int) -> tuple[int, int] | None:
    """:func:`memfd_fds_and_maps` of the job's answer segments (``param_sync/shm_lane.py``)."""
    return memfd_fds_and_maps(pid, "shoal-answer")


def sums_fds_and_maps(pid: int) -> tuple[int, int] | None:
    """:func:`memfd_fds_and_maps` of the segments a shard replicates its sums through to a
    backup on its host (``param_sync/replica_lane.py``)."""
    return memfd_fds_and_maps(pid, "shoal-sums")


def segments_of(pids: list[int]) -> list[str]:
    return [
        name
        for name in os.listdir(SHM_DIR)
        if any(name.startswith(f"{PREFIX}{pid}-") for pid in pids)
    ]


@pytest.mark.slow
def test_two_learners_on_the_lane_and_one_on_grpc_train_the_same_job_exactly(tmp_path) -> None:
    tokens = make_tokens(tmp_path / "tokens")
    plane = DataPlane(tmp_path, tmp_path / "tokens", tokens)
    # Each tensor its own step group: the gRPC learner's answers leave group by group
    # (docs/data-plane.md, "The commit, group by group"), still equal to one process.
    plane.start_shards(("--step-group-mb", "0.00001"))
    pids = [s.popen.pid for s in plane.shards]
    seen: list[str] = []
    done = threading.Event()

    def watch() -> None:  # every few ms while the job runs: a name would be seen
        while not done.wait(0.005):
            seen.extend(segments_of(pids))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        job = "lane"
        plane.open_job(job, batch=BATCH, epochs=EPOCHS)
        # Both warm before either joins: else one may train the whole epoch alone while the
        # other still imports (seen under load: the lane learner joined after the last step).
        # (--delay paces the job: the test looks at the processes while it runs.)
        gate = tmp_path / "gate"
        on = plane.start_learner(job, "lane-l0", epochs=EPOCHS, batch=BATCH, gate=gate, delay=0.1)
        off = plane.start_learner(
            job, "lane-l1", epochs=EPOCHS, batch=BATCH, gate=gate, env={"SHOAL_SHM_LANE": "off"}
        )
        also = plane.start_learner(job, "lane-l2", epochs=EPOCHS, batch=BATCH, gate=gate, delay=0.1)
        for proc in (on, off, also):
            proc.wait_for("READY", timeout=120)
        gate.touch()
        # The learner maps both lanes and holds no descriptor of them (nor does any shard once
        # the learner fetched it): none can be opened through /proc/<pid>/fd.
        # Each maps the two shards' answer segments too (read-only), and holds no descriptor
        # of them either; a shard keeps its answer segment's, for the job's next learners.
        for proc in (on, also):
            wait_until(
                lambda proc=proc: (
                    lane_fds_and_maps(proc.popen.pid) == (0, 2)
                    and answer_fds_and_maps(proc.popen.pid) == (0, 2)
                ),
                timeout=120,
                interval=0.01,
                what="the learner's two lanes and two answer segments mapped, with no descriptor",
            )
        for pid in pids:
            assert lane_fds_and_maps(pid) in (None, (0, 2)), pid  # None: not ours to look at
            assert answer_fds_and_maps(pid) in (None, (1, 1)), pid
        for proc in (on, off, also):
            assert proc.wait(timeout=300) == 0, proc.text()[-3000:]
        done.set()
        watcher.join(timeout=30)
        assert seen == []  # the segments never had a name
        # The lane was used by the learner that may, and only by it.
        assert on.text().count(LANE_OPEN) == 2, on.text()[-3000:]
        # Its headers went on the lanes' control connections (docs/data-plane.md, "The lane's
        # control channel"), not gRPC.
        assert on.text().count("its control connection carries the headers") == 2
        assert "Boundaries go on the control connection of the lane to shard" in on.text()
        assert also.text().count(LANE_OPEN) == 2, also.text()[-3000:]
        assert LANE_OPEN not in off.text()
        for shard in plane.shards:
            for learner in ("lane-l0", "lane-l2"):
                assert f"shared-memory lane of learner {learner} opened" in shard.text()
                assert shard.text().count(f"lane of learner {learner}: descriptor handed") == 1
                handed = f"answer segment, for learner {learner}: descriptor handed"
                assert shard.text().count(handed) == 1, shard.text()
            assert shard.text().count("answer segment opened") == 1
            assert "lane of learner lane-l1" not in shard.text()
            assert "lane handoff refused" not in shard.text()
            assert "not dumpable: processes of this user cannot read its memory" in shard.text()
            # Its sums reached its backup (the other shard, on this host) through shared
            # memory: the segment's descriptor handed once, and once more where the first
            # snapshot did not fit the room the segment has beyond the sums (it depends on
            # the slice's size: docs/data-plane.md, "The replica's steps deferred"), and held
            # by neither side after.
            handed = shard.text().count("for its backup: descriptor handed")
            assert handed in (1, 2), shard.text()
            assert "sums to" not in shard.text()  # never fell back to chunks
            # Each backup answered at once and took the sums and the snapshots out of the
            # slot afterwards, every one whole (none rewritten while taken), and deferred the
            # replica's steps.
            assert "did not take sums" not in shard.text()
            assert "did not take a snapshot" not in shard.text()
            assert "kept here defers its steps" in shard.text()
        for pid in pids:
            assert sums_fds_and_maps(pid) in (None, (0, 2)), pid  # its own and its primary's
        # Exactly plain PyTorch.
        reference, _ = reference_training(EPOCHS, BATCH)
        model = plane.final_model(job)
        for name, value in reference.items():
            torch.testing.assert_close(model[name], value, atol=ATOL, rtol=0, msg=name)
        # After the job nothing is left: every lane closed, no segment under /dev/shm.
        plane.call("CloseJob", ps_pb2.CloseJobRequest(job_id=job))
        for shard in plane.shards:
            wait_until(
                lambda shard=shard: (
                    "lane of learner lane-l0 closed" in shard.text()
                    and "control of learner lane-l0's lane closed after" in shard.text()
                    and "answer segment closed" in shard.text()
                ),
                timeout=30,
                interval=0.1,
                what="the lane closed",
            )
        assert segments_of(pids) == []
        for pid in pids:  # the sums segments went with the job too
            wait_until(
                lambda pid=pid: sums_fds_and_maps(pid) in (None, (0, 0)),
                timeout=30,
                interval=0.1,
                what="the sums segments unmapped",
            )
    finally:
        done.set()
        plane.kill_all()


@pytest.mark.slow
def test_sums_go_as_chunks_to_and_from_a_shard_with_the_lane_off(tmp_path) -> None:
    """Shard 1 runs with ``--shm-lane off``: shard 0's sums reach it as gRPC chunks (it
    refuses the segment, once), shard 1 sends its own as chunks (it tries no segment), and
    the job still equals single-process training."""
    tokens = make_tokens(tmp_path / "tokens")
    plane = DataPlane(tmp_path, tmp_path / "tokens", tokens)
    plane.start_shards(env={1: {"SHOAL_SHM_LANE": "off"}})
    try:
        job = "lane-off"
        plane.open_job(job, batch=BATCH, epochs=EPOCHS)
        learner = plane.start_learner(job, "l0", epochs=EPOCHS, batch=BATCH)
        assert learner.wait(timeout=300) == 0, learner.text()[-3000:]
        first, second = (shard.text() for shard in plane.shards)
        assert first.count("as chunks: ") == 1, first[-3000:]  # refused once, then remembered
        assert "for its backup: descriptor handed" not in first + second
        assert "sums to" not in second
        reference, _ = reference_training(EPOCHS, BATCH)
        model = plane.final_model(job)
        for name, value in reference.items():
            torch.testing.assert_close(model[name], value, atol=ATOL, rtol=0, msg=name)
    finally:
        plane.kill_all()
