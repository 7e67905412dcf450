"""Credentials change without restarts: a user added with ``shoal-service auth add-user`` is
accepted by every running replica within seconds, and refused by all of them within seconds
of ``shoal-service auth revoke`` (real etcd, two real resource-manager processes)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc import aio

from shoal.runtime.channels import connect
from shoal.runtime.etcd_server import EtcdServer
from shoal.v1 import (
    resource_manager_service_pb2 as rm_pb2,
    resource_manager_service_pb2_grpc as rm_grpc,
)
from tests.integration._shoal_processes import ShoalProcesses
from tests.support import async_wait_until

pytestmark = pytest.mark.timeout(180)

#: How soon every replica must agree (the watch usually takes milliseconds).
WITHIN_S = 10.0


def auth(etcd: EtcdServer, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shoal.runtime.main", "auth", "--etcd", etcd.endpoints[0], *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


async def status(address: str, token: str) -> grpc.StatusCode:
    """INVALID_ARGUMENT once the caller is authenticated (the host id is checked after the
    token, by the leader and the standby alike), UNAUTHENTICATED before."""
    channel = connect(address, token=token, trace=False)
    try:
        await rm_grpc.ResourceManagerServiceStub(channel).GetHost(
            rm_pb2.GetHostRequest(host_id=".."), timeout=5
        )
        return grpc.StatusCode.OK
    except aio.AioRpcError as exc:
        return exc.code()
    finally:
        await channel.close()


async def test_a_user_added_or_revoked_in_etcd_is_known_to_every_replica_within_seconds(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    shoal = ShoalProcesses(tmp_path)
    try:
        replicas = [shoal.resource_manager(etcd.endpoints) for _ in range(2)]
        for replica in replicas:  # up: answering (an unknown token) with UNAUTHENTICATED
            await async_wait_until(
                lambda r=replica: _refused(r.address, "nobody"),
                timeout=60,
                what=f"{replica.name} up",
            )
        added = auth(etcd, "add-user", "carol", "--role", "user")
        assert added.returncode == 0, added.stderr
        token = added.stdout.strip()
        assert len(token) == 64 and "carol" in added.stderr
        started = time.monotonic()
        for replica in replicas:
            await async_wait_until(
                lambda r=replica: _authenticated(r.address, token),
                timeout=WITHIN_S,
                interval=0.1,
                what=f"carol known to {replica.name}",
            )
        print(f"carol known to both replicas after {time.monotonic() - started:.2f} s")
        listed = auth(etcd, "list")
        assert "carol\tuser\tsha256:" in listed.stdout
        assert token not in listed.stdout  # only the digest is stored

        rotated = auth(etcd, "rotate", "carol")
        assert rotated.returncode == 0, rotated.stderr
        new = rotated.stdout.strip()
        for replica in replicas:
            await async_wait_until(
                lambda r=replica: _refused(r.address, token),
                timeout=WITHIN_S,
                interval=0.1,
                what=f"carol's old token refused by {replica.name}",
            )
            assert await _authenticated(replica.address, new)
        token = new
        revoked = auth(etcd, "revoke", "carol")
        assert revoked.returncode == 0, revoked.stderr
        for replica in replicas:
            await async_wait_until(
                lambda r=replica: _refused(r.address, token),
                timeout=WITHIN_S,
                interval=0.1,
                what=f"carol refused by {replica.name}",
            )
        bad = auth(etcd, "add-user", "../carol")
        assert bad.returncode == 2 and "name ('../carol')" in bad.stderr
    finally:
        await shoal.close()


async def _authenticated(address: str, token: str) -> bool:
    return await status(address, token) == grpc.StatusCode.INVALID_ARGUMENT


async def _refused(address: str, token: str) -> bool:
    return await status(address, token) == grpc.StatusCode.UNAUTHENTICATED
