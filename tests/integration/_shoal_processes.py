"""Real resource-manager and host-agent processes for the integration tests.

``ShoalProcesses`` starts ``python -m shoal.resource_manager`` / ``python -m shoal.host_agent``
on free loopback ports with a per-test tokens file, logs to files under the test's tmp_path,
and kills everything it started at the end. It also packs learner scripts into artifacts
(``<sha256>.tar.gz`` in an artifact directory) the way the client uploads them.
"""

from __future__ import annotations

import hashlib
import io
import os
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

from grpc import aio

from shoal.runtime.channels import connect
from shoal.v1 import (
    host_agent_service_pb2_grpc as ha_grpc,
    resource_manager_service_pb2_grpc as rm_grpc,
)
from tests.support import free_port, make_tokens

# Short timings for tests (the defaults are for real clusters).
HEARTBEAT_S = 0.3
GRACE_S = 1.5
ELECTION_TTL_S = 2.0


def pack_artifact(directory: Path, files: dict[str, str | bytes]) -> str:
    """Write a tar.gz of ``files`` (name -> text or bytes) as <sha256>.tar.gz in
    ``directory``; returns the artifact id."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in sorted(files.items()):
            data = text.encode() if isinstance(text, str) else text
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o755
            tar.addfile(info, io.BytesIO(data))
    blob = buf.getvalue()
    artifact_id = hashlib.sha256(blob).hexdigest()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{artifact_id}.tar.gz").write_bytes(blob)
    return artifact_id


class Proc:
    """One service process."""

    def __init__(self, name: str, argv: list[str], log_path: Path) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.port = int(argv[argv.index("--listen") + 1].rpartition(":")[2])
        self.address = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, *self.argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "SHOAL_LOG_LEVEL": "INFO"},
            )

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def terminate(self, timeout: float = 30) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


class ShoalProcesses:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.tokens_file = tmp_path / "tokens"
        self.tokens = make_tokens(self.tokens_file)
        self.artifact_dir = tmp_path / "artifacts"
        self.artifact_dir.mkdir(exist_ok=True)
        self.procs: list[Proc] = []
        self._channels: list[aio.Channel] = []

    def _common(self) -> list[str]:
        return [
            "--tokens-file",
            str(self.tokens_file),
            "--service-token",
            self.tokens["service"],
            "--shutdown-grace",
            "1",
        ]

    def resource_manager(self, etcd_endpoints: list[str], *extra: str) -> Proc:
        port = free_port()
        argv = [
            "-m",
            "shoal.resource_manager",
            "--listen",
            f"127.0.0.1:{port}",
            "--etcd",
            ",".join(etcd_endpoints),
            "--heartbeat-interval",
            str(HEARTBEAT_S),
            "--host-grace",
            str(GRACE_S),
            "--election-ttl",
            str(ELECTION_TTL_S),
            *self._common(),
            *extra,
        ]
        proc = Proc(f"rm-{port}", argv, self.tmp / f"rm-{port}.log")
        self.procs.append(proc)
        return proc

    def host_agent(
        self, host_id: str, resource_managers: list[str], *extra: str, gpus: int = 4
    ) -> Proc:
        port = free_port()
        argv = [
            "-m",
            "shoal.host_agent",
            "--listen",
            f"127.0.0.1:{port}",
            "--host-id",
            host_id,
            "--simulate-gpus",
            str(gpus),
            "--resource-manager",
            ",".join(resource_managers),
            "--artifact-dir",
            str(self.artifact_dir),
            "--work-dir",
            str(self.tmp / f"agent-{host_id}"),
            "--stop-grace",
            "2",
            *self._common(),
            *extra,
        ]
        proc = Proc(f"agent-{host_id}", argv, self.tmp / f"agent-{host_id}.log")
        self.procs.append(proc)
        return proc

    def channel(self, address: str, role: str = "service") -> aio.Channel:
        channel = connect(address, token=self.tokens[role], trace=False)
        self._channels.append(channel)
        return channel

    def rm_stub(self, address: str, role: str = "service") -> rm_grpc.ResourceManagerServiceStub:
        return rm_grpc.ResourceManagerServiceStub(self.channel(address, role))

    def agent_stub(self, address: str) -> ha_grpc.HostAgentServiceStub:
        return ha_grpc.HostAgentServiceStub(self.channel(address, "service"))

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
        for proc in reversed(self.procs):
            proc.kill()

    def logs(self) -> str:
        return "\n".join(f"===== {p.name}\n{p.log()[-4000:]}" for p in self.procs)
