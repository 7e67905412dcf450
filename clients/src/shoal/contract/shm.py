"""Shared-memory segments of the same-host lane (learner <-> parameter-sync shard).

A learner and a shard on the same host move a SyncStep's bytes through a segment instead of
gRPC chunks; the stream itself still carries the header (the control). This module is the
segment: created by the shard only (:meth:`Segment.create`), taken by the learner from the
file descriptor the shard hands it (:meth:`Segment.from_fd`, over the Unix socket of
``shoal.contract.lane_handoff``), and every read or write of a region checked against the
segment's bounds (:meth:`Segment.region`), so an offset or length from the other side can
never reach outside it.

Safety (docs/data-plane.md, "The same-host lane"):

* the segment has no name anywhere: ``memfd_create`` (close-on-exec), so no other process can
  list or open it; only a process the shard hands the descriptor to can map it;
* it is sealed against shrinking and growing (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``):
  the learner holds a writable descriptor, and a shrunk segment would kill the shard with
  SIGBUS on its next access; the learner checks the seals, the size and the nonce;
* the memory goes back to the system when the last descriptor and mapping are gone, also
  when either process crashes;
* older shards named their segments ``/dev/shm/shoal-lane-<pid>-<random>``; a shard that
  crashed before the name went left a file behind: a shard removes every such file whose
  ``pid`` is not alive when it starts (:func:`sweep_stale`).

Nothing here imports gRPC or torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import mmap
import os
import re
import secrets
import socket
import stat
import weakref
from dataclasses import dataclass
from pathlib import Path

from shoal.contract.processes import pid_alive

__all__ = [
    "ATTACH_WINDOW_S",
    "MEMFD_NAME",
    "NONCE_BYTES",
    "PREFIX",
    "READ_ONLY_SEAL",
    "SEALS",
    "SHM_DIR",
    "LaneError",
    "Segment",
    "host_id",
    "sweep_stale",
]

SHM_DIR = "/dev/shm"
#: The name prefix of the segments older shards created under ``SHM_DIR`` (swept only).
PREFIX = "shoal-lane-"
#: What ``/proc/<pid>/fd`` shows of a lane segment (``/memfd:shoal-lane (deleted)``): a label
#: for people, in no namespace; nothing can open a memfd by it.
MEMFD_NAME = "shoal-lane"
NONCE_BYTES = 16
#: Seconds the learner has to fetch a new lane's descriptor (else the shard drops the lane).
ATTACH_WINDOW_S = 30.0
_NAME = re.compile(rf"^{PREFIX}(\d+)-[0-9a-f]{{32}}$")


class LaneError(ValueError):
    """A region outside the segment, a segment that is not the expected one (the message
    names the field and the value)."""


def host_id(shm_dir: str = SHM_DIR) -> str:
    """An id equal for two processes of one host: the kernel's boot id, the host name and
    the device of ``shm_dir`` (two containers of one host with their own /dev/shm differ, and
    get no lane between them; segments were files there before they became nameless)."""
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
    """Remove the named lane segments older shards left when they crashed before their
    learners attached (those whose shard pid is gone); returns the names removed. Only this
    user's files can be removed. Lanes of this version leave no name to sweep."""
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


#: The seals every lane segment carries (the learner refuses a descriptor without them);
#: 0 where the platform has no file sealing (not Linux: no lane there).
SEALS = (
    fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
    if hasattr(fcntl, "F_ADD_SEALS")
    else 0
)


