"""A job's record files on an object store (shoal.contract.records): each append an object of its
own, read back joined in order through every compaction, a crash between a compaction's write
and its deletes, a successor whose clock is behind, two writers that overlap, a rewrite, and
the storage fence's check before each put. fsspec's in-memory filesystem stands in for the
store here (it cannot append either); tests/integration/test_object_storage_datasets.py runs
the same path against a real S3 server."""

from __future__ import annotations

import itertools
import json

import fsspec
import pytest

from shoal.contract import records
from shoal.param_sync import checkpoint as ckpt

_bucket = itertools.count()


@pytest.fixture
def uri(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(records, "SEGMENT_AFTER", 4)
    monkeypatch.setattr(records, "WHOLE_AFTER", 3)
    monkeypatch.setattr(records, "_last_key", {})
    monkeypatch.setattr(records, "_appends", {})
    return f"memory://records-{next(_bucket)}/jobs/j/metrics/iterations.jsonl"


def _line(i: int) -> bytes:
    return (json.dumps({"global_iteration": i}) + "\n").encode()


def _names(uri: str) -> list[str]:
    fs, path = fsspec.core.url_to_fs(records.parts_uri(uri))
    try:
        return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))
    except FileNotFoundError:
        return []


def _other_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """What another process sees: no key of its own yet."""
    monkeypatch.setattr(records, "_last_key", {})
    monkeypatch.setattr(records, "_appends", {})


def test_appends_read_back_in_order_through_every_compaction(uri: str) -> None:
    assert records.read(uri) is None
    written = b""
    for i in range(40):
        records.append(uri, _line(i))
        written += _line(i)
        assert records.read(uri) == written, i
    names = _names(uri)
    # Compacted: at most one whole, fewer than WHOLE_AFTER segments, fewer than SEGMENT_AFTER
    # appends after them; nothing covered is left.
    assert sum(n.endswith("~all.jsonl") for n in names) == 1
    assert sum(n.endswith("~seg.jsonl") for n in names) < records.WHOLE_AFTER
    assert len(names) < 1 + records.WHOLE_AFTER + records.SEGMENT_AFTER


def test_records_written_before_parts_come_first_until_a_whole_covers_them(uri: str) -> None:
    fs, path = fsspec.core.url_to_fs(uri)
    fs.pipe_file(path, _line(0) + _line(1))  # a file from before (read-modify-write)
    written = _line(0) + _line(1)
    for i in range(2, 30):
        records.append(uri, _line(i))
        written += _line(i)
        assert records.read(uri) == written
    assert not fs.exists(path)  # a whole covers it now: deleted


def test_a_compaction_that_died_before_its_deletes_reads_the_same(
    uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(records, "_remove", lambda fs, paths: None)  # dies after each write
    written = b""
    for i in range(30):
        records.append(uri, _line(i))
        written += _line(i)
        assert records.read(uri) == written
    left = len(_names(uri))
    monkeypatch.undo()
    monkeypatch.setattr(records, "SEGMENT_AFTER", 4)
    monkeypatch.setattr(records, "WHOLE_AFTER", 3)
    for i in range(30, 38):  # the next compactions delete what the earlier ones left
        records.append(uri, _line(i))
        written += _line(i)
    assert records.read(uri) == written
    assert len(_names(uri)) < left


def test_a_successor_whose_clock_is_behind_writes_after_its_predecessor(
    uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    written = b""
    for i in range(6):
        records.append(uri, _line(i))
        written += _line(i)
    _other_process(monkeypatch)
    ahead = records.time.time_ns()
    monkeypatch.setattr(records.time, "time_ns", lambda: ahead - 3_600 * 10**9)  # an hour behind
    for i in range(6, 20):
        records.append(uri, _line(i))
        written += _line(i)
    assert records.read(uri) == written


def test_two_writers_that_overlap_lose_no_line(uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A coordinator paused through a takeover that still appends (past the fence's check)
    and its successor: each append is an object of its own, so neither replaces the other's
    (a read-modify-write put would drop the lines the other wrote in between)."""
    monkeypatch.setattr(records, "SEGMENT_AFTER", 10**6)  # no compaction in between
    a_keys: dict[str, str] = {}
    b_keys: dict[str, str] = {}
    for i in range(10):
        for keys, who in ((a_keys, "a"), (b_keys, "b")):
            monkeypatch.setattr(records, "_last_key", keys)
            records.append(uri, (json.dumps({"who": who, "i": i}) + "\n").encode())
    got = [json.loads(x) for x in records.read(uri).decode().splitlines()]
    assert sorted((r["who"], r["i"]) for r in got) == sorted(
        (w, i) for w in "ab" for i in range(10)
    )


def test_a_rewrite_replaces_everything_and_appends_follow_it(uri: str) -> None:
    for i in range(11):
        records.append(uri, _line(i))
    ckpt.rewrite_records(uri, _line(0) + _line(1))  # a truncation after a resume
    assert records.read(uri) == _line(0) + _line(1)
    assert [n for n in _names(uri) if not n.endswith("~all.jsonl")] == []
    records.append(uri, _line(2))
    assert records.read(uri) == _line(0) + _line(1) + _line(2)


def test_the_fence_check_runs_before_each_put_and_a_refusal_writes_nothing(uri: str) -> None:
    records.append(uri, _line(0))

    def superseded() -> None:
        raise RuntimeError("another coordinator holds the job")

    with pytest.raises(RuntimeError, match="another coordinator"):
        ckpt.append_line(uri, json.dumps({"global_iteration": 1}), before_write=superseded)
    assert records.read(uri) == _line(0)
    assert ckpt.read_records(uri) == _line(0)


def test_the_local_filesystem_keeps_one_file(tmp_path) -> None:
    uri = (tmp_path / "iterations.jsonl").as_uri()
    ckpt.append_line(uri, '{"global_iteration": 0}')
    ckpt.append_line(uri, '{"global_iteration": 1}')
    assert ckpt.read_records(uri) == _line(0) + _line(1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iterations.jsonl"]
    with pytest.raises(ValueError, match="local filesystem"):
        records.append(uri, _line(2))


def test_a_compaction_that_fails_does_not_fail_the_written_append(
    uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The line is in storage once its put returned: a compaction that fails after it (a
    store's error, the fence refusing it) is logged and left to a later append, so the caller
    never writes the line again (a record twice)."""
    real = records._compact
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise OSError("503 Slow Down")
        return real(*args, **kwargs)

    monkeypatch.setattr(records, "_compact", failing)
    written = b""
    for i in range(12):
        records.append(uri, _line(i))
        written += _line(i)
    assert records.read(uri) == written
    assert len(calls) >= 2  # the next append compacted
    assert any(n.endswith("~seg.jsonl") for n in _names(uri))
