"""Fixtures for integration tests against a real etcd.

* ``etcd``: a fresh single-member etcd per test on free loopback ports, torn down after it.
  It is an :class:`~shoal.runtime.etcd_server.EtcdServer`: ``.endpoints`` (``["127.0.0.1:port"]``),
  ``.stop()``, ``.kill()``, ``.restart()`` (same ports and data), ``.pause()`` / ``.resume()``
  (SIGSTOP / SIGCONT), ``.log_path``. Its log is kept under the test's ``tmp_path``.
* ``etcd_cluster``: the same with three members (``.members[i]`` for per-member faults).
* ``etcd_store``: an :class:`~shoal.runtime.store.EtcdStore` on ``etcd``, closed after the test.
* ``etcd_factory``: start more etcd servers or clusters in one test (all closed after it).
* ``tls_files``: a throw-away CA with a server certificate for 127.0.0.1 and a client
  certificate (made with the ``openssl`` CLI; the test is skipped without it).
* ``tcp_proxy``: ``await tcp_proxy("127.0.0.1:port")`` puts a :class:`TcpProxy` in front of an
  address; ``proxy.cut()`` drops every connection and refuses new ones until ``proxy.allow()``
  (a network partition between one client and a server that keeps running).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from shoal.runtime.etcd_server import EtcdCluster, EtcdServer
from shoal.runtime.store import EtcdStore


@pytest.fixture
def etcd_factory(tmp_path: Path) -> Iterator[Callable[[int], EtcdCluster]]:
    """``etcd_factory(members)`` starts an etcd of ``members`` members (1 gives an
    :class:`EtcdServer`); every one is closed after the test."""
    started: list[EtcdCluster] = []

    def start(members: int = 1) -> EtcdCluster:
        log_dir = tmp_path / f"etcd-logs-{len(started)}"
        cluster: EtcdCluster
        if members == 1:
            # A lone member needs no slack for peers: a short election timeout makes it
            # ready sooner (and allows leases down to 1 s).
            cluster = EtcdServer(
                log_dir=log_dir,
                unsafe_no_fsync=True,
                heartbeat_interval_ms=20,
                election_timeout_ms=200,
            )
        else:
            cluster = EtcdCluster(members, log_dir=log_dir, unsafe_no_fsync=True)
        started.append(cluster)
        return cluster.start()

    yield start
    for cluster in reversed(started):
        cluster.close()


@pytest.fixture
def etcd(etcd_factory: Callable[[int], EtcdCluster]) -> EtcdServer:
    server = etcd_factory(1)
    assert isinstance(server, EtcdServer)
    return server


@pytest.fixture
def etcd_cluster(etcd_factory: Callable[[int], EtcdCluster]) -> EtcdCluster:
    return etcd_factory(3)


@pytest.fixture
async def etcd_store(etcd: EtcdServer) -> AsyncIterator[EtcdStore]:
    store = EtcdStore(etcd.endpoints, timeout=3.0)
    try:
        yield store
    finally:
        await store.close()


class TcpProxy:
    """A TCP proxy on a free loopback port in front of ``target`` ("host:port")."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self._target = (host, int(port))
        self._server: asyncio.Server | None = None
        self._blocked = False
        self._writers: set[asyncio.StreamWriter] = set()
        self.connections = 0

    async def start(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self

    @property
    def endpoint(self) -> str:
        assert self._server is not None
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def cut(self) -> None:
        """Reset every open connection and refuse new ones."""
        self._blocked = True
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    def allow(self) -> None:
        self._blocked = False

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._blocked:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.transport.abort()
            return
        self.connections += 1
        self._writers.update((writer, up_writer))
        await asyncio.gather(
            self._pump(reader, up_writer), self._pump(up_reader, writer), return_exceptions=True
        )
        self._writers.difference_update((writer, up_writer))

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.transport.abort()

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()


@pytest.fixture
async def tcp_proxy() -> AsyncIterator[Callable[[str], Awaitable[TcpProxy]]]:
    proxies: list[TcpProxy] = []

    async def make(target: str) -> TcpProxy:
        proxy = await TcpProxy(target).start()
        proxies.append(proxy)
        return proxy

    yield make
    for proxy in proxies:
        await proxy.close()


@dataclass(frozen=True)
class TlsFiles:
    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


@pytest.fixture
def tls_files(tmp_path: Path) -> TlsFiles:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs the openssl CLI to make test certificates")
    d = tmp_path / "tls"
    d.mkdir()

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=d, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1", "-subj", "/CN=ca")
    for name, usage in (("server", "serverAuth"), ("client", "clientAuth")):
        (d / f"{name}.ext").write_text(f"subjectAltName=IP:127.0.0.1\nextendedKeyUsage={usage}\n")
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        run(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.crt", "-days", "1", "-extfile", f"{name}.ext",
        )  # fmt: skip
    return TlsFiles(
        d / "ca.crt", d / "server.crt", d / "server.key", d / "client.crt", d / "client.key"
    )