#: The seal of a segment its readers map read-only (a job's answer segment): no new writable
#: mapping and no write(2), while the shard's own mapping stays writable (Linux 5.1; Python's
#: fcntl does not name it).
READ_ONLY_SEAL = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010) if SEALS else 0


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _map_shared(fd: int, size: int, *, writable: bool = True) -> memoryview:
    """``size`` bytes of ``fd`` mapped shared, read-write (``writable``) or read-only (a read-only
    view then: a write through it raises instead of faulting), as a byte view that keeps no
    descriptor open: Python's ``mmap.mmap`` keeps a duplicate of the descriptor for as long as
    it lives (until 3.13's ``trackfd=False``), which would leave the segment openable through
    ``/proc/<pid>/fd`` by processes of the same user for the lane's whole life. The memory is
    unmapped when the last view of it (slices included) is released."""
    protection = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    addr = _libc.mmap(None, size, protection, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mmap of {size} bytes: {os.strerror(errno)}")
    buffer = (ctypes.c_ubyte * size).from_address(addr)
    weakref.finalize(buffer, _libc.munmap, addr, size)
    view = memoryview(buffer).cast("B")
    return view if writable else view.toreadonly()


@dataclass
class Segment:
    """One mapped segment. ``fd`` is the shard's descriptor of it until it was handed to the
    learner (or the time to fetch it ended: :meth:`release_fd`); -1 after that and on the
    learner's side (the mapping outlives the descriptor)."""

    size: int
    nonce: bytes
    _view: memoryview  # the whole mapping (no descriptor behind it: _map_shared)
    fd: int = -1

    @classmethod
    def create(cls, size: int, *, label: str = MEMFD_NAME, read_only: bool = False) -> Segment:
        """A new zeroed, nameless, sealed segment of ``size`` bytes, its first
        :data:`NONCE_BYTES` a random nonce; the caller owns ``fd`` (:meth:`release_fd`).
        ``label`` is the memfd's label in ``/proc`` (no name in any directory). ``read_only``:
        sealed with :data:`READ_ONLY_SEAL` too, once mapped here, so that only this mapping
        can write it (whoever gets the descriptor can map it read-only, nothing more)."""
        if size < NONCE_BYTES:
            raise LaneError(f"size ({size}) must be >= {NONCE_BYTES}")
        if not SEALS or not hasattr(os, "memfd_create"):
            raise OSError("no memfd_create with file sealing on this platform")
        fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            view = _map_shared(fd, size)  # before a write seal, which forbids new writable ones
            nonce = secrets.token_bytes(NONCE_BYTES)
            view[:NONCE_BYTES] = nonce
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS | (READ_ONLY_SEAL if read_only else 0))
        except BaseException:
            os.close(fd)
            raise
        return cls(size, nonce, view, fd)

    @classmethod
    def from_fd(cls, fd: int, size: int, nonce: bytes, *, read_only: bool = False) -> Segment:
        """Map the segment behind ``fd`` (which the caller still owns and closes): it must be
        a memfd, this user's, sealed against shrinking and growing (:data:`SEALS`), of
        exactly ``size`` bytes, and start with ``nonce`` (else :class:`LaneError`).
        ``read_only``: it must be sealed with :data:`READ_ONLY_SEAL` too, and is mapped
        read-only (its region views are read-only)."""
        if len(nonce) != NONCE_BYTES:
            raise LaneError(f"nonce ({len(nonce)} bytes) must be {NONCE_BYTES} bytes")
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise LaneError(
                f"descriptor (mode {oct(st.st_mode)}, uid {st.st_uid}) must be a file of this "
                f"user (uid {os.getuid()})"
            )
        with contextlib.suppress(FileNotFoundError):  # no /proc: the seals decide
            target = os.readlink(f"/proc/self/fd/{fd}")
            if not target.startswith("/memfd:"):
                raise LaneError(f"descriptor ({target!r}) is not a memfd")
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as exc:
            raise LaneError(f"descriptor has no seals ({exc})") from None
        wanted = SEALS | (READ_ONLY_SEAL if read_only else 0)
        if seals & wanted != wanted:
            raise LaneError(f"seals ({seals:#x}) must include {wanted:#x}")
        if st.st_size != size:
            raise LaneError(f"size ({size}) differs from the segment's ({st.st_size})")
        view = _map_shared(fd, size, writable=not read_only)
        if view[:NONCE_BYTES] != nonce:
            view.release()
            raise LaneError("the segment is not the shard's (nonce differs)")
        return cls(size, nonce, view)

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
        return self._view[offset : offset + length]

    def release_fd(self) -> None:
        """Close the descriptor (handed over, or no longer to be): the mapping stays."""
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

    def close(self) -> None:
        """Close the descriptor (if still open) and unmap. Views still held keep the mapping
        alive until they are released (it is unmapped when the last goes)."""
        self.release_fd()
        with contextlib.suppress(BufferError):  # exported from the whole view: goes with them
            self._view.release()
