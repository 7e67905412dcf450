"""The CLI the way a user meets it (issue 18): ``-o`` before or after the subcommand, JSON
numbers as numbers, ids never cut in tables, ``watch``/``submit --wait`` exiting with the job's
outcome and its reason, a repeated traceback printed once, contexts found from any directory,
a role error that says where the admin token is, and the local cluster's port reservations."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from pathlib import Path

import grpc
import pytest
from rich.console import Console
from typer.testing import CliRunner

from shoal.cli import jobs as cli_jobs
from shoal.cli.follow import TracebackFolder
from shoal.cli.main import app
from shoal.cli.output import hoist_output_option, message_to_dict
from shoal.client import AsyncClient
from shoal.client.config import ConfigError, load_config, set_context
from shoal.runtime.auth import USERS_AND_SERVICES, MethodRoles
from shoal.runtime.config import ServerConfig
from shoal.runtime.errors import PermissionDenied
from shoal.runtime.server import ServiceBinding, create_server
from shoal.v1 import job_pb2, job_scheduler_service_pb2 as js, job_scheduler_service_pb2_grpc
from tests.unit.test_client import SERVICE, FakeScheduler

LONG_ID = "job-35eea1039ba5"


class WatchableScheduler(FakeScheduler):
    """The fake scheduler with jobs that end: WatchJob streams a few progress events, then
    the job's final state; GetJob of ``job-denied`` is refused for lack of a role."""

    def __init__(self) -> None:
        super().__init__()
        self.outcomes: dict[str, tuple[int, str]] = {}
        self.default_outcome = (job_pb2.JOB_STATE_COMPLETED, "")

    def add(self, job_id: str, final: int, reason: str = "") -> None:
        self.jobs[job_id] = job_pb2.Job(
            job_id=job_id,
            spec=job_pb2.JobSpec(name="digits", epochs=1, max_workers=2, priority=5000),
            state=job_pb2.JOB_STATE_RUNNING,
            progress=job_pb2.JobProgress(completed_iterations=69, iterations_per_epoch=100),
        )
        self.jobs[job_id].create_time.FromSeconds(int(time.time()) - 300)
        self.outcomes[job_id] = (final, reason)

    async def GetJob(self, request, context):
        if request.job_id == "job-denied":
            raise PermissionDenied(
                f"{SERVICE}/GetJob needs role admin; the caller ('alice') has role user"
            )
        return await super().GetJob(request, context)

    CHECKPOINT_FILES = {"manifest.json": b"{}", "shard-0.safetensors": b"weights"}

    async def ListCheckpoints(self, request, context):
        files = [
            js.JobCheckpointFile(name=n, size_bytes=len(b))
            for n, b in self.CHECKPOINT_FILES.items()
        ]
        return js.ListCheckpointsResponse(
            checkpoints=[
                js.JobCheckpoint(name="iter-23", iteration=23, epoch=1, size_bytes=9, files=files),
                js.JobCheckpoint(name="iter-46", iteration=46, epoch=2, files=files, latest=True),
            ]
        )

    async def DownloadCheckpoint(self, request, context):
        data = self.CHECKPOINT_FILES[request.file]
        header = js.ArtifactHeader(name=request.file, size_bytes=len(data))
        yield js.DownloadCheckpointResponse(header=header)
        yield js.DownloadCheckpointResponse(chunk=data)

    async def StreamJobLogs(self, request, context):
        from shoal.v1 import resources_pb2

        now = time.time()
        lines = []
        for i, (age_s, text) in enumerate(
            [(3600, "an hour ago"), (60, "epoch 1 accuracy 0.76"), (1, "final accuracy 0.91")]
        ):
            line = resources_pb2.LogLine(
                learner_id="job-1-l1", host_id="host-2", text=text, offset=i * 10
            )
            line.time.FromNanoseconds(int((now - age_s) * 1e9))
            lines.append(line)
        yield js.StreamJobLogsResponse(lines=lines)

    async def WatchJob(self, request, context):
        job = job_pb2.Job()
        job.CopyFrom(self.jobs[request.job_id])
        for i in range(3):
            job.progress.completed_iterations = 10 * (i + 1)
            yield js.WatchJobResponse(event=job_pb2.JobEvent(job=job))
        final, reason = self.outcomes.get(request.job_id, self.default_outcome)
        job.state, job.state_reason = final, reason
        yield js.WatchJobResponse(event=job_pb2.JobEvent(job=job))


