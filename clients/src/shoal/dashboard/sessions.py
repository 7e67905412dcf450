"""Browser sessions of the dashboard: a random id in an HttpOnly cookie, everything else here.

A session holds what a login proved: the user's own bearer token (never sent back to the
browser), the principal and role the API said it maps to, and the API client built with that
token. The dashboard itself decides nothing about who may do what: every page and every action
is an API call made with the user's token, so the services' own authentication and per-job
authorization apply, whatever they become. A session ends at logout, after ``idle_s`` without
a request, after ``max_age_s`` in all, or as soon as the API answers UNAUTHENTICATED (a revoked
token).

No I/O and an injected clock: unit-tested without a browser.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Session", "SessionStore"]


@dataclass
class Session:
    """One logged-in browser."""

    session_id: str
    principal: str
    role: str  # "user", "admin", "service" (as the API names it)
    token: str = field(repr=False)
    csrf: str = field(repr=False)
    created: float
    last_seen: float
    client: Any = field(default=None, repr=False)  # the AsyncClient made with ``token``

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    def check_csrf(self, presented: str | None) -> bool:
        return presented is not None and hmac.compare_digest(presented, self.csrf)


class SessionStore:
    """Sessions by id, with idle and absolute expiry and a bound on their number."""

    def __init__(
        self,
        *,
        idle_s: float = 8 * 3600.0,
        max_age_s: float = 24 * 3600.0,
        max_sessions: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.idle_s = idle_s
        self.max_age_s = max_age_s
        self.max_sessions = max_sessions
        self.clock = clock
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def create(self, *, principal: str, role: str, token: str, client: Any = None) -> Session:
        """A new session (the oldest is dropped, and returned by :meth:`expire`, when full)."""
        now = self.clock()
        session = Session(
            session_id=secrets.token_urlsafe(32),
            principal=principal,
            role=role,
            token=token,
            csrf=secrets.token_urlsafe(32),
            created=now,
            last_seen=now,
            client=client,
        )
        self._sessions[session.session_id] = session
        return session

    def get(self, session_id: str | None) -> Session | None:
        """The live session with this id (its idle timer restarts), or None."""
        if not session_id:
            return None
        session = self._sessions.get(session_id)
        if session is None:
            return None
        now = self.clock()
        if now - session.last_seen > self.idle_s or now - session.created > self.max_age_s:
            return None  # removed (and its client closed) by the next expire()
        session.last_seen = now
        return session

    def remove(self, session_id: str) -> Session | None:
        return self._sessions.pop(session_id, None)

    def expire(self) -> list[Session]:
        """Remove and return the sessions that timed out, and the oldest ones beyond
        ``max_sessions`` (the caller closes their clients)."""
        now = self.clock()
        gone = [
            s
            for s in self._sessions.values()
            if now - s.last_seen > self.idle_s or now - s.created > self.max_age_s
        ]
        for s in gone:
            del self._sessions[s.session_id]
        excess = len(self._sessions) - self.max_sessions
        if excess > 0:
            oldest = sorted(self._sessions.values(), key=lambda s: s.last_seen)[:excess]
            for s in oldest:
                del self._sessions[s.session_id]
            gone.extend(oldest)
        return gone

    def all(self) -> list[Session]:
        return list(self._sessions.values())
