"""The host agent with real learner processes: the environment contract, logs, exits, stopping a
learner that ignores SIGTERM, bad requests, artifact download from the scheduler, the agent's
death, and exits reported to a real resource manager."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import tenacity
from google.protobuf import duration_pb2
from grpc import aio

from shoal.host_agent.devices import SimulatedDevices
from shoal.host_agent.processes import read_log
from shoal.host_agent.service import ERRORS, HostAgent, HostAgentConfig, bindings
from shoal.runtime.auth import USERS_AND_SERVICES, MethodRoles
from shoal.runtime.channels import connect
from shoal.runtime.config import ServerConfig
from shoal.runtime.errors import DEFAULT_TABLE, REASON_METADATA_KEY, NotFound, NotLeader
from shoal.runtime.server import ServiceBinding, create_server
from shoal.runtime.store import EtcdStore
from shoal.v1 import (
    host_agent_service_pb2 as ha,
    host_agent_service_pb2_grpc as ha_grpc,
    job_scheduler_service_pb2 as js,
    job_scheduler_service_pb2_grpc as js_grpc,
    resource_manager_service_pb2 as rm,
    resources_pb2,
)
from tests.integration._shoal_processes import ShoalProcesses, pack_artifact
from tests.integration.test_resource_manager import Scheduler, expect_error, metadata
from tests.support import async_wait_until, make_tokens

HERE = Path(__file__).parent
IGNORE_SIGTERM = (HERE / "_ignore_sigterm.py").read_text()
REPORT_ENV = (HERE / "_report_env.py").read_text()
SUCCEEDED = resources_pb2.LEARNER_STATE_SUCCEEDED
FAILED = resources_pb2.LEARNER_STATE_FAILED


def alive(pid: int) -> bool:
    """Whether the process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat[stat.rfind(")") + 2] != "Z"


async def log_lines(stub, learner_id: str, *, follow: bool = True, offset: int = 0):
    lines = []
    async for reply in stub.StreamLearnerLogs(
        ha.StreamLearnerLogsRequest(learner_id=learner_id, offset=offset, follow=follow),
        timeout=30,
    ):
        lines.extend(reply.lines)
    return lines


async def first_line(stub, learner_id: str, prefix: str) -> str:
    """Follow the learner's log until a line starts with ``prefix``."""
    call = stub.StreamLearnerLogs(
        ha.StreamLearnerLogsRequest(learner_id=learner_id, follow=True), timeout=30
    )
    async for reply in call:
        for line in reply.lines:
            if line.text.startswith(prefix):
                call.cancel()
                return line.text
    raise AssertionError(f"learner {learner_id} exited without printing {prefix!r}")


class AgentBed:
    """A host agent in this process (two simulated GPUs), artifacts in a local directory."""

    def __init__(self, tmp: Path, schedulers: tuple[str, ...] = (), artifact_dir: bool = True):
        self.tmp = tmp
        self.tokens_file = tmp / "tokens"
        self.tokens = make_tokens(self.tokens_file)
        self.artifacts = tmp / "artifacts"
        self.config = HostAgentConfig(
            server=ServerConfig(
                "host-agent",
                tokens_file=str(self.tokens_file),
                service_token=self.tokens["service"],
            ),
            host_id="h1",
            work_dir=tmp / "agent",
            artifact_dir=str(self.artifacts) if artifact_dir else None,
            schedulers=schedulers,
            simulate_gpus=2,
            stop_grace_s=2.0,
        )
        self.channels: list[aio.Channel] = []

    async def start(self) -> AgentBed:
        self.agent = HostAgent(self.config, SimulatedDevices("h1", 2))
        self.running = await create_server(self.config.server, bindings(self.agent), errors=ERRORS)
        self.agent.start(self.running.address)
        return self

    def stub(self, role: str = "service") -> ha_grpc.HostAgentServiceStub:
        channel = connect(self.running.address, token=self.tokens[role], trace=False)
        self.channels.append(channel)
        return ha_grpc.HostAgentServiceStub(channel)

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()
        await self.agent.close(0.5)
        await self.running.stop(0)


