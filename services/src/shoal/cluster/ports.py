"""Loopback ports for the local cluster: :class:`PortReservations` holds each port until the
process that uses it listens, so two services never race for one.

Part of the local cluster: :mod:`shoal.cluster.local` re-exports every name here.
"""

from __future__ import annotations


def free_port() -> int:
    """A port free now (it may be taken before it is used: prefer :class:`PortReservations`)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PortReservations:
    """Loopback ports held until the processes that use them listen: each is a socket bound
    (never listening) with SO_REUSEADDR and SO_REUSEPORT, so no other bind(0) or outgoing
    connection gets that port, two services never get the same one, and the service itself
    can still bind it (gRPC binds with SO_REUSEPORT, the metrics and dashboard servers with
    SO_REUSEADDR; neither conflicts with a bound socket that does not listen). Releasing
    after everything is up closes the race of "pick a free port, release it, bind it later"
    (the cause of "Failed to bind to address 127.0.0.1:41641")."""

    def __init__(self) -> None:
        self._sockets: list[object] = []

    def take(self) -> int:
        import socket

        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "SO_REUSEPORT"):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", 0))
        self._sockets.append(sock)
        return int(sock.getsockname()[1])

    def release(self) -> None:
        for sock in self._sockets:
            sock.close()  # type: ignore[attr-defined]
        self._sockets.clear()
