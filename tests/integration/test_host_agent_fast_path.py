"""The host agent's fast path with real learner processes (issue 16): a job's artifact unpacked
ahead for its next learner on the host (per job, verified, never shared across jobs); a retired
learner's device finds a fresh warm process that holds nothing of the retired job; the fast
exit still runs the script's own finalizers; a learner's exit reported to the resource manager
at once, not with the next heartbeat."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from grpc import aio

from shoal.host_agent.processes import read_log
from shoal.v1 import (
    resource_manager_service_pb2 as rm,
    resource_manager_service_pb2_grpc as rm_grpc,
    resources_pb2,
)
from tests.integration._shoal_processes import pack_artifact
from tests.integration.test_host_agent import AgentBed, first_line, start_request
from tests.support import async_wait_until

# Prints what it finds in its working directory, leaves a file of its own there, then waits
# until the file named by RELEASE exists (the test lets it go) and exits 0 as a trained learner.
HOLD = """
import json, os, sys, time
print(json.dumps({"files": sorted(os.listdir(".")), "job": os.environ["SHOAL_JOB_ID"]}))
sys.stdout.flush()
open("mine.txt", "w").write(os.environ["SHOAL_LEARNER_ID"])
open(os.environ["SHOAL_TRAIN_MARKER"], "w").close()
deadline = time.monotonic() + 300  # a bound: a test that never lets it go fails, not hangs
while not os.path.exists(os.environ["RELEASE"]):  # the condition; 0.02 s is its poll interval
    if time.monotonic() > deadline:
        sys.exit("RELEASE never appeared in 300 s")
    time.sleep(0.02)
"""
FILES = {"main.py": HOLD, "data/x.txt": "x"}


@pytest.fixture
async def bed(tmp_path) -> AsyncIterator[AgentBed]:
    bed = await AgentBed(tmp_path).start()
    try:
        yield bed
    finally:
        await bed.close()


def prepared(bed: AgentBed):
    return bed.agent.processes.prepared


async def files_seen(stub, learner_id: str) -> dict:
    return json.loads(await first_line(stub, learner_id, "{"))


async def test_a_jobs_next_learner_takes_a_copy_unpacked_ahead_and_no_other_job_does(bed, tmp_path):
    artifact = pack_artifact(bed.artifacts, FILES)
    release = tmp_path / "release"
    env = {"RELEASE": str(release)}
    stub = bed.stub()
    await stub.StartLearner(start_request(artifact, env=env))
    learner1 = bed.agent.processes.get("l1")
    assert not learner1.unpacked_ahead  # the first learner of the job on the host unpacks
    # As soon as the job is placed here, a copy is made for its next learner.
    await async_wait_until(
        lambda: prepared(bed).ready("j1", artifact), timeout=60, what="a copy unpacked ahead"
    )
    assert (await files_seen(stub, "l1"))["files"] == ["data", "main.py"]

    # The job grows on this host: its learner takes the copy (a rename), not an unpack.
    await stub.StartLearner(start_request(artifact, learner_id="l2", device="gpu1", env=env))
    learner2 = bed.agent.processes.get("l2")
    assert learner2.unpacked_ahead and prepared(bed).taken == 1
    # Its own tree: nothing the first learner wrote into its working directory.
    assert (await files_seen(stub, "l2"))["files"] == ["data", "main.py"]
    work1, work2 = learner1.directory / "work", learner2.directory / "work"
    await async_wait_until(lambda: (work2 / "mine.txt").exists(), timeout=60, what="l2 wrote")
    assert (work1 / "mine.txt").read_text() == "l1" and (work2 / "mine.txt").read_text() == "l2"
    # ...and the next copy is made at once.
    await async_wait_until(
        lambda: prepared(bed).ready("j1", artifact), timeout=60, what="the next copy"
    )

    # Another job with the same artifact never gets job j1's copy: it unpacks its own.
    release.touch()
    await async_wait_until(
        lambda: learner1.terminal and learner2.terminal, timeout=60, what="both exited"
    )
    release.unlink()
    await stub.StartLearner(start_request(artifact, learner_id="l3", job_id="j2", env=env))
    learner3 = bed.agent.processes.get("l3")
    assert not learner3.unpacked_ahead
    assert (await files_seen(stub, "l3")) == {"files": ["data", "main.py"], "job": "j2"}
    assert prepared(bed).ready("j1", artifact)  # still j1's, untouched
    assert prepared(bed).taken == 1

    # A job with no learner left on the host has its copies removed after the linger.
    prepared(bed).linger_s = 0.1
    release.touch()
    await async_wait_until(lambda: learner3.terminal, timeout=60, what="l3 exited")
    await async_wait_until(
        lambda: not prepared(bed).job_dir("j2").exists(), timeout=30, what="j2's copies gone"
    )
    # (j1's linger began at its exit with the default: it is still kept.)
    assert prepared(bed).ready("j1", artifact)


async def test_a_copy_is_made_only_from_an_archive_whose_sha256_still_matches(bed, tmp_path):
    artifact = pack_artifact(bed.artifacts, FILES)
    release = tmp_path / "release"
    env = {"RELEASE": str(release)}
    stub = bed.stub()
    await stub.StartLearner(start_request(artifact, env=env))
    await async_wait_until(
        lambda: prepared(bed).ready("j1", artifact), timeout=60, what="a copy unpacked ahead"
    )
    # The cached archive changes on disk: the copy made from it before is used, but no new
    # copy is made from the changed bytes, and the archive is dropped (fetched again later).
    cached = bed.agent.processes.artifacts.path(artifact)
    cached.write_bytes(b"not the artifact")
    made = prepared(bed).made
    await stub.StartLearner(start_request(artifact, learner_id="l2", device="gpu1", env=env))
    assert bed.agent.processes.get("l2").unpacked_ahead
    await async_wait_until(lambda: not cached.exists(), timeout=60, what="the archive dropped")
    assert not prepared(bed).ready("j1", artifact) and prepared(bed).made == made

    release.touch()
    await async_wait_until(
        lambda: all(lr.terminal for lr in bed.agent.processes.learners()),
        timeout=60,
        what="both exited",
    )
    release.unlink()
    # The next start fetches the archive again (verified) and unpacks it itself.
    await stub.StartLearner(start_request(artifact, learner_id="l3", env=env))
    assert not bed.agent.processes.get("l3").unpacked_ahead
    assert (await files_seen(stub, "l3"))["files"] == ["data", "main.py"]
    assert cached.is_file()
    release.touch()
    await async_wait_until(
        lambda: bed.agent.processes.get("l3").state == resources_pb2.LEARNER_STATE_SUCCEEDED,
        timeout=60,
        what="l3 succeeded",
    )


def test_leftover_copies_of_a_previous_agent_are_removed_at_start(tmp_path: Path):
    async def main() -> None:
        bed = AgentBed(tmp_path)
        leftover = bed.config.work_dir / "prepared" / "j-old" / ("0" * 64)
        leftover.mkdir(parents=True)
        await bed.start()
        try:
            assert not leftover.exists()
        finally:
            await bed.close()

    asyncio.run(main())


# Job A's learner: imports a module of its artifact that keeps its credential, holds until let
# go, then returns (a retired learner: its script ends). Job B's learner reports what it sees.
A_MAIN = """
import os, sys, time
import a_private
a_private.SECRET = os.environ["SHOAL_TOKEN"]
open(os.environ["SHOAL_TRAIN_MARKER"], "w").close()
deadline = time.monotonic() + 300  # a bound: a test that never lets it go fails, not hangs
while not os.path.exists(os.environ["RELEASE"]):  # the condition; 0.02 s is its poll interval
    if time.monotonic() > deadline:
        sys.exit("RELEASE never appeared in 300 s")
    time.sleep(0.02)
