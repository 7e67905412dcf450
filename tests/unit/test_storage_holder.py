"""shoal.param_sync.holder: the storage fence's mark, on a real directory."""

from __future__ import annotations

import pytest

from shoal.param_sync import checkpoint as ckpt, holder


def test_the_write_happens_only_while_the_mark_names_the_writer(tmp_path):
    storage, written = tmp_path.as_uri(), []
    holder.as_holder(storage, "j", "a", written.append, "before any mark")  # old job files
    holder.mark_holder(storage, "j", "a", shard=0, epoch=0)
    holder.as_holder(storage, "j", "a", written.append, "held")
    holder.mark_holder(storage, "j", "b", shard=1, epoch=1)  # the last taker wins
    with pytest.raises(holder.Superseded, match=r"shard 1 \(epoch 1\)"):
        holder.as_holder(storage, "j", "a", written.append, "superseded")
    assert written == ["before any mark", "held"]
    holder.check_holder(storage, "j", "b")
    holder.check_holder(storage, "other-job", "a")  # one mark per job


def test_a_mark_that_is_not_one_refuses_the_write_and_names_the_file(tmp_path):
    (tmp_path / "jobs" / "j").mkdir(parents=True)
    (tmp_path / "jobs" / "j" / holder.HOLDER).write_text('{"who": "nobody"}')
    written: list[str] = []
    with pytest.raises(ckpt.StorageError, match=r"jobs/j/coordinator\.json is not"):
        holder.as_holder(tmp_path.as_uri(), "j", "a", written.append, "x")
    assert written == []


def _lines(path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_a_writer_stopped_after_its_check_appends_nowhere_the_successor_reads(
    tmp_path, monkeypatch
):
    """The window the mark alone leaves: coordinator a passes its check, is stopped (SIGSTOP,
    a long pause) before its append, and b takes the job over meanwhile (mark, then the
    renewal of the record files, then b reads what is recorded and records the iteration
    itself). a's append, once it runs, must not land in b's records (the same iteration twice,
    as a CI run of test_coordinator_failover's paused coordinator once showed)."""
    storage = tmp_path.as_uri()
    records = tmp_path / "jobs" / "j" / "metrics" / "iterations.jsonl"
    uri = records.as_uri()
    holder.mark_holder(storage, "j", "a", shard=0, epoch=0)
    holder.as_holder(storage, "j", "a", ckpt.append_line, uri, '{"global_iteration": 9}')
    real_check = holder.check_holder

    def check_then_taken_over(storage_uri: str, job_id: str, who: str) -> None:
        real_check(storage_uri, job_id, who)  # a passes: the mark still names it
        monkeypatch.setattr(holder, "check_holder", real_check)
        # ... and is stopped here while b takes the job over and records iteration 10:
        holder.mark_holder(storage, "j", "b", shard=1, epoch=1)
        holder.renew_records(storage, "j", "b")
        assert _lines(records) == ['{"global_iteration": 9}']  # what b reads
        holder.as_holder(storage, "j", "b", ckpt.append_line, uri, '{"global_iteration": 10}')

    monkeypatch.setattr(holder, "check_holder", check_then_taken_over)
    holder.as_holder(storage, "j", "a", ckpt.append_line, uri, '{"global_iteration": 10, "a": 1}')
    assert _lines(records) == ['{"global_iteration": 9}', '{"global_iteration": 10}']
    # b goes on appending to the file it renewed.
    holder.as_holder(storage, "j", "b", ckpt.append_line, uri, '{"global_iteration": 11}')
    assert _lines(records)[-1] == '{"global_iteration": 11}'
    with pytest.raises(holder.Superseded):  # and a, checking again, writes nothing
        holder.as_holder(storage, "j", "a", ckpt.append_line, uri, '{"global_iteration": 12}')
    assert len(_lines(records)) == 3


def test_renewing_records_keeps_their_bytes_and_needs_none(tmp_path):
    storage = tmp_path.as_uri()
    holder.renew_records(storage, "j", "a")  # no files yet: nothing to do
    epochs = tmp_path / "jobs" / "j" / "metrics" / "epochs.jsonl"
    ckpt.append_line(epochs.as_uri(), '{"epoch": 0}')
    before = epochs.stat().st_ino
    holder.renew_records(storage, "j", "a")
    assert epochs.read_text() == '{"epoch": 0}\n'
    assert epochs.stat().st_ino != before  # a new file: an old descriptor writes elsewhere


def test_a_renewal_that_died_midway_leaves_no_copy_behind_the_next(tmp_path):
    """A coordinator killed between its copy and the replace leaves ``<file>.renew-<pid>``;
    the next renewal removes it (and the file keeps its bytes)."""
    storage = tmp_path.as_uri()
    epochs = tmp_path / "jobs" / "j" / "metrics" / "epochs.jsonl"
    ckpt.append_line(epochs.as_uri(), '{"epoch": 0}')
    stale = epochs.with_name("epochs.jsonl.renew-4242")
    stale.write_text('{"epoch": 0}\n')
    holder.renew_records(storage, "j", "a")
    assert not stale.exists()
    assert sorted(p.name for p in epochs.parent.iterdir()) == ["epochs.jsonl"]
    assert epochs.read_text() == '{"epoch": 0}\n'


def test_a_renewal_paused_through_another_takeover_puts_no_old_copy_back(tmp_path, monkeypatch):
    """Coordinator a marks the job and copies its records, and is stopped before its copy
    replaces them; b takes the job over (mark, renewal) and records iteration 10. When a
    wakes, its copy (without b's line) must not replace b's records: a finds the mark is
    b's and stops (Superseded), and leaves no copy."""
    storage = tmp_path.as_uri()
    records = tmp_path / "jobs" / "j" / "metrics" / "iterations.jsonl"
    uri = records.as_uri()
    holder.mark_holder(storage, "j", "a", shard=0, epoch=0)
    ckpt.append_line(uri, '{"global_iteration": 9}')
    real_check = holder.check_holder

    def taken_over_meanwhile(storage_uri: str, job_id: str, who: str) -> None:
        monkeypatch.setattr(holder, "check_holder", real_check)
        holder.mark_holder(storage, "j", "b", shard=1, epoch=1)
        holder.renew_records(storage, "j", "b")
        holder.as_holder(storage, "j", "b", ckpt.append_line, uri, '{"global_iteration": 10}')
        real_check(storage_uri, job_id, who)

    monkeypatch.setattr(holder, "check_holder", taken_over_meanwhile)
    with pytest.raises(holder.Superseded):
        holder.renew_records(storage, "j", "a")
    assert _lines(records) == ['{"global_iteration": 9}', '{"global_iteration": 10}']
    assert sorted(p.name for p in records.parent.iterdir()) == ["iterations.jsonl"]