@pytest.fixture
async def scheduler(monkeypatch, tmp_path):
    config = ServerConfig(service_name="fake", allow_no_auth=True)
    roles = MethodRoles(SERVICE, USERS_AND_SERVICES)
    add = job_scheduler_service_pb2_grpc.add_JobSchedulerServiceServicer_to_server
    fake = WatchableScheduler()
    server = await create_server(config, [ServiceBinding(SERVICE, add, fake, roles)])
    monkeypatch.setenv("SHOAL_ENDPOINTS", server.address)
    monkeypatch.setenv("SHOAL_CONFIG", str(tmp_path / "none.json"))
    monkeypatch.delenv("SHOAL_TOKEN", raising=False)
    yield fake
    await server.stop(0)


async def invoke(args: list[str]):
    """The CLI in a thread (the fake server lives on this test's event loop)."""
    return await asyncio.to_thread(CliRunner().invoke, app, args)


def test_the_output_option_is_hoisted_from_anywhere_but_never_from_a_value():
    assert hoist_output_option(["jobs", "list", "-o", "json"]) == ["-o", "json", "jobs", "list"]
    assert hoist_output_option(["jobs", "list", "--output=yaml"])[:2] == ["--output", "yaml"]
    assert hoist_output_option(["jobs", "get", "x", "-owide"]) == ["-o", "wide", "jobs", "get", "x"]
    # The value of --arg is the script's, and words after `--` are never touched.
    assert hoist_output_option(["submit", "m", "--arg", "-o"]) == ["submit", "m", "--arg", "-o"]
    assert hoist_output_option(["x", "--", "-o", "json"]) == ["x", "--", "-o", "json"]


def test_int64_fields_are_json_numbers_and_zeros_are_present():
    job = job_pb2.Job(job_id="j", progress=job_pb2.JobProgress(completed_iterations=69))
    data = message_to_dict(job)
    assert data["progress"]["completed_iterations"] == 69
    assert data["allocated_workers"] == 0  # present, not omitted
    assert data["state"] == "JOB_STATE_UNSPECIFIED"


async def test_output_after_the_subcommand_gives_json_with_numbers(scheduler):
    scheduler.add(LONG_ID, job_pb2.JOB_STATE_COMPLETED)
    result = await invoke(["jobs", "list", "--output", "json"])
    assert result.exit_code == 0, result.output
    [job] = json.loads(result.stdout)
    assert job["job_id"] == LONG_ID
    assert job["progress"]["completed_iterations"] == 69
    result = await invoke(["jobs", "get", LONG_ID, "-o", "yaml"])
    assert result.exit_code == 0, result.output
    assert f"job_id: {LONG_ID}" in result.stdout
    result = await invoke(["jobs", "list", "-o", "name"])
    assert result.stdout.split() == [LONG_ID]


async def test_a_narrow_table_never_cuts_an_id_and_shows_age(scheduler, monkeypatch):
    scheduler.add(LONG_ID, job_pb2.JOB_STATE_COMPLETED)
    monkeypatch.setattr(cli_jobs, "console", Console(width=40))
    result = await invoke(["jobs", "list"])
    assert result.exit_code == 0, result.output
    assert LONG_ID in result.stdout
    assert "running" in result.stdout and "…" not in result.stdout
    assert "AGE" in result.stdout and "5m" in result.stdout
    wide = await invoke(["jobs", "list", "-o", "wide"])
    assert "OWNER" in wide.stdout and "SAMPLES/S" in wide.stdout


