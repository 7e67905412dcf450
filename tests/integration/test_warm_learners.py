"""Warm learner processes (shoal.host_agent.warm) with real processes: a learner started warm gets
exactly what a cold one gets (environment contract, cwd, argv, logs, exit code, crash summary,
stop), a warm process never serves a second learner nor holds a job's data before it is taken,
a dead warm process is replaced and a start without one is cold, and leftovers of a killed agent
are reaped."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from shoal.host_agent.devices import SimulatedDevices
from shoal.host_agent.service import ERRORS, HostAgent, bindings
from shoal.host_agent.warm import TOKEN_ENV, reap_warm
from shoal.runtime.server import create_server
from shoal.v1 import host_agent_service_pb2 as ha, resources_pb2
from tests.integration._shoal_processes import pack_artifact
from tests.integration.test_host_agent import (
    FAILED,
    IGNORE_SIGTERM,
    SUCCEEDED,
    AgentBed,
    alive,
    first_line,
    log_lines,
    start_request,
)
from tests.support import async_wait_until

pytestmark = pytest.mark.slow

# Prints what a learner can see of where it runs, then exits with argv[1].
PROBE = """
import json, os, sys
print(json.dumps({
    "env": dict(os.environ),
    "cwd": os.path.basename(os.getcwd()),
    "files": sorted(os.listdir(".")),
    "argv": sys.argv,
    "path0": os.path.basename(sys.path[0]),
    "torch_imported": "torch" in sys.modules,
    "pid": os.getpid(),
    "pgid": os.getpgid(0),
    "sid": os.getsid(0),
    "stdin": sys.stdin.read(),
    "main": __name__,
}))
print("to stderr", file=sys.stderr)
open(os.environ["SHOAL_TRAIN_MARKER"], "w").close()  # as Trainer.train() does
sys.exit(int(sys.argv[1]))
"""
CRASH = """
def inner():
    raise ValueError("boom in the job")

