"""The data plane's one test-fault mechanism (``shoal.contract.faults``,
``SHOAL_TEST_FAULT=<point>@<argument>``): values are checked at start, and the
``stop-before-rename`` point stops a real writer process between the synced temporary file and
its rename, only for a path holding every part the trigger file names."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shoal.contract import faults
from tests.support import wait_until

WRITER = """
import sys
from shoal.param_sync import checkpoint
checkpoint.atomic_write(sys.argv[1], b"data")
print("WRITTEN", flush=True)
"""


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        ("", None),
        ("commit-partial@12", ("commit-partial", 12)),
        ("save-shard@0", ("save-shard", 0)),
        ("snapshot-sent@8", ("snapshot-sent", 8)),
        ("stop-after-vote@7", ("stop-after-vote", 7)),
        ("raise-floor@23", ("raise-floor", 23)),
        ("stop-before-rename@/tmp/a@b/trigger", ("stop-before-rename", "/tmp/a@b/trigger")),
    ],
)
def test_fault_values_parse_to_a_point_and_its_argument(value, parsed) -> None:
    assert faults.parse(value) == parsed


@pytest.mark.parametrize(
    "value",
    [
        "commit-partial",
        "save-shard@k",
        "stop-after-vote@",
        "raise-floor@-1",
        "stop-before-rename@",
        "explode@3",
        "@3",
    ],
)
def test_a_malformed_fault_is_refused_naming_the_variable_and_the_value(value) -> None:
    with pytest.raises(ValueError, match=rf"SHOAL_TEST_FAULT \({value!r}\)"):
        faults.parse(value)


def _writer(target: Path, trigger: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "SHOAL_TEST_FAULT": f"stop-before-rename@{trigger}"}
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, target.as_uri()], env=env, stdout=subprocess.PIPE
    )


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_stop_before_rename_stops_the_writer_with_the_file_synced_under_its_temporary_name(
    tmp_path: Path,
) -> None:
    trigger = tmp_path / "trigger"
    trigger.write_text("job-a/ shard-1.safetensors")
    target = tmp_path / "jobs" / "job-a" / "iter-4" / "shard-1.safetensors"
    writer = _writer(target, trigger)
    try:
        wait_until(lambda: _state(writer.pid) == "T", timeout=60, what="the writer stopped")
        temporary = list(target.parent.glob("shard-1.safetensors.tmp-*"))
        assert len(temporary) == 1 and temporary[0].read_bytes() == b"data"
        assert not target.exists()
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)


def test_stop_before_rename_lets_other_paths_and_a_missing_trigger_through(
    tmp_path: Path,
) -> None:
    trigger = tmp_path / "trigger"
    trigger.write_text("job-a/ shard-1.safetensors")
    for target, armed in (
        (tmp_path / "jobs" / "job-b" / "iter-4" / "shard-1.safetensors", True),  # other job
        (tmp_path / "jobs" / "job-a" / "iter-4" / "shard-0.safetensors", True),  # other file
        (tmp_path / "jobs" / "job-a" / "iter-8" / "shard-1.safetensors", False),  # disarmed
    ):
        if not armed:
            trigger.unlink()
        writer = _writer(target, trigger)
        started = time.monotonic()
        out, _ = writer.communicate(timeout=60)
        assert writer.returncode == 0 and b"WRITTEN" in out, (target, time.monotonic() - started)
        assert target.read_bytes() == b"data"


def test_armed_from_fires_at_the_armed_iteration_or_any_later_one(monkeypatch) -> None:
    monkeypatch.setattr(faults, "_ARMED", ("snapshot-sent", 8))
    assert not faults.armed_from("snapshot-sent", 4)
    assert faults.armed_from("snapshot-sent", 8) and faults.armed_from("snapshot-sent", 12)
    assert not faults.armed_from("save-shard", 12)
    monkeypatch.setattr(faults, "_ARMED", ("stop-before-rename", "/tmp/trigger"))
    assert not faults.armed_from("stop-before-rename", 12)
    monkeypatch.setattr(faults, "_ARMED", None)
    assert not faults.armed_from("snapshot-sent", 12)