"""
B_MAIN = """
import json, os, sys
print(json.dumps({
    "pid": os.getpid(),
    "modules": sorted(m for m in sys.modules if m.startswith("a_")),
    "token": os.environ.get("SHOAL_TOKEN"),
    "env_a": sorted(k for k, v in os.environ.items() if "job-a" in v),
    "files": sorted(os.listdir(".")),
}))
open(os.environ["SHOAL_TRAIN_MARKER"], "w").close()
"""


@pytest.mark.slow
async def test_a_retired_learners_device_finds_a_fresh_warm_process_holding_nothing_of_its_job(
    tmp_path,
):
    from tests.integration.test_warm_learners import READY_TIMEOUT_S, WarmBed

    bed = await WarmBed(tmp_path, warm=1).start()
    try:
        pool = bed.pool
        (first,) = await bed.ready()
        a = pack_artifact(bed.artifacts, {"main.py": A_MAIN, "a_private.py": "SECRET = None\n"})
        b = pack_artifact(bed.artifacts, {"main.py": B_MAIN})
        release = tmp_path / "release"
        stub = bed.stub()
        reply = await stub.StartLearner(
            start_request(
                a,
                learner_id="la",
                job_id="job-a",
                env={"RELEASE": str(release), "SHOAL_TOKEN": "token-of-job-a"},
            )
        )
        assert reply.learner.pid == first  # job A started warm
        # The pool refills while A runs: the device's next learner will not wait for one.
        await async_wait_until(
            lambda: pool.ready() == 1, timeout=READY_TIMEOUT_S, what="the pool refilled"
        )
        (fresh,) = [w.pid for w in pool._ready]
        release.touch()  # A retires: its script ends, the process exits
        learner_a = bed.agent.processes.get("la")
        await async_wait_until(lambda: learner_a.terminal, timeout=60, what="A exited")
        assert learner_a.state == resources_pb2.LEARNER_STATE_SUCCEEDED

        # Job B on the same device, right after: warm, in a process that never ran job A.
        reply = await stub.StartLearner(
            start_request(b, learner_id="lb", job_id="job-b", env={"SHOAL_TOKEN": "token-b"})
        )
        assert reply.learner.pid == fresh != first
        seen = json.loads(await first_line(stub, "lb", "{"))
        assert seen["pid"] == fresh
        assert seen["modules"] == [] and seen["env_a"] == []
        assert seen["token"] == "token-b" and seen["files"] == ["main.py"]
        assert pool.taken == 2
    finally:
        await bed.close()


# A learner that leaves work to finalization: its own weakref.finalize (atexit) and a
# tempfile.TemporaryDirectory, with torch's operator libraries loaded.
FINALIZERS = """
import os, tempfile, weakref
import torch.library

