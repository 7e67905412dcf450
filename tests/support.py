"""Helpers shared by the tests: bounded waits (never fixed sleeps), free ports, tokens."""

from __future__ import annotations

import asyncio
import inspect
import os
import random
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from shoal.runtime.auth import Role, new_token, write_tokens_file

T = TypeVar("T")


def wait_until(
    condition: Callable[[], T], *, timeout: float = 10.0, interval: float = 0.02, what: str = ""
) -> T:
    """Poll ``condition`` until it returns a truthy value; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or condition}")
        time.sleep(interval)


async def async_wait_until(
    condition: Callable[[], Any],
    *,
    timeout: float = 10.0,
    interval: float = 0.02,
    what: str = "",
) -> Any:
    """Like :func:`wait_until`; ``condition`` may be sync or async."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or condition}")
        await asyncio.sleep(interval)


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_PORTS = random.Random(os.getpid() ^ time.time_ns())


def free_port() -> int:
    """A loopback port nothing listens on now, for a server a test starts next.

    Taken below the kernel's ephemeral range (bind(0) and every outgoing connection's source
    port come from that range, so a port found there could be taken by a connection of another
    test before the server binds it: "Address already in use" on a loaded machine).
    """
    high = _ephemeral_low() - 1
    for _ in range(500):
        port = _PORTS.randint(max(1024, high - 12_000), high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_tokens(path: Path) -> dict[str, str]:
    """A tokens file with one token per role; returns role name -> token."""
    tokens = {
        "user": new_token(),
        "other": new_token(),
        "service": new_token(),
        "admin": new_token(),
    }
    write_tokens_file(
        path,
        [
            (tokens["user"], "alice", Role.USER),
            (tokens["other"], "bob", Role.USER),
            (tokens["service"], "scheduler", Role.SERVICE),
            (tokens["admin"], "root", Role.ADMIN),
        ],
    )
    return tokens
