"""Shared-memory segments of the same-host lane (learner <-> parameter-sync shard).

A learner and a shard on the same host move a SyncStep's bytes through a segment instead of
gRPC chunks; the stream itself still carries the header (the control). This module is the
segment: created by the shard only (:meth:`Segment.create`), opened by the learner
(:meth:`Segment.attach`), and every read or write of a region checked against the segment's
bounds (:meth:`Segment.region`), so an offset or length from the other side can never reach
outside it.

Safety (docs/data-plane.md, "The same-host lane"):

* the file is created under ``/dev/shm`` with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600
  (owned by the shard's user: a learner running as another user cannot open it, and falls
  back to gRPC), its name carries 128 random bits;
* the shard unlinks it as soon as the learner attached (its first lane SyncStep) or after
  :data:`ATTACH_WINDOW_S`, whichever comes first, so a segment has no name for long and the
  memory goes back to the system when both processes unmapped it, crashed or not;
* a shard that crashed inside that window leaves a named file: the next shard on the host
  removes every ``shoal-lane-<pid>-*`` whose ``pid`` is not alive (:func:`sweep_stale`).

Nothing here imports gRPC or torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import re
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path

from shoal.contract.processes import pid_alive

__all__ = [
    "ATTACH_WINDOW_S",
    "NONCE_BYTES",
    "PREFIX",
    "SHM_DIR",
    "LaneError",
    "Segment",
    "host_id",
    "sweep_stale",
]

SHM_DIR = "/dev/shm"
PREFIX = "shoal-lane-"
NONCE_BYTES = 16
#: Seconds a created segment keeps its name when no learner attaches to it.
ATTACH_WINDOW_S = 30.0
_NAME = re.compile(rf"^{PREFIX}(\d+)-[0-9a-f]{{32}}$")


class LaneError(ValueError):
    """A region outside the segment, a segment that is not the expected one (the message
    names the field and the value)."""


def host_id(shm_dir: str = SHM_DIR) -> str:
    """An id equal for two processes exactly when they can share a segment under ``shm_dir``:
    the kernel's boot id, the host name and the device of ``shm_dir`` (two containers on one
    host with their own /dev/shm differ)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    try:
        device = os.stat(shm_dir).st_dev
    except OSError:
        return ""  # no shared memory here: no lane
    text = f"{boot}|{socket.gethostname()}|{device}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def sweep_stale(shm_dir: str = SHM_DIR) -> list[str]:
    """Remove the lane segments of processes that are gone (a shard that crashed before its
    learners attached); returns the names removed. Only this user's files can be removed."""
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(shm_dir):
            match = _NAME.match(name)
            if match is None or pid_alive(int(match.group(1))):
                continue
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(shm_dir, name))
                removed.append(name)
    return removed


@dataclass
class Segment:
    """One mapped segment. ``path`` is its name while it has one (``unlink`` drops it)."""

    path: str
    size: int
    nonce: bytes
    _map: mmap.mmap
    linked: bool = True

    @classmethod
    def create(cls, size: int, shm_dir: str = SHM_DIR) -> Segment:
        """A new zeroed segment of ``size`` bytes (mode 0600, unguessable name), its first
        :data:`NONCE_BYTES` a random nonce."""
        if size < NONCE_BYTES:
            raise LaneError(f"size ({size}) must be >= {NONCE_BYTES}")
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(16)}"
        path = os.path.join(shm_dir, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            os.ftruncate(fd, size)
            mapped = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        nonce = secrets.token_bytes(NONCE_BYTES)
        mapped[:NONCE_BYTES] = nonce
        return cls(path, size, nonce, mapped)

    @classmethod
    def attach(cls, path: str, size: int, nonce: bytes, shm_dir: str = SHM_DIR) -> Segment:
        """Open the segment the shard named: it must be a plain file of ``shm_dir`` with a lane
        name, owned by this user, mode 0600, of exactly ``size`` bytes, starting with
        ``nonce`` (else :class:`LaneError`; an OSError when it cannot be opened at all)."""
        name = os.path.basename(path)
        if os.path.dirname(path) != shm_dir or _NAME.match(name) is None:
            raise LaneError(f"path ({path!r}) is not a lane segment of {shm_dir}")
        if len(nonce) != NONCE_BYTES:
            raise LaneError(f"nonce ({len(nonce)} bytes) must be {NONCE_BYTES} bytes")
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise LaneError(
                    f"segment {path!r} (uid {st.st_uid}, mode {oct(st.st_mode & 0o777)}) "
                    "must be this user's with mode 0600"
                )
            if st.st_size != size:
                raise LaneError(f"size ({size}) differs from the segment's ({st.st_size})")
            mapped = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        if mapped[:NONCE_BYTES] != nonce:
            mapped.close()
            raise LaneError(f"segment {path!r} is not the shard's (nonce differs)")
        return cls(path, size, nonce, mapped, linked=False)

    def region(self, offset: int, length: int, *, lo: int, hi: int, what: str) -> memoryview:
        """A view of ``[offset, offset + length)``, which must lie inside ``[lo, hi)`` (itself
        inside the segment); the error names ``what`` (the field) and the values."""
        if not 0 <= lo <= hi <= self.size:
            raise LaneError(f"region [{lo}, {hi}) is not inside the segment ({self.size} bytes)")
        if length < 0:
            raise LaneError(f"{what}: length ({length}) must be >= 0")
        if offset < lo or offset + length > hi:
            raise LaneError(
                f"{what} ({offset}) with {length} bytes is outside the lane region [{lo}, {hi})"
            )
        return memoryview(self._map)[offset : offset + length]

    def unlink(self) -> None:
        """Drop the segment's name (the memory stays until every mapping is gone)."""
        if self.linked:
            self.linked = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def close(self) -> None:
        """Unlink (if still named) and unmap. Views still held keep the mapping alive until
        they are released (the mapping is closed when the last goes)."""
        self.unlink()
        with contextlib.suppress(BufferError):
            self._map.close()