@pytest.fixture
async def bed(tmp_path) -> AsyncIterator[AgentBed]:
    bed = await AgentBed(tmp_path).start()
    try:
        yield bed
    finally:
        await bed.close()


def start_request(artifact_id: str, learner_id: str = "l1", device: str = "gpu0", **kw):
    return ha.StartLearnerRequest(
        learner_id=learner_id,
        job_id=kw.pop("job_id", "j1"),
        device_id=device,
        artifact_id=artifact_id,
        entry_point=kw.pop("entry_point", "main.py"),
        **kw,
    )


async def test_a_learner_runs_its_artifact_with_the_environment_contract_and_its_logs_stream(bed):
    artifact = pack_artifact(bed.artifacts, {"main.py": REPORT_ENV, "data/x.txt": "x"})
    stub = bed.stub()
    reply = await stub.StartLearner(
        start_request(artifact, args=["3"], env={"FOO": "bar"}, allocation_id="a-1")
    )
    assert reply.learner.state == resources_pb2.LEARNER_STATE_RUNNING
    assert reply.learner.pid > 0 and reply.learner.device_id == "gpu0"
    lines = await log_lines(stub, "l1")
    stdout = [x.text for x in lines if x.stream == resources_pb2.LOG_STREAM_STDOUT]
    stderr = [x.text for x in lines if x.stream == resources_pb2.LOG_STREAM_STDERR]
    env = json.loads(stdout[0])
    assert env["SHOAL_JOB_ID"] == "j1" and env["SHOAL_LEARNER_ID"] == "l1"
    assert env["SHOAL_HOST_ID"] == "h1" and env["SHOAL_DEVICE_ID"] == "gpu0"
    assert env["SHOAL_ALLOCATION_ID"] == "a-1" and env["FOO"] == "bar"
    assert env["CUDA_VISIBLE_DEVICES"] == ""  # simulated: the learner runs on the CPU
    assert env["SHOAL_SERVICE_TOKEN"] is None  # the agent's secrets are not inherited
    assert stdout[1] == "cwd work ['data', 'main.py']"
    # No service credential anywhere in the learner's environment or argv.
    assert stdout[2].startswith("environment ")
    assert bed.tokens["service"] not in stdout[2] and bed.tokens["admin"] not in stdout[2]
    assert stderr == ["to stderr"]
    offsets = [x.offset for x in lines]
    assert offsets == sorted(offsets) and offsets[0] == 0
    # Resume after the first line.
    rest = await log_lines(stub, "l1", follow=False, offset=lines[0].offset + 1)
    assert [x.text for x in rest] == [x.text for x in lines[1:]]

    (learner,) = (await stub.ListLearners(ha.ListLearnersRequest())).learners
    assert learner.state == FAILED and learner.exit_code == 3
    assert learner.exit_reason == "exited with code 3"
    assert learner.end_time.seconds >= learner.start_time.seconds > 0
    # Starting the same learner id again returns it, as it is.
    again = await stub.StartLearner(start_request(artifact, args=["3"]))
    assert again.learner.exit_code == 3
    assert (await stub.ListLearners(ha.ListLearnersRequest(job_id="other"))).learners == []


