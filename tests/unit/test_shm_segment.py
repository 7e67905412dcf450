"""The segments of the same-host lane (``shoal.contract.shm``): nameless sealed memfds, what
taking one from a descriptor checks, the bounds of every region, and the sweep of the named
segments older shards left behind."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from shoal.contract.shm import (
    NONCE_BYTES,
    PREFIX,
    READ_ONLY_SEAL,
    SEALS,
    LaneError,
    Segment,
    host_id,
    sweep_stale,
)


@pytest.fixture
def shm_dir(tmp_path: Path) -> str:
    return str(tmp_path)


def test_a_segment_has_no_name_is_sealed_and_starts_with_a_random_nonce() -> None:
    a = Segment.create(4096)
    b = Segment.create(4096)
    assert os.readlink(f"/proc/self/fd/{a.fd}") == "/memfd:shoal-lane (deleted)"
    st = os.fstat(a.fd)
    # No link in any directory: nothing can list or open it by a name.
    assert st.st_size == 4096 and st.st_uid == os.getuid() and st.st_nlink == 0
    assert fcntl.fcntl(a.fd, fcntl.F_GET_SEALS) & SEALS == SEALS
    assert not os.get_inheritable(a.fd)  # close-on-exec
    with pytest.raises(PermissionError):  # sealed: whoever holds it cannot shrink it (SIGBUS)
        os.ftruncate(a.fd, 16)
    with pytest.raises(PermissionError):
        os.ftruncate(a.fd, 8192)
    assert a.nonce != b.nonce and len(a.nonce) == NONCE_BYTES
    fd = a.fd
    a.release_fd()
    assert a.fd == -1
    with pytest.raises(OSError):
        os.fstat(fd)  # closed (unless reused: not in this test)
    a.region(64, 4, lo=64, hi=4096, what="x")[:] = b"abcd"  # the mapping outlives the fd
    a.close()
    b.close()
    assert b.fd == -1


def lane_descriptors() -> int:
    """Descriptors of this process that are lane segments (memfds named shoal-lane)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:shoal-lane")
    return count


def test_a_mapped_segment_keeps_no_descriptor_and_unmaps_with_its_last_view() -> None:
    """Python's mmap would keep a duplicate descriptor for the mapping's life, openable through
    /proc/<pid>/fd by processes of the same user: the segments map without it."""
    before = lane_descriptors()
    seg = Segment.create(1 << 20)
    assert lane_descriptors() == before + 1  # seg.fd only
    peer = Segment.from_fd(seg.fd, 1 << 20, seg.nonce)
    assert lane_descriptors() == before + 1
    seg.release_fd()
    assert lane_descriptors() == before  # both mapped, no descriptor left anywhere
    region = peer.region(64, 8, lo=64, hi=1 << 20, what="x")
    seg.region(64, 8, lo=64, hi=1 << 20, what="x")[:] = b"12345678"
    assert bytes(region) == b"12345678"
    maps = Path("/proc/self/maps").read_text().count("/memfd:shoal-lane")
    peer.close()  # a view is still held: the mapping stays until it goes
    assert bytes(region) == b"12345678"
    region.release()
    seg.close()
    assert Path("/proc/self/maps").read_text().count("/memfd:shoal-lane") == maps - 2


def test_from_fd_sees_the_same_bytes_and_checks_what_it_maps() -> None:
    seg = Segment.create(1024)
    peer = Segment.from_fd(seg.fd, 1024, seg.nonce)
    seg.region(100, 4, lo=64, hi=1024, what="x")[:] = b"abcd"
    assert bytes(peer.region(100, 4, lo=64, hi=1024, what="x")) == b"abcd"
    peer.region(200, 2, lo=64, hi=1024, what="x")[:] = b"zz"
    assert bytes(seg.region(200, 2, lo=64, hi=1024, what="x")) == b"zz"
    with pytest.raises(LaneError, match="nonce differs"):
        Segment.from_fd(seg.fd, 1024, bytes(NONCE_BYTES))
    with pytest.raises(LaneError, match=r"size \(2048\) differs"):
        Segment.from_fd(seg.fd, 2048, seg.nonce)
    with pytest.raises(LaneError, match=r"nonce \(3 bytes\)"):
        Segment.from_fd(seg.fd, 1024, b"abc")
    # A plain file (named, unsealed), an unsealed memfd, a pipe: refused.
    with tempfile.TemporaryFile() as plain:
        plain.truncate(1024)
        with pytest.raises(LaneError, match="is not a memfd"):
            Segment.from_fd(plain.fileno(), 1024, seg.nonce)
    unsealed = os.memfd_create("shoal-lane", os.MFD_CLOEXEC)
    os.ftruncate(unsealed, 1024)
    with mmap.mmap(unsealed, 1024) as m:
        m[:NONCE_BYTES] = seg.nonce
    with pytest.raises(LaneError, match="seals"):
        Segment.from_fd(unsealed, 1024, seg.nonce)
    os.close(unsealed)
    r, w = os.pipe()
    with pytest.raises(LaneError, match="must be a file"):
        Segment.from_fd(r, 1024, seg.nonce)
    os.close(r)
    os.close(w)
    peer.close()
    seg.close()