class Thing:
    pass

thing = Thing()
weakref.finalize(thing, print, "the script's finalizer ran")
kept = tempfile.TemporaryDirectory(dir=".")
print("tmp", os.path.basename(kept.name), flush=True)
open(os.environ["SHOAL_TRAIN_MARKER"], "w").close()
"""


async def test_the_fast_exit_still_runs_the_scripts_own_finalizers(bed):
    artifact = pack_artifact(bed.artifacts, {"main.py": FINALIZERS})
    stub = bed.stub()
    await stub.StartLearner(start_request(artifact))
    learner = bed.agent.processes.get("l1")
    await async_wait_until(lambda: learner.terminal, timeout=120, what="the learner exited")
    assert learner.exit_code == 0, learner.exit_reason
    lines = [r.text for r in read_log(learner.log_path, 0)]
    assert "the script's finalizer ran" in lines
    (tmp,) = [t.split()[1] for t in lines if t.startswith("tmp ")]
    assert not (learner.directory / "work" / tmp).exists()  # removed by its finalizer


class BeatRecorder(rm_grpc.ResourceManagerServiceServicer):
    """A resource manager that asks for one heartbeat an hour and records those it gets."""

    def __init__(self) -> None:
        self.beats: list[rm.HeartbeatRequest] = []

    async def RegisterHost(self, request, context):
        return rm.RegisterHostResponse(
            incarnation=1, heartbeat_interval_ms=3_600_000, lost_after_ms=36_000_000
        )

    async def Heartbeat(self, request_iterator, context):
        async for beat in request_iterator:
            self.beats.append(beat)
            yield rm.HeartbeatResponse(sequence=beat.sequence)


async def test_a_learners_exit_is_reported_at_once_not_with_the_next_heartbeat(tmp_path):
    recorder = BeatRecorder()
    server = aio.server()
    rm_grpc.add_ResourceManagerServiceServicer_to_server(recorder, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    bed = AgentBed(tmp_path)
    bed.config = dataclasses.replace(bed.config, resource_managers=(f"127.0.0.1:{port}",))
    await bed.start()
    try:
        await async_wait_until(lambda: recorder.beats, timeout=30, what="the first heartbeat")
        artifact = pack_artifact(bed.artifacts, FILES)
        release = tmp_path / "release"
        await bed.stub().StartLearner(start_request(artifact, env={"RELEASE": str(release)}))
        await asyncio.sleep(0)
        release.touch()

        def exit_reported() -> bool:
            return any(
                lr.learner_id == "l1" and lr.state == resources_pb2.LEARNER_STATE_SUCCEEDED
                for beat in recorder.beats
                for lr in beat.learners
            )

        # The next regular heartbeat is an hour away: only the exit itself can send this one.
        await async_wait_until(exit_reported, timeout=60, what="the exit in a heartbeat")
        assert len(recorder.beats) == 2 and recorder.beats[1].sequence == 2
    finally:
        await bed.close()
        await server.stop(0)


async def test_a_jobs_copies_dropped_while_one_is_being_unpacked_leave_nothing_behind(tmp_path):
    from shoal.host_agent.artifacts import ArtifactCache, DirectorySource
    from shoal.host_agent.prepared import PreparedArtifacts

    source = tmp_path / "artifacts"
    artifact = pack_artifact(
        source,
        {"main.py": "print(1)\n", **{f"data/{i}.bin": os.urandom(1 << 20) for i in range(32)}},
    )
    cache = ArtifactCache(tmp_path / "cache", [DirectorySource(str(source))])
    await cache.get(artifact)
    prepared = PreparedArtifacts(tmp_path / "prepared", cache)
    prepared.linger_s = 0.0
    try:
        prepared.prepare("j1", artifact)
        await async_wait_until(  # an unpack runs in a thread...
            lambda: any(prepared.job_dir("j1").glob(".*.part/data")),
            timeout=60,
            interval=0.005,
            what="the unpack under way",
        )
        prepared.release("j1")  # ...and the job leaves the host
        await async_wait_until(
            lambda: not prepared._tasks and not prepared._lingering and not prepared._removing,
            timeout=60,
            what="the unpack and the drop done",
        )
        assert not prepared.job_dir("j1").exists()
        assert [p.name for p in (tmp_path / "prepared").iterdir()] == []
    finally:
        await prepared.close()