inner()
"""
READY_TIMEOUT_S = 180.0  # a warm process imports torch: long on 2 busy cores


class WarmBed(AgentBed):
    def __init__(self, tmp: Path, warm: int = 1) -> None:
        super().__init__(tmp)
        self.config = dataclasses.replace(self.config, warm_learners=warm)

    async def start(self) -> WarmBed:
        self.agent = HostAgent(self.config, SimulatedDevices("h1", 2))
        self.running = await create_server(self.config.server, bindings(self.agent), errors=ERRORS)
        self.agent.start(self.running.address)
        return self

    @property
    def pool(self):
        return self.agent.processes.warm

    async def ready(self, count: int = 1) -> list[int]:
        """The pids of the ready warm processes, once there are ``count``."""
        await async_wait_until(
            lambda: self.pool.ready() >= count,
            timeout=READY_TIMEOUT_S,
            interval=0.1,
            what=f"{count} warm learner process(es)",
        )
        return [w.pid for w in self.pool._ready]


@pytest.fixture
async def bed(tmp_path) -> AsyncIterator[WarmBed]:
    bed = await WarmBed(tmp_path).start()
    try:
        yield bed
    finally:
        await bed.close()


def probe_output(lines) -> tuple[dict, list[str]]:
    stdout = [x.text for x in lines if x.stream == resources_pb2.LOG_STREAM_STDOUT]
    stderr = [x.text for x in lines if x.stream == resources_pb2.LOG_STREAM_STDERR]
    return json.loads(stdout[-1]), stderr


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


async def test_a_warm_learner_gets_what_a_cold_one_gets_and_serves_no_second_job(bed):
    (warm_pid,) = await bed.ready()
    # Nothing of a job is in a warm process before it is taken, nor any agent secret.
    idle_env = environ_of(warm_pid)
    assert TOKEN_ENV in idle_env
    assert not {"SHOAL_JOB_ID", "SHOAL_LEARNER_ID", "FOO", "SHOAL_SERVICE_TOKEN"} & set(idle_env)
    assert bed.tokens["service"] not in json.dumps(idle_env)

    artifact = pack_artifact(bed.artifacts, {"main.py": PROBE, "data/x.txt": "x"})
    stub = bed.stub()
    reply = await stub.StartLearner(
        start_request(artifact, args=["3"], env={"FOO": "bar"}, allocation_id="a-1")
    )
    assert reply.learner.pid == warm_pid  # it started warm
    lines = await log_lines(stub, "l1")
    seen, stderr = probe_output(lines)
    env = seen["env"]
    assert env["SHOAL_JOB_ID"] == "j1" and env["SHOAL_LEARNER_ID"] == "l1"
    assert env["SHOAL_HOST_ID"] == "h1" and env["SHOAL_DEVICE_ID"] == "gpu0"
    assert env["SHOAL_ALLOCATION_ID"] == "a-1" and env["FOO"] == "bar"
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["PYTHONUNBUFFERED"] == "1"
    assert "SHOAL_SERVICE_TOKEN" not in env and TOKEN_ENV not in env
    assert seen["cwd"] == "work" and seen["files"] == ["data", "main.py"]
    assert seen["argv"][1:] == ["3"] and seen["argv"][0].endswith("/work/main.py")
    assert seen["path0"] == "work" and seen["main"] == "__main__"
    assert seen["torch_imported"] is True  # paid before the job came
    assert seen["pid"] == seen["pgid"] == seen["sid"]  # its own session and group
    assert seen["stdin"] == ""
    assert stderr == ["to stderr"]
    (learner,) = (await stub.ListLearners(ha.ListLearnersRequest())).learners
    assert learner.state == FAILED and learner.exit_code == 3
    assert learner.exit_reason == "exited with code 3"

    # The pool was refilled with a fresh process; a second job gets that one, never the first.
    (second_pid,) = await bed.ready()
    assert second_pid != warm_pid and not alive(warm_pid)
    reply = await stub.StartLearner(
        start_request(artifact, learner_id="l2", job_id="j2", device="gpu1", args=["0"])
    )
    assert reply.learner.pid == second_pid
    seen, _ = probe_output(await log_lines(stub, "l2"))
    assert seen["env"]["SHOAL_JOB_ID"] == "j2" and "FOO" not in seen["env"]
    learner = (await stub.ListLearners(ha.ListLearnersRequest(job_id="j2"))).learners[0]
    assert learner.state == SUCCEEDED and learner.exit_code == 0
    assert bed.pool.taken == 2


async def test_a_warm_learner_crash_and_stop_are_reported_as_for_a_cold_one(bed):
    await bed.ready()
    stub = bed.stub()
    crash = pack_artifact(bed.artifacts, {"main.py": CRASH})
    await stub.StartLearner(start_request(crash))
    await log_lines(stub, "l1")
    (learner,) = (await stub.ListLearners(ha.ListLearnersRequest())).learners
    assert learner.state == FAILED and learner.exit_code == 1
    # The traceback is the script's own (no frame of the runner or runpy), as with `python`.
    assert learner.exit_reason == (
        "exited with code 1: ValueError: boom in the job (at main.py:5 in <module>, "
        "main.py:3 in inner)"
    )

    # A learner that ignores SIGTERM (and its child) is killed with its group after the grace.
    await bed.ready()
    stubborn = pack_artifact(bed.artifacts, {"main.py": IGNORE_SIGTERM})
    reply = await stub.StartLearner(start_request(stubborn, learner_id="l2", device="gpu1"))
    assert bed.agent.processes.get("l2").warm_token
    ready = await first_line(stub, "l2", "ready ")
    _, pid, child = ready.split()
    assert int(pid) == reply.learner.pid
    stopped = await stub.StopLearner(ha.StopLearnerRequest(learner_id="l2"), timeout=30)
    assert stopped.learner.exit_code == -signal.SIGKILL
    assert "SIGKILL after the grace" in stopped.learner.exit_reason
    await async_wait_until(lambda: not alive(int(child)), timeout=10, what="the child killed")


async def test_a_dead_warm_process_is_replaced_and_a_start_without_one_is_cold(bed):
    (warm_pid,) = await bed.ready()
    os.kill(warm_pid, signal.SIGKILL)
    # Started at once: the dead process is either noticed (no ready one: cold) or its pipe is
    # broken (cold too). Either way the learner runs and nothing of the dead one is used.
    artifact = pack_artifact(bed.artifacts, {"main.py": PROBE})
    stub = bed.stub()
    reply = await stub.StartLearner(start_request(artifact, args=["0"]))
    assert reply.learner.pid != warm_pid
    seen, _ = probe_output(await log_lines(stub, "l1"))
    assert seen["env"]["SHOAL_LEARNER_ID"] == "l1"
    learner = (await stub.ListLearners(ha.ListLearnersRequest())).learners[0]
    assert learner.state == SUCCEEDED
    # A job environment read at interpreter start (OMP_NUM_THREADS) also starts cold.
    (fresh,) = await bed.ready()
    assert fresh != warm_pid
    reply = await stub.StartLearner(
        start_request(
            artifact, learner_id="l2", device="gpu1", args=["0"], env={"OMP_NUM_THREADS": "1"}
        )
    )
    assert reply.learner.pid != fresh and not bed.agent.processes.get("l2").warm_token
    seen, _ = probe_output(await log_lines(stub, "l2"))
    assert seen["env"]["OMP_NUM_THREADS"] == "1" and seen["torch_imported"] is False
    assert bed.pool.ready() == 1 and bed.pool._ready[0].pid == fresh  # still there


def test_warm_processes_left_by_a_killed_agent_are_reaped(tmp_path):
    warm_dir = tmp_path / "warm"
    warm_dir.mkdir()
    token = "0123456789abcdef"
    leftover = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env={**os.environ, TOKEN_ENV: token},
        start_new_session=True,
    )
    # Same group recorded, another token: never killed (a reused pid is never hit).
    bystander = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    try:
        (warm_dir / f"{token}.json").write_text(json.dumps({"pgid": leftover.pid, "token": token}))
        (warm_dir / "x.json").write_text(json.dumps({"pgid": bystander.pid, "token": "ffff"}))
        (warm_dir / "bad.json").write_text("{not json")
        assert reap_warm(warm_dir) == 1
        assert leftover.wait(timeout=10) == -signal.SIGKILL
        assert bystander.poll() is None
        assert list(warm_dir.iterdir()) == []
    finally:
        bystander.kill()
        bystander.wait()
        leftover.kill()
        leftover.wait()


async def test_a_closed_agent_leaves_no_warm_process(tmp_path):
    bed = await WarmBed(tmp_path, warm=2).start()
    try:
        pids = await bed.ready(2)
    finally:
        await bed.close()
    for pid in pids:
        await async_wait_until(lambda pid=pid: not alive(pid), timeout=10, what="warm gone")
    assert list((tmp_path / "agent" / "warm").glob("*.json")) == []
    await asyncio.sleep(0)


# What the interpreter does at exit must still happen with the runner's fast exit.
AT_EXIT = """
import atexit, concurrent.futures, sys, threading, time
atexit.register(lambda: print("atexit ran", flush=True))
left_open = open("left-open.txt", "w")
left_open.write("all of it")  # never closed nor flushed by the script
from pathlib import Path
by_path = Path("path-open.txt").open("w")
by_path.write("this too")
pool = concurrent.futures.ThreadPoolExecutor(1)  # never shut down
# A task still running at exit (workload, not a wait: the executor's exit hook joins it before
# the main thread stops, so it cannot wait for that).
pool.submit(time.sleep, 0.2)

