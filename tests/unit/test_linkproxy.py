"""The chaos suite's TCP proxy (tests/chaos/linkproxy.py) against a real echo server: it
forwards both ways, delays by its latency, holds everything while partitioned and delivers it
when healed, and resets every connection on a cut."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from tests.chaos.linkproxy import LinkProxy
from tests.support import wait_until


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.fixture
def proxy() -> Iterator[LinkProxy]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    link = LinkProxy(f"127.0.0.1:{server.server_address[1]}")
    link.start()
    try:
        yield link
    finally:
        link.stop()
        server.shutdown()
        server.server_close()


def _connect(link: LinkProxy) -> socket.socket:
    host, port = link.address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def _echo(sock: socket.socket, data: bytes) -> bytes:
    sock.sendall(data)
    got = b""
    while len(got) < len(data):
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def test_forwards_both_ways_and_counts(proxy: LinkProxy) -> None:
    with _connect(proxy) as sock:
        assert _echo(sock, b"hello") == b"hello"
    # the proxy counts after its write returns, which can be just after the client has read
    wait_until(lambda: proxy.stats.down_bytes >= 5, timeout=10, what="5 bytes counted down")
    assert proxy.stats.connections == 1
    assert proxy.stats.up_bytes == 5 and proxy.stats.down_bytes == 5


def test_latency_delays_each_direction(proxy: LinkProxy) -> None:
    proxy.latency_s = 0.2
    with _connect(proxy) as sock:
        start = time.monotonic()
        assert _echo(sock, b"x") == b"x"
        assert time.monotonic() - start >= 0.4  # 0.2 s up, 0.2 s down


def test_a_partition_holds_data_until_healed(proxy: LinkProxy) -> None:
    with _connect(proxy) as sock:
        assert _echo(sock, b"a") == b"a"
        proxy.partition(True)
        sock.sendall(b"held")
        sock.settimeout(0.5)
        with pytest.raises(TimeoutError):
            sock.recv(10)
        proxy.partition(False)
        sock.settimeout(10)
        assert sock.recv(10) == b"held"


def test_a_cut_resets_the_connection(proxy: LinkProxy) -> None:
    with _connect(proxy) as sock:
        assert _echo(sock, b"a") == b"a"
        proxy.cut()
        sock.settimeout(10)
        try:
            assert sock.recv(10) == b""  # closed (or reset, below)
        except ConnectionResetError:
            pass
    assert proxy.stats.cuts == 1


def test_loss_delays_but_keeps_the_order(proxy: LinkProxy) -> None:
    proxy.loss = 1.0
    proxy.rto_s = 0.1
    with _connect(proxy) as sock:
        for i in range(3):
            assert _echo(sock, b"%d" % i) == b"%d" % i
    assert proxy.stats.delayed_chunks >= 3