def test_a_read_only_segment_is_written_by_its_creator_alone() -> None:
    """A job's answer segment: the shard writes it through its own mapping; whoever gets the
    descriptor (a learner, or anyone it leaks to) can map it read-only and nothing more: no
    writable mapping, no write(2), no mprotect up to writable; a private mapping's writes stay
    its own."""
    shard = Segment.create(4096, label="shoal-answer", read_only=True)
    assert fcntl.fcntl(shard.fd, fcntl.F_GET_SEALS) & (SEALS | READ_ONLY_SEAL) == (
        SEALS | READ_ONLY_SEAL
    )
    reader = Segment.from_fd(shard.fd, 4096, shard.nonce, read_only=True)
    shard.region(64, 4, lo=64, hi=4096, what="x")[:] = b"abcd"
    seen = reader.region(64, 4, lo=64, hi=4096, what="x")
    assert bytes(seen) == b"abcd" and seen.readonly
    with pytest.raises(TypeError):
        seen[:] = b"wxyz"
    # Reopened read-write through /proc: still no writable mapping, no write.
    fd = os.open(f"/proc/self/fd/{shard.fd}", os.O_RDWR)
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 64)
        private = mmap.mmap(fd, 4096, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
        private[64:68] = b"wxyz"  # copy-on-write: the segment is untouched
        private.close()
    finally:
        os.close(fd)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, *[ctypes.c_int] * 3, ctypes.c_long]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    addr = libc.mmap(None, 4096, mmap.PROT_READ, mmap.MAP_SHARED, shard.fd, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value)
    assert libc.mprotect(addr, 4096, mmap.PROT_READ | mmap.PROT_WRITE) == -1
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.munmap(addr, 4096)
    assert bytes(seen) == b"abcd"
    # A reader that expects a read-only segment refuses one without the seal.
    plain = Segment.create(4096)
    with pytest.raises(LaneError, match="seals"):
        Segment.from_fd(plain.fd, 4096, plain.nonce, read_only=True)
    for segment in (reader, shard, plain):
        segment.close()


@pytest.mark.parametrize(
    ("offset", "length", "message"),
    [
        (63, 8, r"offset \(63\) with 8 bytes is outside the lane region \[64, 512\)"),
        (512, 1, r"outside the lane region"),
        (508, 8, r"outside the lane region"),
        (-8, 8, r"outside the lane region"),
        (64, -1, r"length \(-1\) must be >= 0"),
        (2**62, 2**62, r"outside the lane region"),
        (600, 8, r"outside the lane region"),  # inside the segment, outside the region
    ],
)
def test_a_region_outside_its_bounds_is_refused_naming_the_field(
    offset: int, length: int, message: str
) -> None:
    seg = Segment.create(1024)
    with pytest.raises(LaneError, match=message) as info:
        seg.region(offset, length, lo=64, hi=512, what="header.offset")
    assert "header.offset" in str(info.value) or "length" in str(info.value)
    assert seg.region(64, 448, lo=64, hi=512, what="x").nbytes == 448  # the whole region is fine
    with pytest.raises(LaneError, match="not inside the segment"):
        seg.region(0, 1, lo=0, hi=2048, what="x")
    seg.close()


def test_the_sweep_removes_the_named_segments_of_dead_processes_only(shm_dir: str) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    pid = int(dead.stdout)
    stale = Path(shm_dir) / f"{PREFIX}{pid}-{'ab' * 16}"
    stale.write_bytes(b"x")
    alive = Path(shm_dir) / f"{PREFIX}{os.getpid()}-{'cd' * 16}"  # an older shard, running
    alive.write_bytes(b"x")
    other = Path(shm_dir) / "someone-elses-file"
    other.write_bytes(b"x")
    assert sweep_stale(shm_dir) == [stale.name]
    assert not stale.exists() and other.exists() and alive.exists()


def test_the_host_id_is_stable_and_differs_for_another_shm_mount(shm_dir: str) -> None:
    assert host_id() == host_id() != ""
    assert host_id("/nonexistent-shm") == ""  # no shared memory: no lane
    if os.stat(shm_dir).st_dev != os.stat("/dev/shm").st_dev:
        assert host_id(shm_dir) != host_id()
