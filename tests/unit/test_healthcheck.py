"""``shoal-healthcheck`` (the containers' health probe) against the real server bootstrap, in
process on port 0: SERVING, NOT_SERVING while shutting down, nothing listening, bad arguments."""

from __future__ import annotations

import asyncio
import time

import pytest

from shoal.runtime import healthcheck
from shoal.runtime.config import ServerConfig
from shoal.runtime.server import ServiceBinding, create_server
from shoal.v1 import job_scheduler_service_pb2_grpc
from tests.support import free_port, make_tokens
from tests.unit.test_runtime_server import ROLES, SERVICE, RecordingScheduler


@pytest.fixture
async def running(tmp_path):
    make_tokens(tmp_path / "tokens")
    config = ServerConfig(service_name="test", tokens_file=str(tmp_path / "tokens"))
    server = await create_server(
        config,
        [
            ServiceBinding(
                SERVICE,
                job_scheduler_service_pb2_grpc.add_JobSchedulerServiceServicer_to_server,
                RecordingScheduler(),
                ROLES,
            )
        ],
    )
    yield server
    await server.stop(0)


async def probe(*argv: str) -> int:
    # The probe is a blocking client: run it beside the event loop that serves.
    return await asyncio.to_thread(healthcheck.main, list(argv))


async def test_a_serving_server_is_healthy_without_a_token(running):
    assert await probe(running.address) == 0
    assert await probe(running.address, "--service", SERVICE) == 0


async def test_a_server_shutting_down_is_unhealthy(running, capsys):
    await running.set_serving(False)
    assert await probe(running.address) == 1
    assert f"{running.address} (server): NOT_SERVING" in capsys.readouterr().err


async def test_an_unknown_service_is_unhealthy(running, capsys):
    assert await probe(running.address, "--service", "no.such.Service") == 1
    assert "NOT_FOUND" in capsys.readouterr().err


def test_nothing_listening_is_unhealthy_within_the_timeout(capsys):
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    assert healthcheck.main([address, "--timeout", "2"]) == 1
    assert time.monotonic() - started < 10
    assert address in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["localhost"], "address ('localhost') must be HOST:PORT"),
        (["127.0.0.1:7000", "--timeout", "soon"], "timeout ('soon') must be a number"),
        (["127.0.0.1:7000", "--timeout", "0"], "timeout ('0') must be > 0"),
    ],
)
def test_bad_arguments_name_the_field_and_the_value(argv, message, capsys):
    assert healthcheck.main(argv) == 2
    assert message in capsys.readouterr().err
