"""What a learner's exit says (issue 18): its own Python exception and last frames in one line,
log records that carry the time they were written, and the train() marker."""

from __future__ import annotations

import time

from shoal.host_agent.processes import crash_summary, read_log
from shoal.learner.env import train_marker


def _log(path, lines, stream=2):
    now = int(time.time() * 1000)
    path.write_bytes(b"".join(b"%d@%d %s\n" % (stream, now, t.encode()) for t in lines))


def test_the_crash_summary_is_the_exception_and_its_last_frames(tmp_path):
    work = tmp_path / "work"
    log = tmp_path / "output.log"
    _log(
        log,
        [
            "epoch 1",
            "Traceback (most recent call last):",
            f'  File "{work}/train.py", line 40, in <module>',
            "    main()",
            f'  File "{work}/train.py", line 33, in main',
            "    trainer.train()",
            f'  File "{work}/model.py", line 12, in forward',
            "    raise ValueError('shapes (3, 4) and (5,) do not match')",
            "ValueError: shapes (3, 4) and (5,) do not match",
        ],
    )
    assert crash_summary(log, work) == (
        "ValueError: shapes (3, 4) and (5,) do not match "
        "(at train.py:40 in <module>, train.py:33 in main, model.py:12 in forward)"
    )


def test_a_chained_exception_reports_the_last_one(tmp_path):
    log = tmp_path / "output.log"
    _log(
        log,
        [
            "Traceback (most recent call last):",
            '  File "a.py", line 1, in f',
            "KeyError: 'x'",
            "",
            "During handling of the above exception, another exception occurred:",
            "",
            "Traceback (most recent call last):",
            '  File "a.py", line 3, in g',
            "RuntimeError: boom",
        ],
    )
    assert crash_summary(log) == "RuntimeError: boom (at a.py:3 in g)"


def test_no_traceback_means_no_summary(tmp_path):
    log = tmp_path / "output.log"
    _log(log, ["Killed"])
    assert crash_summary(log) == ""
    assert crash_summary(tmp_path / "missing.log") == ""


def test_log_records_carry_the_time_they_were_written_and_old_ones_read(tmp_path):
    log = tmp_path / "output.log"
    log.write_bytes(b"1@1700000000123 new line\n1 old line\n2@17 x y\n")
    new, old, short = read_log(log, 0)
    assert (new.text, new.time) == ("new line", 1700000000.123)
    assert (old.text, old.time) == ("old line", 0.0)
    assert (short.text, short.stream) == ("x y", 2)


def test_the_train_marker_is_read_from_the_environment():
    assert train_marker({}) is None
    assert train_marker({"SHOAL_TRAIN_MARKER": "/l/train-called"}) == "/l/train-called"
