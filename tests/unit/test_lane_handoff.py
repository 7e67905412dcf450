"""The handoff of a lane segment's descriptor (``shoal.contract.lane_handoff``) over a real
abstract Unix socket: a token fetches its descriptor once; a wrong, used, withdrawn or expired
token, a silent peer and a peer of another user get nothing and change nothing; refusals are
logged, at most one line per period."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator

import pytest

from shoal.contract import lane_handoff
from shoal.contract.lane_handoff import TOKEN_BYTES, HandoffServer, fetch_fd, fetch_fd_keeping
from shoal.contract.shm import LaneError, Segment
from tests.support import async_wait_until

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="abstract sockets: Linux only")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def server() -> AsyncIterator[tuple[HandoffServer, Clock]]:
    clock = Clock()
    srv = HandoffServer(clock=clock)
    srv.start()
    yield srv, clock
    await srv.close()


async def fetch(srv: HandoffServer, token: bytes) -> int:
    return await asyncio.to_thread(fetch_fd, srv.address, token, timeout=30)


async def refused_after(srv: HandoffServer, before: int) -> None:
    """The server counted the refusal (it may close before it counts)."""
    await async_wait_until(lambda: srv.refused > before, timeout=30, what="the refusal")


async def test_a_token_fetches_its_descriptor_once(server) -> None:
    srv, _ = server
    assert srv.address.startswith("@shoal-lane-") and len(srv.address) == len("@shoal-lane-") + 32
    seg = Segment.create(4096)
    sent: list[int] = []
    token = srv.offer(seg.fd, window_s=30, on_sent=lambda: sent.append(1), what="lane x")
    assert len(token) == TOKEN_BYTES
    fd = await fetch(srv, token)
    try:
        assert os.fstat(fd).st_ino == os.fstat(seg.fd).st_ino  # the same memfd
        peer = Segment.from_fd(fd, 4096, seg.nonce)
    finally:
        os.close(fd)
    assert sent == [1] and srv.handed == 1 and srv.offers == 0
    # Used: the same token again gets nothing.
    with pytest.raises(LaneError, match="handed 0 descriptors"):
        await fetch(srv, token)
    assert srv.handed == 1 and srv.refused == 1 and sent == [1]
    peer.close()
    seg.close()


async def test_an_offer_with_keep_hands_the_connection_on_and_one_without_closes_it(
    server,
) -> None:
    """``keep`` takes the connection the descriptor went over (the lane's control channel):
    it stays open both ways; without ``keep`` the peer finds it closed."""
    srv, _ = server
    seg = Segment.create(4096)
    kept: list[socket.socket] = []
    token = srv.offer(seg.fd, window_s=30, on_sent=lambda: None, what="lane x", keep=kept.append)
    fd, sock = await asyncio.to_thread(fetch_fd_keeping, srv.address, token, timeout=30)
    os.close(fd)
    with sock:
        assert len(kept) == 1 and srv.handed == 1
        with kept[0] as conn:
            conn.setblocking(True)
            sock.sendall(b"ping")
            assert conn.recv(4) == b"ping"
            conn.sendall(b"pong")
            assert sock.recv(4) == b"pong"
    plain = srv.offer(seg.fd, window_s=30, on_sent=lambda: None, what="lane y")
    fd, sock = await asyncio.to_thread(fetch_fd_keeping, srv.address, plain, timeout=30)
    os.close(fd)
    with sock:
        assert sock.recv(1) == b""  # closed by the shard once the descriptor went
    seg.close()


async def test_a_wrong_token_gets_nothing_and_changes_nothing(server) -> None:
    srv, _ = server
    seg = Segment.create(4096)
    token = srv.offer(seg.fd, window_s=30, on_sent=lambda: None, what="lane x")
    wrong = bytes(a ^ 1 for a in token)
    with pytest.raises(LaneError, match="wrong, used or expired"):
        await fetch(srv, wrong)
    with pytest.raises(LaneError, match=r"token \(3 bytes\)"):
        await fetch(srv, b"abc")  # never sent
    # A peer that sends a short token and hangs up, one that hangs up at once.
    for payload in (token[:5], b""):
        before = srv.refused
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect("\0" + srv.address[1:])
            sock.sendall(payload)
        await refused_after(srv, before)
    assert srv.offers == 1 and srv.handed == 0 and srv.refused == 3
    fd = await fetch(srv, token)  # the right token still works
    os.close(fd)
    seg.close()


async def test_an_expired_or_withdrawn_token_gets_nothing(server) -> None:
    srv, clock = server
    seg = Segment.create(4096)
    late = srv.offer(seg.fd, window_s=30, on_sent=lambda: None, what="lane x")
    gone = srv.offer(seg.fd, window_s=30, on_sent=lambda: None, what="lane y")
    clock.now += 30.5
    with pytest.raises(LaneError):
        await fetch(srv, late)
    srv.withdraw(gone)
    with pytest.raises(LaneError):
        await fetch(srv, gone)
    assert srv.handed == 0 and srv.refused == 2 and srv.offers == 0
    seg.close()


async def test_a_silent_peer_is_cut_off(server, monkeypatch) -> None:
    srv, _ = server
    monkeypatch.setattr(lane_handoff, "READ_TIMEOUT_S", 0.2)

    def silent() -> bytes:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect("\0" + srv.address[1:])
            sock.settimeout(30)
            return sock.recv(16)

    assert await asyncio.to_thread(silent) == b""  # closed by the server, nothing sent
    assert srv.refused == 1


async def test_silent_peers_beyond_the_limit_are_cut_off_at_once(server, monkeypatch) -> None:
    srv, _ = server
    monkeypatch.setattr(lane_handoff, "MAX_PENDING", 2)
    seg = Segment.create(4096)
    token = srv.offer(seg.fd, window_s=30, on_sent=lambda: None, what="lane x")
    silent = []
    for _ in range(2):
        sock = socket.socket(socket.AF_UNIX)
        sock.connect("\0" + srv.address[1:])
        silent.append(sock)
    await async_wait_until(lambda: len(srv._connections) == 2, timeout=30, what="2 pending")
    with pytest.raises(LaneError):  # a third, even with the right token: nothing
        await fetch(srv, token)
    assert srv.offers == 1 and srv.handed == 0
    for sock in silent:
        sock.close()
    await async_wait_until(lambda: not srv._connections, timeout=30, what="the silent ones gone")
    os.close(await fetch(srv, token))  # then it works
    seg.close()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a peer as another user")
async def test_a_peer_of_another_user_gets_nothing_even_with_the_token(server) -> None:
    srv, _ = server
    seg = Segment.create(4096)
    token = srv.offer(seg.fd, window_s=30, on_sent=lambda: None, what="lane x")
    # The child imports everything, then drops to nobody; it skips fetch_fd's own check of
    # the socket's owner to reach the server's check.
    script = (
        "import os, socket, sys\n"
        "from shoal.contract.lane_handoff import _recv_fds, fetch_fd\n"
        "from shoal.contract.shm import LaneError\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "with socket.socket(socket.AF_UNIX) as sock:\n"
        "    sock.settimeout(30)\n"
        f"    sock.connect('\\0' + {srv.address[1:]!r})\n"
        "    try:\n"
        f"        sock.sendall(bytes.fromhex({token.hex()!r}))\n"
        "        print('raw:', _recv_fds(sock))\n"
        "    except (BrokenPipeError, ConnectionResetError):\n"
        "        print('raw: reset')\n"
        "try:\n"
        f"    fetch_fd({srv.address!r}, bytes.fromhex({token.hex()!r}), timeout=30)\n"
        "except LaneError as exc:\n"
        "    print('refused:', exc)\n"
        "else:\n"
        "    print('HANDED')\n"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        script,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ},
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=60)
    text = out.decode()
    # The server sends nothing to another user's process (SO_PEERCRED); fetch_fd refuses a
    # socket of another user before it sends the token.
    assert "raw: reset" in text or "raw: (b'', [], 0)" in text, text
    assert "refused:" in text and "not ours" in text, text
    assert srv.offers == 1 and srv.handed == 0 and srv.refused == 2  # both connections
    fd = await fetch(srv, token)
    os.close(fd)
    seg.close()


async def test_the_server_refuses_a_peer_of_another_user(server) -> None:
    """The server's own check (SO_PEERCRED), with a server that believes it runs as
    another user: it sends nothing whatever the token."""
    srv, _ = server
    seg = Segment.create(4096)
    token = srv.offer(seg.fd, window_s=30, on_sent=lambda: None, what="lane x")
    srv._uid = os.getuid() + 1  # as if this process were another user's
    with pytest.raises(LaneError, match="handed 0 descriptors"):
        await fetch(srv, token)
    assert srv.offers == 1 and srv.handed == 0 and srv.refused == 1
    srv._uid = os.getuid()
    os.close(await fetch(srv, token))
    seg.close()


async def test_refusals_are_logged_at_most_once_per_period(server, caplog) -> None:
    srv, clock = server
    caplog.set_level(logging.WARNING, logger="shoal.lane_handoff")
    for _ in range(3):
        with pytest.raises(LaneError):
            await fetch(srv, bytes(TOKEN_BYTES))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "unknown, used or expired token" in lines[0], lines
    clock.now += lane_handoff.LOG_EVERY_S
    with pytest.raises(LaneError):
        await fetch(srv, bytes(TOKEN_BYTES))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "(2 more refused since the last line)" in lines[1], lines


def test_an_address_that_is_not_an_abstract_socket_is_refused_naming_it() -> None:
    for address in ("/tmp/sock", "", "@", "@a\0b"):
        with pytest.raises(LaneError, match="socket_address"):
            fetch_fd(address, bytes(TOKEN_BYTES))


def segments_open() -> int:
    """Descriptors of this process that are lane segments."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:shoal-lane")
        except OSError:
            pass  # the listing's own descriptor, closed by now
    return count


@pytest.mark.parametrize("count", [0, 2, 3])
def test_fetch_takes_exactly_one_descriptor_and_closes_any_others(count: int) -> None:
    """A socket that answers with no descriptor, or with more than one: refused, and the ones
    received are closed (none leaks into the learner)."""
    name = f"shoal-lane-test-{secrets.token_hex(8)}"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind("\0" + name)
    listener.listen(1)
    seg = Segment.create(4096)

    def answer() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(TOKEN_BYTES)
            socket.send_fds(conn, [b"L"], [seg.fd] * count)
            conn.recv(1)  # until the learner hung up

    server = threading.Thread(target=answer, daemon=True)
    server.start()
    assert segments_open() == 1  # the shard's own
    with pytest.raises(LaneError, match=f"handed {min(count, 2)} descriptors"):
        fetch_fd("@" + name, bytes(TOKEN_BYTES), timeout=30)
    server.join(timeout=30)
    assert segments_open() == 1  # nothing received stayed open
    listener.close()
    seg.close()
