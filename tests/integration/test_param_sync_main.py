"""A parameter-sync shard process on the shared service skeleton (run_service, issue 15): it
announces LISTENING, registers its address in etcd, and on SIGTERM revokes the registration at
once (long before its lease could expire) and exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shoal.param_sync.main import registry_key
from tests.support import async_wait_until, free_port, make_tokens


async def _gone(store, key: str) -> bool:  # type: ignore[no-untyped-def]
    return await store.get(key) is None


@pytest.mark.slow
async def test_sigterm_revokes_a_shard_registration_at_once_and_exits_cleanly(
    etcd, tmp_path: Path
) -> None:
    from shoal.runtime.store import EtcdStore

    tokens = make_tokens(tmp_path / "tokens")
    address = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen(  # noqa: ASYNC220 - started once, waited for through etcd
        [
            sys.executable,
            "-m",
            "shoal.param_sync",
            "--shard-index",
            "5",
            "--listen",
            address,
            "--tokens-file",
            str(tmp_path / "tokens"),
            "--service-token",
            tokens["service"],
            "--etcd",
            ",".join(etcd.endpoints),
            "--registration-ttl",
            "120",  # an expiry would take minutes: the key must go by revocation
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        async with EtcdStore(etcd.endpoints, timeout=3.0) as store:
            kv = await async_wait_until(
                lambda: store.get(registry_key(5)), timeout=60, what="registration"
            )
            assert kv.value.decode() == address and kv.lease
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
            assert proc.stdout is not None
            assert f"LISTENING {address.rsplit(':', 1)[1]}" in proc.stdout.read().decode()
            await async_wait_until(
                lambda: _gone(store, registry_key(5)), timeout=10, what="revocation"
            )
    finally:
        if proc.poll() is None:
            proc.kill()