async def test_stop_learner_kills_the_whole_group_of_a_learner_that_ignores_sigterm(bed):
    artifact = pack_artifact(bed.artifacts, {"main.py": IGNORE_SIGTERM})
    stub = bed.stub()
    await stub.StartLearner(start_request(artifact, device="gpu1"))
    _, pid, child = (await first_line(stub, "l1", "ready")).split()
    pids = [int(pid), int(child)]
    assert all(alive(p) for p in pids)
    grace = 0.5
    started = time.monotonic()
    reply = await stub.StopLearner(
        ha.StopLearnerRequest(learner_id="l1", grace=duration_pb2.Duration(nanos=500_000_000))
    )
    took = time.monotonic() - started
    assert reply.learner.state == FAILED
    assert reply.learner.exit_code == -9
    assert "SIGKILL" in reply.learner.exit_reason and "StopLearner" in reply.learner.exit_reason
    assert grace <= took < grace + 5
    await async_wait_until(lambda: not any(alive(p) for p in pids), timeout=5, what="group gone")
    # Stopping it again returns it; the device is free again.
    again = await stub.StopLearner(ha.StopLearnerRequest(learner_id="l1"))
    assert again.learner.exit_code == -9
    await stub.StartLearner(start_request(artifact, learner_id="l2", device="gpu1"))
    await first_line(stub, "l2", "ready")
    short = duration_pb2.Duration(nanos=200_000_000)
    stopped = await stub.StopLearner(ha.StopLearnerRequest(learner_id="l2", grace=short))
    assert stopped.learner.exit_code == -9
    # A grace out of range (a huge one overflowed the timer: INTERNAL) is refused by name.
    for bad in (duration_pb2.Duration(seconds=2**62), duration_pb2.Duration(seconds=-1)):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.StopLearner(ha.StopLearnerRequest(learner_id="l2", grace=bad))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "grace" in (refused.value.details() or "")


