"""The segments of the same-host lane (``shoal.contract.shm``): how they are created (mode
0600, unguessable names), what attaching checks, the bounds of every region, and the sweep of
segments whose shard is gone."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from shoal.contract.shm import NONCE_BYTES, PREFIX, LaneError, Segment, host_id, sweep_stale


@pytest.fixture
def shm_dir(tmp_path: Path) -> str:
    return str(tmp_path)


def test_a_segment_is_this_users_mode_0600_with_an_unguessable_name(shm_dir: str) -> None:
    os.umask(0o000)  # even a permissive umask gives 0600
    try:
        a = Segment.create(4096, shm_dir)
        b = Segment.create(4096, shm_dir)
    finally:
        os.umask(0o022)
    st = os.stat(a.path)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
    assert st.st_size == 4096
    name = os.path.basename(a.path)
    assert name.startswith(f"{PREFIX}{os.getpid()}-") and len(name.rsplit("-", 1)[1]) == 32
    assert a.path != b.path and a.nonce != b.nonce and len(a.nonce) == NONCE_BYTES
    a.close()
    b.close()
    assert not os.path.exists(a.path) and not os.path.exists(b.path)


def test_attach_sees_the_same_bytes_and_checks_what_it_opens(shm_dir: str) -> None:
    seg = Segment.create(1024, shm_dir)
    peer = Segment.attach(seg.path, 1024, seg.nonce, shm_dir)
    seg.region(100, 4, lo=64, hi=1024, what="x")[:] = b"abcd"
    assert bytes(peer.region(100, 4, lo=64, hi=1024, what="x")) == b"abcd"
    with pytest.raises(LaneError, match="nonce differs"):
        Segment.attach(seg.path, 1024, bytes(NONCE_BYTES), shm_dir)
    with pytest.raises(LaneError, match=r"size \(2048\) differs"):
        Segment.attach(seg.path, 2048, seg.nonce, shm_dir)
    with pytest.raises(LaneError, match="is not a lane segment"):
        Segment.attach("/etc/passwd", 1024, seg.nonce, shm_dir)
    with pytest.raises(LaneError, match="is not a lane segment"):
        Segment.attach(os.path.join(shm_dir, "..", os.path.basename(seg.path)), 1024, seg.nonce)
    os.chmod(seg.path, 0o644)
    with pytest.raises(LaneError, match="mode 0600"):
        Segment.attach(seg.path, 1024, seg.nonce, shm_dir)
    # Unlinked once attached: the mapping stays, the name is gone.
    seg.unlink()
    assert not os.path.exists(seg.path)
    assert bytes(peer.region(100, 4, lo=64, hi=1024, what="x")) == b"abcd"
    with pytest.raises(FileNotFoundError):
        Segment.attach(seg.path, 1024, seg.nonce, shm_dir)
    peer.close()
    seg.close()


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
    shm_dir: str, offset: int, length: int, message: str
) -> None:
    seg = Segment.create(1024, shm_dir)
    with pytest.raises(LaneError, match=message) as info:
        seg.region(offset, length, lo=64, hi=512, what="header.offset")
    assert "header.offset" in str(info.value) or "length" in str(info.value)
    assert seg.region(64, 448, lo=64, hi=512, what="x").nbytes == 448  # the whole region is fine
    with pytest.raises(LaneError, match="not inside the segment"):
        seg.region(0, 1, lo=0, hi=2048, what="x")
    seg.close()


def test_the_sweep_removes_the_segments_of_dead_processes_only(shm_dir: str) -> None:
    mine = Segment.create(64, shm_dir)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    pid = int(dead.stdout)
    stale = Path(shm_dir) / f"{PREFIX}{pid}-{'ab' * 16}"
    stale.write_bytes(b"x")
    other = Path(shm_dir) / "someone-elses-file"
    other.write_bytes(b"x")
    assert sweep_stale(shm_dir) == [stale.name]
    assert not stale.exists() and other.exists() and os.path.exists(mine.path)
    mine.close()


def test_the_host_id_is_stable_and_differs_for_another_shm_mount(shm_dir: str) -> None:
    assert host_id() == host_id() != ""
    assert host_id("/nonexistent-shm") == ""  # no shared memory: no lane
    if os.stat(shm_dir).st_dev != os.stat("/dev/shm").st_dev:
        assert host_id(shm_dir) != host_id()
