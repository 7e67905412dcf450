"""Helpers shared by the tests: bounded waits (never fixed sleeps), free ports, tokens."""

from __future__ import annotations

import asyncio
import inspect
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


def free_port() -> int:
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