async def test_watch_exits_with_the_jobs_outcome_and_prints_lines_without_a_terminal(scheduler):
    scheduler.add("job-ok", job_pb2.JOB_STATE_COMPLETED)
    reason = "learner job-bad-l1 on host host-2 failed: exited with code 1: ValueError: bad"
    scheduler.add("job-bad", job_pb2.JOB_STATE_FAILED, reason)
    scheduler.add("job-gone", job_pb2.JOB_STATE_CANCELLED, "cancelled by alice")

    ok = await invoke(["jobs", "watch", "job-ok"])
    assert ok.exit_code == 0, ok.output
    assert "job-ok running | epoch 1/1 iter 10" in ok.stdout  # a line, not a buffered bar
    assert ok.stdout.rstrip().endswith("job-ok: completed")

    bad = await invoke(["jobs", "watch", "job-bad"])
    assert bad.exit_code == 1
    assert "ValueError: bad" in bad.stderr

    gone = await invoke(["jobs", "watch", "job-gone", "-o", "json"])
    assert gone.exit_code == 3
    events = [json.loads(line) for line in gone.stdout.splitlines()]
    assert events[-1]["job"]["state"] == "JOB_STATE_CANCELLED"
    assert events[0]["job"]["progress"]["completed_iterations"] == 10


async def test_submit_wait_exits_non_zero_when_the_job_fails(scheduler, tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "train.py").write_text("raise ValueError('x')\n")

    scheduler.default_outcome = (job_pb2.JOB_STATE_FAILED, "ValueError: x")
    result = await invoke(["submit", str(tmp_path / "m"), "--wait"])
    assert result.exit_code == 1, result.output
    assert "submitted job-1" in result.stdout
    assert "ValueError: x" in result.stderr


