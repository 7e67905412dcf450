"""The runtime with real processes: grpcurl against a service, one trace across two services
exported to a real OTLP receiver, and graceful shutdown on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from shoal.v1 import (
    job_scheduler_service_pb2,
    job_scheduler_service_pb2_grpc,
    resource_manager_service_pb2,
    resource_manager_service_pb2_grpc,
)
from tests.support import make_tokens, wait_until

SCRIPT = Path(__file__).with_name("_chain_service.py")
GRPCURL = str(Path(sys.executable).parent / "grpcurl")


class ServiceProcess:
    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        line = wait_until(lambda: self._line("LISTENING"), timeout=30, what="LISTENING")
        self.port = int(line.split()[1])
        self.address = f"127.0.0.1:{self.port}"

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def _line(self, prefix: str) -> str | None:
        return next((ln for ln in self.lines if ln.startswith(prefix)), None)

    def wait_line(self, prefix: str, timeout: float = 10) -> str:
        return wait_until(lambda: self._line(prefix), timeout=timeout, what=prefix)

    def terminate(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=20)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture
def tokens(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    path = tmp_path / "tokens"
    return path, make_tokens(path)


@pytest.fixture
def spawn(tokens) -> Iterator:
    started: list[ServiceProcess] = []

    def _spawn(*args: str, env: dict[str, str] | None = None) -> ServiceProcess:
        full_env = {**os.environ, **(env or {})}
        sp = ServiceProcess(
            [*args, "--tokens-file", str(tokens[0]), "--service-token", tokens[1]["service"]],
            full_env,
        )
        started.append(sp)
        return sp

    yield _spawn
    for sp in started:
        sp.kill()


def grpcurl(*args: str) -> str:
    out = subprocess.run(
        [GRPCURL, "-plaintext", *args], capture_output=True, text=True, timeout=30, check=False
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_grpcurl_lists_describes_and_health_checks_a_runtime_service(spawn, tokens):
    back = spawn("back")
    listed = grpcurl(back.address, "list").split()
    assert "shoal.v1.ResourceManagerService" in listed
    assert "grpc.health.v1.Health" in listed
    described = grpcurl(back.address, "describe", "shoal.v1.ResourceManagerService")
    assert "rpc AcquireDevices" in described
    health = json.loads(
        grpcurl("-d", '{"service": ""}', back.address, "grpc.health.v1.Health/Check")
    )
    assert health == {"status": "SERVING"}
    reply = json.loads(
        grpcurl(
            "-H",
            f"authorization: Bearer {tokens[1]['user']}",
            "-d",
            '{"host_id": "h9"}',
            back.address,
            "shoal.v1.ResourceManagerService/GetHost",
        )
    )
    assert reply["host"]["host_id"] == "h9"  # grpcurl prints proto field names


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """A real OTLP/gRPC trace receiver that keeps what it is sent."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, str]] = []  # (service.name, span name, trace id)

    def Export(self, request, context):
        for resource_spans in request.resource_spans:
            attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    self.spans.append(
                        (attrs.get("service.name", ""), span.name, span.trace_id.hex())
                    )
        return trace_service_pb2.ExportTraceServiceResponse()


def test_two_services_in_a_call_chain_export_spans_with_one_trace_id(spawn, tokens):
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"}
        back = spawn("back", env=env)
        front = spawn("front", "--downstream", back.address, env=env)
        with grpc.insecure_channel(front.address) as channel:
            stub = job_scheduler_service_pb2_grpc.JobSchedulerServiceStub(channel)
            reply = stub.GetJob(
                job_scheduler_service_pb2.GetJobRequest(job_id="j1"),
                metadata=[("authorization", f"Bearer {tokens[1]['user']}")],
            )
        assert reply.job.state_reason == "h1"
        assert front.terminate() == 0
        assert back.terminate() == 0

        def chain() -> set[str] | None:
            by_trace: dict[str, set[str]] = {}
            for service, name, trace_id in receiver.spans:
                if name.endswith(("/GetJob", "/GetHost")):
                    by_trace.setdefault(trace_id, set()).add(service)
            return next((s for s in by_trace.values() if {"chain-front", "chain-back"} <= s), None)

        assert wait_until(chain, timeout=15, what="one trace with spans of both services")
    finally:
        server.stop(0)


def test_sigterm_lets_an_in_flight_call_finish_then_exits_cleanly(spawn, tokens):
    back = spawn("back")
    result: dict[str, object] = {}

    def call() -> None:
        with grpc.insecure_channel(back.address) as channel:
            stub = resource_manager_service_pb2_grpc.ResourceManagerServiceStub(channel)
            result["reply"] = stub.GetHost(
                resource_manager_service_pb2.GetHostRequest(host_id="slow"),
                metadata=[("authorization", f"Bearer {tokens[1]['user']}")],
                timeout=20,
            )

    caller = threading.Thread(target=call)
    caller.start()
    back.wait_line("SLOW-START")
    assert back.terminate() == 0
    caller.join(timeout=20)
    assert result["reply"].host.host_id == "slow"
    assert back.wait_line("STOPPED")
