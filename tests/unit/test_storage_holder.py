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