async def test_download_honours_output_json(scheduler, tmp_path, monkeypatch):
    async def download_model(self, job_id, dest, progress=None):
        dest.write_bytes(b"abc")
        return 3

    monkeypatch.setattr(AsyncClient, "download_model", download_model)
    result = await invoke(
        ["jobs", "download", "job-1", "--out", str(tmp_path / "m.st"), "-o", "json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {
        "job_id": "job-1",
        "path": str(tmp_path / "m.st"),
        "size_bytes": 3,
    }


async def test_a_role_error_says_where_the_admin_token_is(scheduler, tmp_path, monkeypatch):
    config = tmp_path / "cluster.json"
    config.write_text(
        json.dumps({"scheduler": [], "token": "u", "admin_token": "a", "state_dir": "/s"})
    )
    monkeypatch.setenv("SHOAL_CONFIG", str(config))
    result = await invoke(["jobs", "get", "job-denied"])
    assert result.exit_code == 1
    line = " ".join(result.stderr.split())
    assert "needs role admin; the caller ('alice') has role user" in line
    assert f'"admin_token" in {config}' in line


def test_a_repeated_traceback_is_printed_once_then_counted():
    printed: list[str] = []
    folder = TracebackFolder(lambda prefix, text: printed.append(prefix + text))
    for learner in ("l1", "l2", "l3"):
        crash = [  # each learner runs in its own directory
            "Traceback (most recent call last):",
            f'  File "/hosts/h/learners/l-{learner}/work/train.py", line 3, in forward',
            "    raise ValueError('bad shape')",
            "ValueError: bad shape",
        ]
        folder.feed(learner, f"[{learner}] ", "starting")
        for text in crash:
            folder.feed(learner, f"[{learner}] ", text)
    folder.flush()
    assert printed.count("[l1] Traceback (most recent call last):") == 1
    assert not any(p.startswith("[l2] Traceback") for p in printed)
    assert printed[-1] == "[l3] (the same traceback again, 3 times so far) ValueError: bad shape"
    assert printed.count("[l3] starting") == 1


def test_contexts_find_the_cluster_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    for name in ("SHOAL_CONFIG", "SHOAL_CONTEXT", "SHOAL_ENDPOINTS", "SHOAL_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, port in (("a", 1), ("b", 2)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "cluster.json").write_text(
            json.dumps({"scheduler": [f"127.0.0.1:{port}"], "token": "u", "admin_token": "adm"})
        )
        set_context(name, tmp_path / name / "cluster.json")
    elsewhere = tmp_path / "mycnn"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert load_config().scheduler == ("127.0.0.1:2",)  # the last registered is current
    assert load_config().token == "u"
    assert load_config(admin=True).token == "adm"  # the cluster's starter is its admin
    monkeypatch.setenv("SHOAL_CONTEXT", "a")
    assert load_config().scheduler == ("127.0.0.1:1",)
    monkeypatch.setenv("SHOAL_CONTEXT", "nope")
    with pytest.raises(ConfigError, match=r"context \('nope'\) is not known \(contexts: a, b\)"):
        load_config()
    monkeypatch.delenv("SHOAL_CONTEXT")

    runner = CliRunner()
    result = runner.invoke(app, ["config", "use-context", "a"])
    assert result.exit_code == 0, result.output
    assert load_config().scheduler == ("127.0.0.1:1",)
    listed = json.loads(runner.invoke(app, ["config", "get-contexts", "-o", "json"]).stdout)
    assert [(c["name"], c["current"]) for c in listed] == [("a", True), ("b", False)]
    bad = runner.invoke(app, ["config", "use-context", "zzz"])
    assert bad.exit_code == 1 and "zzz" in bad.output


def test_version():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.startswith("shoal ")


def test_reserved_ports_are_distinct_and_still_bindable_by_services():
    from concurrent import futures

    from prometheus_client import start_http_server

    from shoal.cluster.local import PortReservations

    ports = PortReservations()
    taken = [ports.take() for _ in range(20)]
    assert len(set(taken)) == 20
    try:
        # A plain bind(0) never hands out a held port.
        for _ in range(200):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                assert s.getsockname()[1] not in taken
        # gRPC (SO_REUSEPORT) and an HTTP server (SO_REUSEADDR, on 0.0.0.0 as the metrics
        # endpoint binds) can still bind and serve a held port.
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
        assert server.add_insecure_port(f"127.0.0.1:{taken[0]}") == taken[0]
        server.start()
        server.stop(0)
        http, _thread = start_http_server(taken[1], addr="0.0.0.0")
        http.shutdown()
        http.server_close()
    finally:
        ports.release()


async def test_a_checkpoint_downloads_by_iteration_name_or_latest(scheduler, tmp_path):
    result = await invoke(["jobs", "checkpoints", "job-1"])
    assert result.exit_code == 0, result.output
    assert "iter-46 (latest)" in result.stdout and "AGE" in result.stdout
    out = tmp_path / "ck"
    result = await invoke(["jobs", "download", "job-1", "--checkpoint", "23", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "shard-0.safetensors").read_bytes() == b"weights"
    result = await invoke(
        ["jobs", "download", "job-1", "--checkpoint", "latest", "--out", str(out), "-o", "json"]
    )
    assert json.loads(result.stdout)["checkpoint"] == "iter-46"
    result = await invoke(["jobs", "download", "job-1", "--checkpoint", "7"])
    assert result.exit_code == 1
    assert "checkpoint ('7') is not one of job-1's (iter-23, iter-46)" in result.stderr


def test_uploads_honour_gitignore_and_shoalignore(tmp_path):
    from shoal.client import pack_directory
    from shoal.client.packing import pack

    root = tmp_path / "m"
    (root / "data").mkdir(parents=True)
    (root / "data" / "big.bin").write_bytes(b"x" * 1000)
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref")
    (root / "runs").mkdir()
    (root / "runs" / "keep.txt").write_text("k")
    (root / "runs" / "log.txt").write_text("l")
    (root / "train.py").write_text("print('hi')\n")
    (root / "notes.tmp").write_text("t")
    (root / ".gitignore").write_text("data/\n*.tmp\n")
    (root / ".shoalignore").write_text("runs/*\n!runs/keep.txt\n")
    packed = pack(root)
    import io
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(packed.data)) as tar:
        names = sorted(tar.getnames())
    assert names == [".gitignore", ".shoalignore", "runs", "runs/keep.txt", "train.py"]
    assert (packed.files, packed.ignored) == (4, 4)  # big.bin, HEAD, log.txt, notes.tmp
    assert pack_directory(root) == packed.data


def test_uploads_honour_gitignore_files_in_subdirectories_as_git_does(tmp_path):
    import io
    import tarfile

    from shoal.client.packing import pack

    root = tmp_path / "m"
    files = {
        "train.py": "t",
        "notes.txt": "top",  # the top's *.txt
        ".gitignore": "*.txt\n",
        "src/.gitignore": "*.ckpt\n!keep.txt\nbuild/\n/only-here.py\n",
        "src/keep.txt": "re-included by the deeper file",
        "src/other.txt": "still the top's *.txt",
        "src/model.ckpt": "src's *.ckpt",
        "src/only-here.py": "anchored to src/",
        "src/build/out.bin": "src's build/",
        "src/deep/only-here.py": "not src/only-here.py: kept",
        "src/deep/x.ckpt": "src's *.ckpt applies below src too",
        "src/deep/.shoalignore": "!x.ckpt\n",  # ... unless a deeper file re-includes it
        "model.ckpt": "src's patterns do not apply above src",
        "data/.gitignore": "!*.txt\n",
        "data/a.txt": "re-included by data/.gitignore",
        "logs/.gitignore": "!x.log\n",  # cannot re-include inside an ignored directory
        "logs/x.log": "l",
    }
    files[".shoalignore"] = "logs/\n"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    packed = pack(root)
    with tarfile.open(fileobj=io.BytesIO(packed.data)) as tar:
        names = sorted(n for n in tar.getnames() if not tar.getmember(n).isdir())
    assert names == [
        ".gitignore",
        ".shoalignore",
        "data/.gitignore",
        "data/a.txt",
        "model.ckpt",
        "src/.gitignore",
        "src/deep/.shoalignore",
        "src/deep/only-here.py",
        "src/deep/x.ckpt",
        "src/keep.txt",
        "train.py",
    ]
    # notes.txt, src/other.txt, src/model.ckpt, src/only-here.py, src/build/out.bin, and the
    # 2 files of logs/
    assert packed.ignored == 7


async def test_log_lines_carry_written_time_learner_and_host_and_filter(scheduler):
    result = await invoke(["jobs", "logs", "job-1"])
    assert result.exit_code == 0, result.output
    first = result.stdout.splitlines()[0]
    assert re.fullmatch(r"\d\d:\d\d:\d\d\.\d{3} \[job-1-l1 host-2\] an hour ago", first)
    recent = await invoke(["jobs", "logs", "job-1", "--since", "5m", "--grep", "accuracy"])
    assert [line.split("] ")[1] for line in recent.stdout.splitlines()] == [
        "epoch 1 accuracy 0.76",
        "final accuracy 0.91",
    ]
    as_json = await invoke(["jobs", "logs", "job-1", "-o", "json"])
    line = json.loads(as_json.stdout.splitlines()[0])
    assert line["host_id"] == "host-2" and line["offset"] == 0
    bad = await invoke(["jobs", "logs", "job-1", "--since", "5 minutes"])
    assert bad.exit_code == 2 and "--since ('5 minutes')" in bad.output


def test_cluster_status_and_down_find_the_current_contexts_cluster(tmp_path, monkeypatch):
    from shoal.cluster.cli import _found_state_dir, _free_context_name

    for name in ("SHOAL_CONFIG", "SHOAL_CONTEXT"):
        monkeypatch.delenv(name, raising=False)
    state = tmp_path / "project" / ".shoal"
    state.mkdir(parents=True)
    (state / "cluster.json").write_text(json.dumps({"scheduler": [], "state_dir": str(state)}))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert _found_state_dir(None) == Path(".shoal")  # no context yet
    assert _free_context_name("local", state / "cluster.json") == "local"
    set_context("local", state / "cluster.json")
    assert _found_state_dir(None) == state
    assert _found_state_dir(tmp_path / "x") == tmp_path / "x"
    # A second cluster started elsewhere does not hide the first: it gets local-2.
    second = elsewhere / ".shoal"
    second.mkdir()
    (second / "cluster.json").write_text("{}")
    assert _free_context_name("local", second / "cluster.json") == "local-2"
    assert _found_state_dir(None) == Path(".shoal")  # a cluster in this directory wins


async def test_submit_resume_from_and_keep_checkpoints_reach_the_spec(scheduler, tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "train.py").write_text("print('hi')\n")
    for given, sent in (
        ("job-3c0e5b9a41d2@14", "job-3c0e5b9a41d2/iter-14"),
        ("job-3c0e5b9a41d2/14", "job-3c0e5b9a41d2/iter-14"),
        ("job-3c0e5b9a41d2/iter-7", "job-3c0e5b9a41d2/iter-7"),
        ("job-3c0e5b9a41d2", "job-3c0e5b9a41d2"),
    ):
        result = await invoke(
            [
                "submit",
                str(tmp_path / "m"),
                "--resume-from",
                given,
                "--keep-checkpoints",
                "5",
                "--keep-every",
                "10",
            ]
        )
        assert result.exit_code == 0, result.output
        assert f"resuming from {sent}" in result.stdout
        job = list(scheduler.jobs.values())[-1]
        assert (
            job.spec.resume_from,
            job.spec.keep_checkpoints,
            job.spec.keep_every_nth_checkpoint,
        ) == (sent, 5, 10)
    count = len(scheduler.jobs)
    bad = await invoke(["submit", str(tmp_path / "m"), "--resume-from", "job-1@"])
    assert bad.exit_code == 2 and "--resume-from ('job-1@')" in bad.output, bad.output
    assert len(scheduler.jobs) == count  # nothing uploaded or submitted


async def test_a_unique_prefix_of_a_job_id_is_accepted_and_an_ambiguous_one_named(scheduler):
    for job_id in ("job-35eea1039ba5", "job-35e0000000aa", "job-7f3a00000000"):
        scheduler.add(job_id, job_pb2.JOB_STATE_COMPLETED)

    for prefix in ("7f3", "job-7f", "job-7f3a00000000"):
        got = await invoke(["jobs", "get", prefix, "-o", "json"])
        assert got.exit_code == 0, got.output
        assert json.loads(got.stdout)["job_id"] == "job-7f3a00000000"
    got = await invoke(["jobs", "watch", "35ee"])  # another command taking a job id
    assert got.exit_code == 0 and "job-35eea1039ba5: completed" in got.stdout, got.output

    ambiguous = await invoke(["jobs", "get", "job-35e"])
    assert ambiguous.exit_code == 1
    assert "job id prefix ('job-35e') is ambiguous" in ambiguous.stderr, ambiguous.stderr
    assert "job-35e0000000aa, job-35eea1039ba5" in ambiguous.stderr
    assert len(ambiguous.stderr.strip().splitlines()) == 1

    unknown = await invoke(["jobs", "get", "zzz"])  # the server's own NOT_FOUND
    assert unknown.exit_code == 1 and "zzz" in unknown.stderr, unknown.output