def late():
    threading.main_thread().join()  # until the script has exited (no timing involved)
    print("thread done", flush=True)

threading.Thread(target=late).start()  # a non-daemon thread outlives the script
import ctypes
ctypes.CDLL(None).printf(b"from C stdio\\n")  # block-buffered: stdout is a pipe
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
async def test_the_fast_exit_keeps_threads_atexit_open_files_and_the_code(tmp_path, warm):
    bed = await WarmBed(tmp_path, warm=1 if warm else 0).start()
    try:
        if warm:
            await bed.ready()
        artifact = pack_artifact(bed.artifacts, {"main.py": AT_EXIT})
        stub = bed.stub()
        await stub.StartLearner(start_request(artifact, args=["5"]))
        lines = [x.text for x in await log_lines(stub, "l1")]
        assert sorted(lines) == ["atexit ran", "from C stdio", "thread done"]
        assert lines.index("thread done") < lines.index("atexit ran")
        learner = bed.agent.processes.get("l1")
        assert bool(learner.warm_token) is warm
        assert learner.exit_code == 5 and learner.exit_reason == "exited with code 5"
        assert (learner.directory / "work" / "left-open.txt").read_text() == "all of it"
        assert (learner.directory / "work" / "path-open.txt").read_text() == "this too"
    finally:
        await bed.close()