async def test_bad_start_requests_are_refused_with_clear_errors_and_change_nothing(bed):
    artifact = pack_artifact(bed.artifacts, {"main.py": IGNORE_SIGTERM})
    stub = bed.stub()
    await stub.StartLearner(start_request(artifact, learner_id="busy", device="gpu0"))
    learners_dir = bed.config.work_dir / "learners"
    before_dirs = sorted(p.name for p in learners_dir.iterdir())

    cases = [
        (start_request(artifact, learner_id=""), grpc.StatusCode.INVALID_ARGUMENT, "learner_id"),
        (start_request(artifact, job_id=""), grpc.StatusCode.INVALID_ARGUMENT, "job_id"),
        (start_request(artifact, device=""), grpc.StatusCode.INVALID_ARGUMENT, "device_id"),
        (start_request("nothex"), grpc.StatusCode.INVALID_ARGUMENT, "artifact_id"),
        (start_request(artifact, entry_point=""), grpc.StatusCode.INVALID_ARGUMENT, "entry_point"),
        (
            start_request(artifact, entry_point="../../etc/passwd"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "entry_point",
        ),
        (
            start_request(artifact, device="gpu1", entry_point="missing.py"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "is not a file in artifact",
        ),
        (start_request(artifact, device="gpu7"), grpc.StatusCode.NOT_FOUND, "'gpu7'"),
        (start_request(artifact, device="gpu0"), grpc.StatusCode.FAILED_PRECONDITION, "'busy'"),
        (
            start_request(artifact, learner_id="busy", device="gpu1"),
            grpc.StatusCode.FAILED_PRECONDITION,
            "already exists",
        ),
        (start_request("0" * 64, device="gpu1"), grpc.StatusCode.NOT_FOUND, "artifact"),
    ]
    reasons = {}
    for request, code, word in cases:
        exc = await expect_error(stub.StartLearner(request), code, word)
        reasons[word] = metadata(exc, REASON_METADATA_KEY)
    assert reasons["'gpu7'"] == "ERROR_REASON_DEVICE_NOT_FOUND"
    assert reasons["'busy'"] == "ERROR_REASON_DEVICE_BUSY"
    assert reasons["artifact"] == "ERROR_REASON_ARTIFACT_NOT_FOUND"
    assert reasons["learner_id"] == "ERROR_REASON_INVALID_FIELD"

    # Fencing: once a newer scheduler token was seen, an older one is refused.
    newer = resources_pb2.FencingToken(election="job-scheduler", revision=20)
    older = resources_pb2.FencingToken(election="job-scheduler", revision=10)
    await stub.StartLearner(
        start_request(artifact, learner_id="fenced", device="gpu1", fencing_token=newer)
    )
    await stub.StopLearner(ha.StopLearnerRequest(learner_id="fenced"))
    exc = await expect_error(
        stub.StartLearner(
            start_request(artifact, learner_id="old", device="gpu1", fencing_token=older)
        ),
        grpc.StatusCode.FAILED_PRECONDITION,
        "older",
    )
    assert metadata(exc, REASON_METADATA_KEY) == "ERROR_REASON_FENCED_OUT"

    exc = await expect_error(
        stub.StopLearner(ha.StopLearnerRequest(learner_id="nope")), grpc.StatusCode.NOT_FOUND
    )
    assert metadata(exc, REASON_METADATA_KEY) == "ERROR_REASON_LEARNER_NOT_FOUND"
    await expect_error(stub.StopLearner(ha.StopLearnerRequest()), grpc.StatusCode.INVALID_ARGUMENT)
    await expect_error(log_lines(stub, "nope"), grpc.StatusCode.NOT_FOUND)
    await expect_error(
        bed.stub("user").StartLearner(start_request(artifact, learner_id="u", device="gpu1")),
        grpc.StatusCode.PERMISSION_DENIED,
    )

    learners = {x.learner_id for x in (await stub.ListLearners(ha.ListLearnersRequest())).learners}
    assert learners == {"busy", "fenced"}
    after_dirs = sorted(p.name for p in learners_dir.iterdir())
    assert after_dirs == sorted([*before_dirs, "l-fenced"])
    devices = (await stub.GetDeviceStatus(ha.GetDeviceStatusRequest())).devices
    assert [d.device_id for d in devices] == ["gpu0", "gpu1"]


class FakeScheduler(js_grpc.JobSchedulerServiceServicer):
    """DownloadArtifact from blobs, counting downloads; a standby points at the leader."""

    def __init__(self, blobs: dict[str, bytes], leader: str | None = None) -> None:
        self.blobs = blobs
        self.leader = leader
        self.downloads = 0

    async def DownloadArtifact(self, request, context):
        if self.leader is not None:
            raise NotLeader("job-scheduler", self.leader)
        blob = self.blobs.get(request.artifact_id)
        if blob is None:
            raise NotFound(
                "artifact", request.artifact_id, reason="ERROR_REASON_ARTIFACT_NOT_FOUND"
            )
        self.downloads += 1
        yield js.DownloadArtifactResponse(
            header=js.ArtifactHeader(name="model", size_bytes=len(blob), sha256=request.artifact_id)
        )
        for i in range(0, len(blob), 1000):
            yield js.DownloadArtifactResponse(chunk=blob[i : i + 1000])


async def test_artifacts_are_downloaded_from_the_scheduler_leader_once(tmp_path):
    staging = tmp_path / "staging"
    artifact = pack_artifact(staging, {"main.py": REPORT_ENV, "pad.bin": "x" * 5000})
    blobs = {artifact: (staging / f"{artifact}.tar.gz").read_bytes()}
    config = ServerConfig("scheduler", allow_no_auth=True)
    servers = []
    leader = FakeScheduler(blobs)
    servers.append(
        await create_server(
            config,
            [
                ServiceBinding(
                    "shoal.v1.JobSchedulerService",
                    js_grpc.add_JobSchedulerServiceServicer_to_server,
                    leader,
                    MethodRoles("shoal.v1.JobSchedulerService", USERS_AND_SERVICES),
                )
            ],
            errors=DEFAULT_TABLE,
        )
    )
    standby = FakeScheduler({}, leader=servers[0].address)
    servers.append(
        await create_server(
            config,
            [
                ServiceBinding(
                    "shoal.v1.JobSchedulerService",
                    js_grpc.add_JobSchedulerServiceServicer_to_server,
                    standby,
                    MethodRoles("shoal.v1.JobSchedulerService", USERS_AND_SERVICES),
                )
            ],
        )
    )
    bed = await AgentBed(tmp_path, schedulers=(servers[1].address,), artifact_dir=False).start()
    try:
        stub = bed.stub()
        await stub.StartLearner(start_request(artifact, learner_id="a", device="gpu0"))
        await stub.StartLearner(start_request(artifact, learner_id="b", device="gpu1"))
        assert leader.downloads == 1  # cached for the second learner
        lines = await log_lines(stub, "b")
        assert lines[1].text == "cwd work ['main.py', 'pad.bin']"
        await log_lines(stub, "a")  # until it exited: gpu0 is free
        await expect_error(
            stub.StartLearner(start_request("1" * 64, learner_id="c", device="gpu0")),
            grpc.StatusCode.NOT_FOUND,
            "artifact",
        )
    finally:
        await bed.close()
        for server in servers:
            await server.stop(0)


def test_log_offsets_resume_at_the_next_whole_line(tmp_path):
    path = tmp_path / "output.log"
    path.write_bytes(b"1 first\n2 second line\n1 third\n1 partial")
    records = read_log(path, 0)
    assert [(r.offset, r.stream, r.text) for r in records] == [
        (0, 1, "first"),
        (8, 2, "second line"),
        (22, 1, "third"),
    ]
    assert [r.text for r in read_log(path, 1)] == ["second line", "third"]
    assert [r.text for r in read_log(path, 8)] == ["second line", "third"]
    assert [r.text for r in read_log(path, 9)] == ["third"]
    assert read_log(path, 10_000) == []
    assert read_log(tmp_path / "missing.log", 0) == []


# --------------------------------------------------------------------------------------------
# Real processes
# --------------------------------------------------------------------------------------------


@pytest.fixture
async def shoal(tmp_path) -> AsyncIterator[ShoalProcesses]:
    procs = ShoalProcesses(tmp_path)
    try:
        yield procs
    finally:
        await procs.close()


async def _answers(stub) -> bool:
    try:
        await stub.ListLearners(ha.ListLearnersRequest(), timeout=2)
    except aio.AioRpcError:
        return False
    return True


@pytest.mark.slow
async def test_learners_die_with_a_killed_agent_and_a_restarted_agent_starts_clean(shoal):
    artifact = pack_artifact(shoal.artifact_dir, {"main.py": IGNORE_SIGTERM})
    agent = shoal.host_agent("h1", [])  # no resource manager needed
    stub = shoal.agent_stub(agent.address)
    await async_wait_until(lambda: _answers(stub), timeout=30, what="the agent")
    await stub.StartLearner(start_request(artifact))
    _, pid, child = (await first_line(stub, "l1", "ready")).split()
    learner, grandchild = int(pid), int(child)

    agent.kill()
    await async_wait_until(lambda: not alive(learner), timeout=5, what="the learner to die")
    # The learner's own child is not the agent's: the next agent start kills what is left.
    agent.start()
    await async_wait_until(lambda: _answers(stub), timeout=30, what="the restarted agent")
    await async_wait_until(lambda: not alive(grandchild), timeout=5, what="the leftover child")
    assert (await stub.ListLearners(ha.ListLearnersRequest())).learners == []
    assert list((shoal.tmp / "agent-h1" / "learners").iterdir()) == []


@pytest.mark.slow
async def test_learner_exits_reach_the_resource_manager_once_and_untrusted_learners_are_stopped(
    shoal, etcd
):
    store = EtcdStore(etcd.endpoints, timeout=3)
    sched = Scheduler(store, "sched-a")
    try:
        token = await sched.lead()
        manager = shoal.resource_manager(etcd.endpoints)
        agent = shoal.host_agent("h1", [manager.address])
        rm_stub = shoal.rm_stub(manager.address)
        agent_stub = shoal.agent_stub(agent.address)

        async def registered() -> bool:
            try:
                await rm_stub.GetHost(rm.GetHostRequest(host_id="h1"), timeout=2)
            except aio.AioRpcError:
                return False
            return True

        await async_wait_until(registered, timeout=30, what="h1 registered")
        watch = shoal.rm_stub(manager.address, "user").WatchInventory(rm.WatchInventoryRequest())
        assert (await watch.read()).kind == rm.INVENTORY_EVENT_KIND_SNAPSHOT
        held = await rm_stub.AcquireDevices(
            rm.AcquireDevicesRequest(
                fencing_token=token,
                claims=[
                    rm.DeviceClaim(job_id="j1", learner_id="l1", host_id="h1", device_id="gpu0")
                ],
            )
        )
        report = pack_artifact(shoal.artifact_dir, {"main.py": REPORT_ENV})
        await agent_stub.StartLearner(
            start_request(
                report,
                args=["3"],
                allocation_id=held.allocations[0].allocation_id,
                fencing_token=token,
            )
        )
        lines = await log_lines(agent_stub, "l1")
        env = json.loads(lines[0].text)
        assert env["TRACEPARENT"] and env["TRACEPARENT"].startswith("00-")
        # A learner the ledger does not know ("rogue") is stopped on the resource manager's word.
        sleeper = pack_artifact(shoal.artifact_dir, {"main.py": IGNORE_SIGTERM})
        await agent_stub.StartLearner(start_request(sleeper, learner_id="rogue", device="gpu1"))

        exits: list[resources_pb2.Learner] = []
        while not any(x.learner_id == "rogue" for x in exits):
            event = await asyncio.wait_for(watch.read(), 30)
            if event.kind == rm.INVENTORY_EVENT_KIND_LEARNER_EXITED:
                exits.append(event.learner)
        watch.cancel()
        assert [x.learner_id for x in exits] == ["l1", "rogue"]  # l1 once, though beats went on
        l1, rogue = exits
        assert l1.exit_code == 3 and l1.state == FAILED and l1.host_id == "h1"
        assert l1.exit_reason == "exited with code 3" and l1.host_incarnation == 1
        # SIGKILL after the grace, or SIGTERM when the stop came before the script got to
        # ignore it (the first heartbeat after the start can be that quick).
        assert rogue.exit_code in (-9, -15) and "no allocation" in rogue.exit_reason
        listed = {
            x.learner_id: x
            for x in (await agent_stub.ListLearners(ha.ListLearnersRequest())).learners
        }
        assert listed["l1"].exit_code == 3 and listed["rogue"].state == FAILED
        # The agent stops every learner when it is shut down cleanly.
        assert agent.terminate() == 0
    finally:
        if sched.leadership is not None:
            await sched.leadership.resign()
        await store.close()


def tiny_wheel(name: str = "shoal_tinypkg", version: str = "0.1") -> tuple[str, bytes]:
    """A pure-Python wheel built by hand (a zip with its dist-info): nothing to download."""
    import base64
    import hashlib as hl
    import io
    import zipfile

    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": "GREETING = 'hello from the job environment'\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hl.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    files[f"{dist}/RECORD"] = "\n".join([*record, f"{dist}/RECORD,,"]) + "\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return f"{name}-{version}-py3-none-any.whl", buf.getvalue()


JOB_ENV_MAIN = """
import sys
import shoal_tinypkg
import torch
import shoal.learner
print(shoal_tinypkg.GREETING)
print("own venv", sys.prefix != sys.base_prefix and "envs" in sys.prefix)
print("torch", torch.__version__)
"""


async def test_an_artifact_with_requirements_runs_in_its_own_environment_built_once(bed):
    wheel_name, wheel = tiny_wheel()
    files = {
        "main.py": JOB_ENV_MAIN,
        "requirements.txt": f"./wheels/{wheel_name}\n",
        f"wheels/{wheel_name}": wheel,
    }
    artifact = pack_artifact(bed.artifacts, files)
    stub = bed.stub()
    env_lines = {}
    for learner_id, device in (("l1", "gpu0"), ("l2", "gpu1")):
        await stub.StartLearner(start_request(artifact, learner_id, device), timeout=300)
        got = await log_lines(stub, learner_id)
        own = [x.text for x in got if not x.text.startswith("[shoal env] ")]
        assert own[:2] == ["hello from the job environment", "own venv True"], own
        assert own[2].startswith("torch ")  # inherited from the agent's environment
        # The build's progress comes first in the learner's log, on stderr, with the times
        # its lines were written.
        env_lines[learner_id] = [x for x in got if x.text.startswith("[shoal env] ")]
        assert got[: len(env_lines[learner_id])] == env_lines[learner_id]
        assert all(x.stream == resources_pb2.LOG_STREAM_STDERR for x in env_lines[learner_id])
    built = [x.text.removeprefix("[shoal env] ") for x in env_lines["l1"]]
    key = built[0].split()[1]
    assert built[0] == f"environment {key} (requirements.txt): building", built
    assert f"environment {key}: pip install -r requirements.txt" in built
    assert "Successfully installed shoal-tinypkg-0.1" in built, built  # pip's own lines
    assert re.fullmatch(rf"environment {key}: ready in \d+\.\d s", built[-1]), built
    times = [x.time.ToMilliseconds() for x in env_lines["l1"]]
    assert times == sorted(times) and times[0] > 0
    reused = [x.text for x in env_lines["l2"]]
    assert reused == [f"[shoal env] environment {key} (requirements.txt): reused"], reused
    # Built once for both learners (same requirements), kept under the agent's envs/.
    assert bed.agent.processes.envs.builds == 1
    (env_dir,) = (bed.config.work_dir / "envs").iterdir()
    assert (env_dir / "build.log").is_file() and (env_dir / ".ready").is_file()


async def test_an_environment_that_cannot_be_built_fails_the_start_with_pips_error(bed):
    files = {"main.py": "print('never runs')\n", "requirements.txt": "./wheels/missing.whl\n"}
    artifact = pack_artifact(bed.artifacts, files)
    stub = bed.stub()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.StartLearner(start_request(artifact), timeout=300)
    # INVALID_ARGUMENT: the scheduler fails the job with this message.
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    message = info.value.details()
    assert message.startswith("artifact requirements.txt (")
    assert "could not be installed (pip install -r requirements.txt exited with" in message
    assert "missing.whl" in message  # pip's own words
    assert (await stub.ListLearners(ha.ListLearnersRequest())).learners == []
    assert not any((bed.config.work_dir / "envs").glob("*/.ready"))


# Loaded by every Python of the environment's build (PYTHONPATH of the agent's build
# environment, set by the test): it records its pid, then waits until the test opens the gate,
# so the test knows the build is still running while it reads the log.
BUILD_GATE_HOOK = """
import os, time
gate = os.environ.get("ENV_BUILD_GATE")
if gate:
    with open(gate + ".pids", "a") as f:
        f.write(f"{os.getpid()}\\n")
    deadline = time.monotonic() + 120
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.05)
"""


def gate_builds(bed: AgentBed, tmp_path: Path) -> Path:
    """Every Python of the agent's environment builds waits for the returned path to exist."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(BUILD_GATE_HOOK)
    gate = tmp_path / "gate"
    envs = bed.agent.processes.envs
    envs.env["PYTHONPATH"] = ":".join(p for p in (str(hook), envs.env.get("PYTHONPATH")) if p)
    envs.env["ENV_BUILD_GATE"] = str(gate)
    return gate


async def follow_until(stub, learner_id: str, prefix: str, seen: list) -> AsyncIterator:
    """The learner's log followed (retried while the agent does not know the learner yet);
    lines are appended to ``seen`` until one starts with ``prefix``; the call is returned so
    the caller can read on."""
    async for attempt in tenacity.AsyncRetrying(
        retry=tenacity.retry_if_exception(
            lambda exc: isinstance(exc, aio.AioRpcError) and exc.code() == grpc.StatusCode.NOT_FOUND
        ),
        wait=tenacity.wait_fixed(0.05),
        stop=tenacity.stop_after_delay(60),
        reraise=True,
    ):
        with attempt:
            call = stub.StreamLearnerLogs(
                ha.StreamLearnerLogsRequest(learner_id=learner_id, follow=True), timeout=120
            )
            async for reply in call:
                seen.extend(reply.lines)
                if any(x.text.startswith(prefix) for x in reply.lines):
                    return call
            raise AssertionError(f"{learner_id}'s log ended before {prefix!r}: {seen}")
    raise AssertionError("unreachable")


async def test_an_environment_builds_progress_streams_live_and_stop_learner_kills_the_build(
    bed, tmp_path
):
    gate = gate_builds(bed, tmp_path)
    envs = bed.agent.processes.envs
    wheel_name, wheel = tiny_wheel()
    files = {
        "main.py": JOB_ENV_MAIN,
        "requirements.txt": f"./wheels/{wheel_name}\n",
        f"wheels/{wheel_name}": wheel,
    }
    stub = bed.stub()

    # Live: the build's lines reach a reader following the log while the build runs (its
    # first step is held at the gate), then pip's own lines, then the learner's.
    start = asyncio.ensure_future(
        stub.StartLearner(start_request(pack_artifact(bed.artifacts, files)), timeout=300)
    )
    seen: list = []
    call = await follow_until(stub, "l1", "[shoal env] environment", seen)
    first = seen[0]
    assert first.text.startswith("[shoal env] environment "), first.text
    assert first.text.endswith("(requirements.txt): building"), first.text
    assert first.stream == resources_pb2.LOG_STREAM_STDERR and first.time.ToMilliseconds() > 0
    assert not start.done() and envs.builds == 0 and not gate.exists()
    gate.touch()  # the build goes on
    async for reply in call:
        seen.extend(reply.lines)
    await start
    texts = [x.text for x in seen]
    assert "[shoal env] Successfully installed shoal-tinypkg-0.1" in texts, texts
    assert texts[-3:-1] == ["hello from the job environment", "own venv True"], texts
    assert re.fullmatch(r"\[shoal env\] environment \w+: ready in \d+\.\d s", texts[-4]), texts
    assert envs.builds == 1

    # StopLearner during a build: the build's process group is killed, nothing is kept, the
    # start fails saying so and the log's followers are done.
    gate.unlink()
    Path(f"{gate}.pids").unlink()
    files["requirements.txt"] += "# another environment\n"
    start = asyncio.ensure_future(
        stub.StartLearner(
            start_request(pack_artifact(bed.artifacts, files), "l2", "gpu1"), timeout=300
        )
    )
    seen = []
    call = await follow_until(stub, "l2", "[shoal env] environment", seen)
    pids = Path(f"{gate}.pids")
    await async_wait_until(pids.exists, timeout=60, what="the build's first step")
    (pid,) = [int(x) for x in pids.read_text().split()]
    assert alive(pid)
    stopped = (await stub.StopLearner(ha.StopLearnerRequest(learner_id="l2"), timeout=60)).learner
    assert stopped.state == FAILED, stopped
    assert "stopped while its environment was being built" in stopped.exit_reason, stopped
    assert not alive(pid)
    await expect_error(start, grpc.StatusCode.FAILED_PRECONDITION, "was stopped", "l2")
    async with asyncio.timeout(30):  # the follower's stream ends
        async for reply in call:
            seen.extend(reply.lines)
    assert all(x.text.startswith("[shoal env] ") for x in seen), [x.text for x in seen]
    ids = [x.learner_id for x in (await stub.ListLearners(ha.ListLearnersRequest())).learners]
    assert ids == ["l1"], ids
    assert envs.builds == 1 and len(list((bed.config.work_dir / "envs").glob("*/.ready"))) == 1
    assert not bed.agent.processes.directory_for("l2").exists()


async def test_a_follower_of_a_failing_build_reads_pips_error_then_its_stream_ends(bed, tmp_path):
    gate = gate_builds(bed, tmp_path)
    files = {"main.py": "print('never runs')\n", "requirements.txt": "./wheels/missing.whl\n"}
    stub = bed.stub()
    start = asyncio.ensure_future(
        stub.StartLearner(start_request(pack_artifact(bed.artifacts, files)), timeout=300)
    )
    seen: list = []
    call = await follow_until(stub, "l1", "[shoal env] environment", seen)
    gate.touch()
    async with asyncio.timeout(120):  # the stream ends once the start failed
        async for reply in call:
            seen.extend(reply.lines)
    await expect_error(start, grpc.StatusCode.INVALID_ARGUMENT, "could not be installed")
    texts = [x.text for x in seen]
    assert any("missing.whl" in t for t in texts), texts  # pip's own words, as they came
    assert re.fullmatch(
        r"\[shoal env\] environment \w+: pip install -r requirements.txt failed \(exit \d+\)",
        texts[-1],
    ), texts
    assert (await stub.ListLearners(ha.ListLearnersRequest())).learners == []
    assert not bed.agent.processes.directory_for("l1").exists()
