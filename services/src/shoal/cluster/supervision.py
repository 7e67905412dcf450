"""The restart bookkeeping of the local cluster's supervisor, pure (the clock is passed in):
:class:`RestartPolicy` (a bounded, doubling backoff) and :class:`Supervision` (one process's
restarts, and what was decided on each exit).

Part of the local cluster: :mod:`shoal.cluster.local` re-exports every name here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.contract.errors import InvalidField


@dataclass(frozen=True)
class RestartPolicy:
    """How the supervisor restarts a crashed service process (bounded, with backoff)."""

    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    max_restarts: int = 10
    """Restarts allowed within ``window_s``; one more exit and the process is left down."""
    window_s: float = 600.0
    stable_after_s: float = 60.0
    """A process that stayed up this long starts again from ``initial_backoff_s``."""

    def __post_init__(self) -> None:
        if not 0 <= self.initial_backoff_s <= self.max_backoff_s:
            raise InvalidField(
                "initial_backoff_s",
                self.initial_backoff_s,
                f"must be in 0..max_backoff_s ({self.max_backoff_s})",
            )
        if self.max_restarts < 0:
            raise InvalidField("max_restarts", self.max_restarts, "must be >= 0")
        if not self.window_s > 0:
            raise InvalidField("window_s", self.window_s, "must be > 0")


@dataclass
class Supervision:
    """The restart bookkeeping of one service process (pure: the clock is passed in)."""

    restarts: int = 0
    recent: list[float] = field(default_factory=list)
    backoff_s: float = 0.0
    due_at: float | None = None
    last_exit: int | None = None
    gave_up: bool = False
    started_at: float = 0.0

    def exited(self, code: int | None, now: float, policy: RestartPolicy) -> str:
        """The process exited with ``code``: schedule its restart (or give up). Returns what
        was decided, in words."""
        self.last_exit = code
        self.recent = [t for t in self.recent if now - t < policy.window_s]
        if len(self.recent) >= policy.max_restarts:
            self.gave_up = True
            self.due_at = None
            return (
                f"exited (code {code}) after {len(self.recent)} restarts in "
                f"{policy.window_s:g} s: not restarted again"
            )
        if self.backoff_s == 0 or now - self.started_at >= policy.stable_after_s:
            self.backoff_s = policy.initial_backoff_s
        else:
            self.backoff_s = min(
                max(self.backoff_s * 2, policy.initial_backoff_s), policy.max_backoff_s
            )
        self.due_at = now + self.backoff_s
        return f"exited (code {code}); restarting in {self.backoff_s:g} s"

    def due(self, now: float) -> bool:
        return self.due_at is not None and now >= self.due_at

    def restarted(self, now: float) -> None:
        self.restarts += 1
        self.recent.append(now)
        self.due_at = None
        self.started_at = now

    def state(self, alive: bool, now: float) -> str:
        if alive:
            return "running"
        if self.gave_up:
            return "gave up"
        if self.due_at is not None:
            return f"restarting in {max(0.0, self.due_at - now):.1f} s"
        return "exited"
