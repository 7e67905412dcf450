"""Mutual TLS in process: the cluster CA and certificates (shoal.runtime.pki), a service served
with mTLS, credentials bound to the kind of certificate, and the client's one-line diagnosis
of every way a TLS handshake fails."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc import aio

from shoal.client import AsyncClient, ClientConfig, ShoalClientError
from shoal.runtime.auth import USERS_AND_SERVICES, MethodRoles, current_principal
from shoal.runtime.channels import connect
from shoal.runtime.config import ServerConfig, TLSConfig
from shoal.runtime.pki import CertificateAuthority, Issued
from shoal.runtime.server import RunningServer, ServiceBinding, create_server
from shoal.v1 import job_pb2, job_scheduler_service_pb2 as js, job_scheduler_service_pb2_grpc
from tests.support import make_tokens

SERVICE = "shoal.v1.JobSchedulerService"


class Echo(job_scheduler_service_pb2_grpc.JobSchedulerServiceServicer):
    async def GetJob(self, request, context):
        return js.GetJobResponse(
            job=job_pb2.Job(job_id=request.job_id, owner=current_principal().name)
        )


@dataclass
class Bed:
    tmp: Path
    ca: CertificateAuthority
    other_ca: CertificateAuthority
    certs: dict[str, Issued]
    tls: RunningServer
    plain: RunningServer
    tokens: dict[str, str]

    def config(
        self, name: str | None, *, ca: Path | None = None, plain: bool = False
    ) -> ClientConfig:
        server = self.plain if plain else self.tls
        cert = self.certs[name] if name else None
        return ClientConfig(
            scheduler=(server.address,),
            token=self.tokens["user"],
            tls_ca=str(ca) if ca else None,
            tls_cert=str(cert.cert) if cert else None,
            tls_key=str(cert.key) if cert else None,
        )


@pytest.fixture
async def bed(tmp_path: Path) -> AsyncIterator[Bed]:
    ca = CertificateAuthority.create(tmp_path / "ca")
    other = CertificateAuthority.create(tmp_path / "other")
    certs = {
        "service": ca.issue("service", "job-scheduler-0"),
        "user": ca.issue("user", "alice"),
        "learner": ca.issue("learner", "host-1"),
        "foreign": other.issue("user", "mallory"),
    }
    tokens = make_tokens(tmp_path / "tokens")
    roles = MethodRoles(SERVICE, USERS_AND_SERVICES)
    add = job_scheduler_service_pb2_grpc.add_JobSchedulerServiceServicer_to_server
    srv = certs["service"]
    tls = await create_server(
        ServerConfig(
            "test",
            tokens_file=str(tmp_path / "tokens"),
            tls=TLSConfig(str(srv.cert), str(srv.key), str(ca.ca_file)),
        ),
        [ServiceBinding(SERVICE, add, Echo(), roles)],
    )
    plain = await create_server(
        ServerConfig("test", tokens_file=str(tmp_path / "tokens")),
        [ServiceBinding(SERVICE, add, Echo(), roles)],
    )
    yield Bed(tmp_path, ca, other, certs, tls, plain, tokens)
    await tls.stop(0)
    await plain.stop(0)


def test_a_certificate_names_its_kind_and_hosts_and_serves_both_ends(tmp_path: Path) -> None:
    ca = CertificateAuthority.create(tmp_path)
    issued = ca.issue("service", "parameter-sync-1", hosts=["127.0.0.1", "shard-1.internal"])
    cert = x509.load_pem_x509_certificate(issued.cert.read_bytes())
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == (
        "service:parameter-sync-1"
    )
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "shard-1.internal" in san.get_values_for_type(x509.DNSName)
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(usage)
    cert.verify_directly_issued_by(ca.certificate)
    assert issued.key.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "ca-key.pem").stat().st_mode & 0o777 == 0o600
    with pytest.raises(ValueError, match="kind"):
        ca.issue("root", "x")
    with pytest.raises(ValueError, match="name"):
        ca.issue("user", "../x")


async def test_a_client_with_the_clusters_certificate_is_served(bed: Bed) -> None:
    async with AsyncClient(bed.config("user", ca=bed.ca.ca_file), retries=0) as client:
        job = await client.get_job("job-1")
    assert job.owner == "alice"


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("plaintext client", "speaks TLS but the client has no tls_ca"),
        ("no client certificate", "requires a client certificate"),
        ("another CA", "is not signed by the CA in tls_ca"),
        ("a foreign client certificate", "refused the client certificate"),
        ("TLS to a plaintext server", "does not speak TLS"),
    ],
)
async def test_every_tls_mistake_gets_one_clear_line_not_a_bare_unavailable(
    bed: Bed, case: str, expected: str
) -> None:
    config = {
        "plaintext client": lambda: bed.config(None),
        "no client certificate": lambda: bed.config(None, ca=bed.ca.ca_file),
        "another CA": lambda: bed.config("user", ca=bed.other_ca.ca_file),
        "a foreign client certificate": lambda: bed.config("foreign", ca=bed.ca.ca_file),
        "TLS to a plaintext server": lambda: bed.config("user", ca=bed.ca.ca_file, plain=True),
    }[case]()
    async with AsyncClient(config, timeout=5, retries=0) as client:
        with pytest.raises(ShoalClientError) as caught:
            await client.get_job("job-1")
    assert caught.value.code == "UNAVAILABLE"
    assert caught.value.message.startswith("TLS: ") and expected in caught.value.message
    assert "\n" not in str(caught.value)


async def test_the_cli_says_what_is_wrong_in_one_line(bed: Bed, tmp_path: Path) -> None:
    config = tmp_path / "cli.json"
    config.write_text(f'{{"scheduler": ["{bed.tls.address}"], "token": "{bed.tokens["user"]}"}}')
    env = {**os.environ, "SHOAL_CONFIG": str(config)}
    env.pop("GRPC_VERBOSITY", None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "shoal.cli.main",
        "jobs",
        "get",
        "job-1",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 1, (out, err)
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1, lines
    assert "TLS:" in lines[0] and "tls_ca" in lines[0]


async def test_credentials_are_bound_to_the_kind_of_certificate_they_come_over(bed: Bed) -> None:
    """A service token is accepted only over a service certificate, and a learner certificate
    carries learner credentials only: a service token leaked into a learner is useless."""

    async def call(cert: str, role: str) -> grpc.StatusCode:
        issued = bed.certs[cert]
        channel = connect(
            bed.tls.address,
            token=bed.tokens[role],
            tls_ca=str(bed.ca.ca_file),
            tls_cert=str(issued.cert),
            tls_key=str(issued.key),
            trace=False,
        )
        try:
            stub = job_scheduler_service_pb2_grpc.JobSchedulerServiceStub(channel)
            await stub.GetJob(js.GetJobRequest(job_id="job-1"), timeout=5)
            return grpc.StatusCode.OK
        except aio.AioRpcError as exc:
            return exc.code()
        finally:
            await channel.close()

    assert await call("service", "service") == grpc.StatusCode.OK
    assert await call("user", "user") == grpc.StatusCode.OK
    assert await call("user", "service") == grpc.StatusCode.PERMISSION_DENIED
    assert await call("learner", "service") == grpc.StatusCode.PERMISSION_DENIED
    assert await call("learner", "user") == grpc.StatusCode.PERMISSION_DENIED
    assert await call("learner", "admin") == grpc.StatusCode.PERMISSION_DENIED


async def test_the_health_probe_speaks_mtls_with_the_services_own_files(bed: Bed) -> None:
    from shoal.runtime import healthcheck

    srv = bed.certs["service"]
    tls = ["--tls-ca", str(bed.ca.ca_file), "--tls-cert", str(srv.cert), "--tls-key", str(srv.key)]
    assert await asyncio.to_thread(healthcheck.main, [bed.tls.address, *tls]) == 0
    assert await asyncio.to_thread(healthcheck.main, [bed.tls.address, "--timeout", "1"]) == 1


def test_no_service_module_opens_a_grpc_channel_but_through_connect() -> None:
    """Every service channel gets the process's TLS and token from one place
    (shoal.runtime.channels.connect); only the etcd client makes its own (with --etcd-ca)."""
    root = Path(__file__).resolve().parents[2] / "services" / "src" / "shoal"
    allowed = {"runtime/channels.py", "runtime/store/etcd.py", "runtime/healthcheck.py"}
    offenders = [
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if str(path.relative_to(root)) not in allowed
        and ("insecure_channel(" in path.read_text() or "secure_channel(" in path.read_text())
    ]
    # The local cluster's health probe uses the cluster's client certificate.
    assert offenders == ["cluster/local.py"], offenders


def test_a_host_agent_with_mtls_gives_its_learners_a_learner_certificate_never_its_own(
    tmp_path: Path,
) -> None:
    from shoal.host_agent.service import HostAgentConfig
    from shoal.runtime.errors import InvalidField

    ca = CertificateAuthority.create(tmp_path / "ca")
    own, learners = ca.issue("service", "host-1"), ca.issue("learner", "host-1")
    server = ServerConfig(
        "host-agent",
        allow_no_auth=True,
        tls=TLSConfig(str(own.cert), str(own.key), str(ca.ca_file)),
    )
    with pytest.raises(InvalidField, match="learner_tls_cert"):
        HostAgentConfig(server=server, host_id="host-1", work_dir=tmp_path)
    with pytest.raises(InvalidField, match="service credential"):
        HostAgentConfig(
            server=server,
            host_id="host-1",
            work_dir=tmp_path,
            learner_tls_cert=str(own.cert),
            learner_tls_key=str(own.key),
        )
    config = HostAgentConfig(
        server=server,
        host_id="host-1",
        work_dir=tmp_path,
        learner_tls_cert=str(learners.cert),
        learner_tls_key=str(learners.key),
    )
    assert config.learner_env() == {
        "SHOAL_TLS_CA": str(ca.ca_file),
        "SHOAL_TLS_CERT": str(learners.cert),
        "SHOAL_TLS_KEY": str(learners.key),
    }
