"""How a same-host lane's segment gets from the shard to its learner (docs/data-plane.md, "The
same-host lane"): the segment has no name (``shoal.contract.shm``), so the shard hands its file
descriptor over a Unix socket (``SCM_RIGHTS``) to whoever shows the lane's one-time token.

* The shard listens on one socket per process (:class:`HandoffServer`) in Linux's abstract
  namespace: no file anywhere, a name with 128 random bits (``@shoal-lane-<hex>``; the
  network namespace scopes it, so learners in another one fall back to gRPC).
* OpenSharedLane's reply, on the authenticated gRPC channel, carries that address and a token
  of :data:`TOKEN_BYTES` random bytes made for that one lane (:meth:`HandoffServer.offer`).
* The learner (:func:`fetch_fd`) connects, sends the token and receives exactly one
  descriptor with the byte ``L``; it checks the segment behind it (``Segment.from_fd``). An
  offer made with ``keep`` hands the connection on afterwards (the shard serves the lane's
  control channel on it, ``shoal.contract.lane_control``; the learner keeps it with
  :func:`fetch_fd_keeping`); any other is closed once the descriptor went.
* The shard hands a token's descriptor once, before the offer's deadline, and only to a peer
  running as its own user (``SO_PEERCRED``). Anything else (a wrong, used or expired token,
  another user, a peer silent for :data:`READ_TIMEOUT_S`, one beyond :data:`MAX_PENDING`
  waiting peers) closes the connection with nothing sent, and changes nothing; it is logged,
  one line per refusal, at most one line per :data:`LOG_EVERY_S` (the line counts those not
  logged).

Linux only (abstract sockets, ``SO_PEERCRED``); nothing here imports gRPC or torch.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import os
import secrets
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

from shoal.contract.shm import LaneError, Segment

__all__ = [
    "LOG_EVERY_S",
    "MAX_PENDING",
    "READ_TIMEOUT_S",
    "TOKEN_BYTES",
    "HandoffServer",
    "fetch_fd",
    "fetch_fd_keeping",
    "peer_credentials",
    "take_segment",
]

log = logging.getLogger("shoal.lane_handoff")

#: The length of a lane's one-time token (256 random bits).
TOKEN_BYTES = 32
#: Seconds the shard waits for a connected peer's token before it closes the connection.
READ_TIMEOUT_S = 5.0
#: At most one refusal line per this many seconds (the next line counts the ones not logged).
LOG_EVERY_S = 10.0
#: Connections waiting for their token at once; more are closed at once (a flood of silent
#: peers cannot pile up descriptors in the shard).
MAX_PENDING = 64
_OK = b"L"
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _sockaddr(address: str) -> str:
    if not address.startswith("@") or len(address) < 2 or "\0" in address:
        raise LaneError(f"socket_address ({address!r}) must be an abstract socket name (@...)")
    return "\0" + address[1:]


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected Unix socket, as the
    kernel recorded them when it connected (``SO_PEERCRED``)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
    pid, uid, gid = _CRED.unpack(raw)
    return pid, uid, gid


@dataclass
class _Offer:
    fd: int
    deadline: float  # on the server's clock
    on_sent: Callable[[], None]
    what: str  # for the logs: whose lane
    # Takes the connection once the descriptor went (the lane's control channel,
    # ``shoal.contract.lane_control``); None: the connection is closed then.
    keep: Callable[[socket.socket], None] | None = None


class HandoffServer:
    """The shard's end: tokens to descriptors, each handed at most once. Start it inside the
    event loop (:meth:`start`); the descriptors stay the caller's (``on_sent`` tells it one
    was handed: it may close its own then)."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_refused: Callable[[], None] | None = None,
    ) -> None:
        self.address = f"@shoal-lane-{secrets.token_hex(16)}"
        self._clock = clock
        self._on_refused = on_refused  # a metric, for each refusal
        self._offers: dict[bytes, _Offer] = {}
        self._sock: socket.socket | None = None
        self._serving: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._uid = os.getuid()
        self._last_line = -LOG_EVERY_S
        self._unlogged = 0
        #: Descriptors handed and connections refused (for tests and logs).
        self.handed = 0
        self.refused = 0

    @property
    def started(self) -> bool:
        return self._sock is not None

    def start(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(_sockaddr(self.address))
            sock.listen(64)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._serving = asyncio.get_running_loop().create_task(self._serve(sock))

    def offer(
        self,
        fd: int,
        *,
        window_s: float,
        on_sent: Callable[[], None],
        what: str,
        keep: Callable[[socket.socket], None] | None = None,
    ) -> bytes:
        """A new one-time token for ``fd``, valid for ``window_s`` seconds from now. ``keep``
        takes the connection (non-blocking, its own to close) once the descriptor was handed
        on it; without it the connection is closed then."""
        token = secrets.token_bytes(TOKEN_BYTES)
        self._offers[token] = _Offer(fd, self._clock() + window_s, on_sent, what, keep)
        return token

    def withdraw(self, token: bytes) -> None:
        """The token hands nothing any more (the lane went, or its time is up)."""
        self._offers.pop(token, None)

    @property
    def offers(self) -> int:
        return len(self._offers)

    async def close(self) -> None:
        self._offers.clear()
        tasks = [t for t in (self._serving, *self._connections) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def _serve(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as exc:  # EMFILE and friends: do not spin
                log.warning("lane handoff socket: %s", exc)
                await asyncio.sleep(0.1)
                continue
            if len(self._connections) >= MAX_PENDING:
                conn.close()
                self._refuse(f"{MAX_PENDING} connections wait for their token already")
                continue
            task = loop.create_task(self._handle(conn))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _handle(self, conn: socket.socket) -> None:
        try:
            keep = await self._hand(conn)
        except BaseException:
            conn.close()
            raise
        if keep is None:
            conn.close()
        else:
            keep(conn)

    async def _hand(self, conn: socket.socket) -> Callable[[socket.socket], None] | None:
        """Check the peer and its token, hand the descriptor; what takes the connection then
        (None: close it)."""
        conn.setblocking(False)
        try:
            pid, uid, _ = peer_credentials(conn)
        except OSError as exc:
            self._refuse(f"no peer credentials ({exc})")
            return None
        if uid != self._uid:
            self._refuse(f"peer pid {pid} runs as uid {uid}, not {self._uid}")
            return None
        try:
            token = await asyncio.wait_for(self._read_token(conn), READ_TIMEOUT_S)
        except (TimeoutError, OSError) as exc:
            self._refuse(f"peer pid {pid} sent no token ({type(exc).__name__})")
            return None
        offer = self._offers.pop(token, None) if len(token) == TOKEN_BYTES else None
        if offer is None:
            self._refuse(f"peer pid {pid} sent an unknown, used or expired token")
            return None
        if self._clock() > offer.deadline:
            self._refuse(f"peer pid {pid} came after the deadline of {offer.what}")
            return None
        try:
            # A fresh connection's send buffer has room for one byte and one descriptor.
            socket.send_fds(conn, [_OK], [offer.fd])
        except OSError as exc:
            self._refuse(f"handing {offer.what} to pid {pid} failed: {exc}")
            return None
        self.handed += 1
        log.info("%s: descriptor handed to pid %d", offer.what, pid)
        offer.on_sent()
        return offer.keep

    async def _read_token(self, conn: socket.socket) -> bytes:
        loop = asyncio.get_running_loop()
        token = b""
        while len(token) < TOKEN_BYTES:
            part = await loop.sock_recv(conn, TOKEN_BYTES - len(token))
            if not part:
                break
            token += part
        return token

    def _refuse(self, why: str) -> None:
        self.refused += 1
        if self._on_refused is not None:
            self._on_refused()
        now = self._clock()
        if now - self._last_line < LOG_EVERY_S:
            self._unlogged += 1
            return
        more = f" ({self._unlogged} more refused since the last line)" if self._unlogged else ""
        log.warning("lane handoff refused: %s; nothing handed%s", why, more)
        self._last_line, self._unlogged = now, 0


def fetch_fd(address: str, token: bytes, *, timeout: float = 10.0) -> int:
    """The descriptor the shard at ``address`` hands for ``token`` (blocking; the caller owns
    and closes it). :class:`LaneError` when it hands none (the token was wrong, used or
    expired) or the peer is not this user's; OSError when it cannot be reached."""
    fd, sock = fetch_fd_keeping(address, token, timeout=timeout)
    sock.close()
    return fd


def take_segment(
    address: str,
    token: bytes,
    size: int,
    nonce: bytes,
    *,
    read_only: bool = False,
    timeout: float = 10.0,
) -> Segment:
    """The segment whose descriptor the shard at ``address`` hands for ``token``: fetched
    (:func:`fetch_fd`), checked and mapped (``Segment.from_fd``, with ``read_only``), its
    descriptor closed (blocking)."""
    fd = fetch_fd(address, token, timeout=timeout)
    try:
        return Segment.from_fd(fd, size, nonce, read_only=read_only)
    finally:
        os.close(fd)


def fetch_fd_keeping(
    address: str, token: bytes, *, timeout: float = 10.0
) -> tuple[int, socket.socket]:
    """:func:`fetch_fd`, and the connected socket it came over (blocking, ``timeout`` set;
    the caller owns both): a shard that offered the lane with ``keep`` serves the lane's
    control on it (``shoal.contract.lane_control``), any other has closed it."""
    sockaddr = _sockaddr(address)
    if len(token) != TOKEN_BYTES:
        raise LaneError(f"token ({len(token)} bytes) must be {TOKEN_BYTES} bytes")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(timeout)
        sock.connect(sockaddr)
        pid, uid, _ = peer_credentials(sock)
        if uid != os.getuid():
            raise LaneError(f"the lane socket {address} is pid {pid}'s of uid {uid}, not ours")
        try:
            sock.sendall(token)
            msg, fds, flags = _recv_fds(sock)
        except (BrokenPipeError, ConnectionResetError):  # it hung up on us: refused
            msg, fds, flags = b"", [], 0
        if msg == _OK and len(fds) == 1 and not flags & socket.MSG_CTRUNC:
            return fds[0], sock
        for fd in fds:
            os.close(fd)
        raise LaneError(
            f"the shard at {address} handed {len(fds)} descriptors (not 1) for the token: "
            "wrong, used or expired"
        )
    except BaseException:
        sock.close()
        raise


def _recv_fds(sock: socket.socket) -> tuple[bytes, list[int], int]:
    """One message and the descriptors with it, close-on-exec (``socket.recv_fds`` of Python
    3.11 drops its flags: it cannot ask for MSG_CMSG_CLOEXEC). Room for two descriptors, so
    that a peer sending more is seen (the caller refuses anything but one)."""
    fds = array.array("i")
    msg, ancillary, flags, _ = sock.recvmsg(
        16, socket.CMSG_SPACE(2 * fds.itemsize), socket.MSG_CMSG_CLOEXEC
    )
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    return msg, list(fds), flags
