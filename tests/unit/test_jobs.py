"""The scheduler's pure job core (shoal.scheduler.jobs): validation, the state machine,
records, allocation history and ListJobs pagination."""

from __future__ import annotations

import itertools
import json

import pytest
from google.protobuf import json_format

from shoal.runtime.auth import Principal, Role
from shoal.runtime.errors import FailedPrecondition, InvalidField, PermissionDenied
from shoal.runtime.store import MemoryStore
from shoal.scheduler.jobs import (
    FINAL_STATES,
    TRANSITIONS,
    InvalidTransition,
    JobRecord,
    LearnerPhase,
    LearnerRecord,
    append_allocation_event,
    can_see,
    check_transition,
    decode_page_token,
    encode_page_token,
    new_job_record,
    page_jobs,
    validate_spec,
    validate_update,
)
from shoal.scheduler.store import JOBS, JobTable
from shoal.v1 import job_pb2

ALICE = Principal("alice", Role.USER)
BOB = Principal("bob", Role.USER)
ROOT = Principal("root", Role.ADMIN)
SCHEDULER = Principal("scheduler", Role.SERVICE)
SHA = "ab" * 32
ALL_STATES = [s for s in job_pb2.JobState.values() if s != job_pb2.JOB_STATE_UNSPECIFIED]


def spec(**overrides: object) -> job_pb2.JobSpec:
    base = job_pb2.JobSpec(
        name="mnist",
        entry_point="train.py",
        artifact_id=SHA,
        batch_size=64,
        epochs=2,
        max_workers=4,
    )
    for key, value in overrides.items():
        if key == "env":
            base.env.update(value)  # type: ignore[arg-type]
        elif key in ("args", "dataset_uris"):
            getattr(base, key).extend(value)  # type: ignore[arg-type]
        else:
            setattr(base, key, value)
    return base


@pytest.mark.parametrize(
    ("overrides", "field_name", "value_text"),
    [
        ({"name": ""}, "spec.name", "''"),
        ({"name": "x" * 129}, "spec.name", "xxx"),
        ({"name": " padded"}, "spec.name", "' padded'"),
        ({"entry_point": ""}, "spec.entry_point", "''"),
        ({"entry_point": "/etc/passwd"}, "spec.entry_point", "'/etc/passwd'"),
        ({"entry_point": "../up.py"}, "spec.entry_point", "'../up.py'"),
        ({"artifact_id": "not-a-sha"}, "spec.artifact_id", "'not-a-sha'"),
        ({"batch_size": -1}, "spec.batch_size", "-1"),
        ({"batch_size": 0}, "spec.batch_size", "0"),
        ({"epochs": 0}, "spec.epochs", "0"),
        ({"min_workers": 5, "max_workers": 4}, "spec.max_workers", "4"),
        ({"min_workers": -2}, "spec.min_workers", "-2"),
        ({"max_workers": 0}, "spec.max_workers", "0"),
        ({"priority": -5}, "spec.priority", "-5"),
        ({"priority": 1_000_001}, "spec.priority", "1000001"),
        ({"sync_mode": 7}, "spec.sync_mode", "7"),
        ({"checkpoint_every": -1}, "spec.checkpoint_every", "-1"),
        ({"max_batch_per_device": -3}, "spec.max_batch_per_device", "-3"),
        ({"env": {"SHOAL_JOB_ID": "x"}}, "spec.env['SHOAL_JOB_ID']", "SHOAL_JOB_ID"),
        ({"env": {"1BAD": "x"}}, "spec.env['1BAD']", "1BAD"),
        ({"dataset_uris": ["s3://a,b"]}, "spec.dataset_uris[0]", "s3://a,b"),
        ({"args": ["ok", "nul\0"]}, "spec.args[1]", "nul"),
    ],
)
def test_validate_spec_names_the_bad_field_and_its_value(
    overrides: dict[str, object], field_name: str, value_text: str
) -> None:
    with pytest.raises(InvalidField) as caught:
        validate_spec(spec(**overrides), principal=ALICE)
    assert caught.value.field_name == field_name
    assert str(caught.value).startswith(field_name)
    assert value_text in str(caught.value)


def test_validate_spec_applies_the_defaults_and_leaves_the_input_alone() -> None:
    raw = spec(priority=0, min_workers=0, sync_mode=job_pb2.SYNC_MODE_UNSPECIFIED)
    clean = validate_spec(raw, principal=ALICE)
    assert (clean.priority, clean.min_workers, clean.sync_mode) == (
        5000,
        1,
        job_pb2.SYNC_MODE_AUTO,
    )
    assert (raw.priority, raw.min_workers) == (0, 0)


def test_validate_spec_accepts_the_boundaries() -> None:
    clean = validate_spec(
        spec(name="n" * 128, priority=1_000_000, min_workers=4, max_workers=4, batch_size=1),
        principal=ALICE,
    )
    assert clean.priority == 1_000_000


def test_a_user_cannot_submit_above_the_user_priority_limit_but_an_admin_can() -> None:
    with pytest.raises(PermissionDenied, match=r"spec.priority \(20000\)"):
        validate_spec(spec(priority=20000), principal=ALICE, user_priority_limit=10000)
    assert validate_spec(spec(priority=20000), principal=ROOT, user_priority_limit=10000)


def test_transition_table_allows_exactly_the_documented_transitions() -> None:
    expected = {
        (job_pb2.JOB_STATE_QUEUED, job_pb2.JOB_STATE_RUNNING),
        (job_pb2.JOB_STATE_QUEUED, job_pb2.JOB_STATE_CANCELLED),
        (job_pb2.JOB_STATE_QUEUED, job_pb2.JOB_STATE_FAILED),
        (job_pb2.JOB_STATE_RUNNING, job_pb2.JOB_STATE_QUEUED),
        (job_pb2.JOB_STATE_RUNNING, job_pb2.JOB_STATE_COMPLETED),
        (job_pb2.JOB_STATE_RUNNING, job_pb2.JOB_STATE_FAILED),
        (job_pb2.JOB_STATE_RUNNING, job_pb2.JOB_STATE_CANCELLING),
        (job_pb2.JOB_STATE_RUNNING, job_pb2.JOB_STATE_RECOVERING),
        (job_pb2.JOB_STATE_RECOVERING, job_pb2.JOB_STATE_RUNNING),
        (job_pb2.JOB_STATE_RECOVERING, job_pb2.JOB_STATE_QUEUED),
        (job_pb2.JOB_STATE_RECOVERING, job_pb2.JOB_STATE_COMPLETED),
        (job_pb2.JOB_STATE_RECOVERING, job_pb2.JOB_STATE_FAILED),
        (job_pb2.JOB_STATE_RECOVERING, job_pb2.JOB_STATE_CANCELLING),
        (job_pb2.JOB_STATE_CANCELLING, job_pb2.JOB_STATE_CANCELLED),
    }
    for a, b in itertools.product(ALL_STATES, ALL_STATES):
        if (a, b) in expected:
            check_transition("j", a, b)
        else:
            with pytest.raises(InvalidTransition):
                check_transition("j", a, b)
    assert all(not TRANSITIONS[s] for s in FINAL_STATES)


def record(now: float = 100.0, job_id: str = "job-1", owner: str = "alice") -> JobRecord:
    return new_job_record(
        validate_spec(spec(), principal=ALICE),
        job_id=job_id,
        owner=owner,
        submit_seq=1,
        request_id="r",
        now=now,
    )


def test_transitions_are_recorded_with_their_times_and_reasons() -> None:
    r = record()
    r.transition(job_pb2.JOB_STATE_RUNNING, "running on 4 learner(s)", 101.0)
    r.transition(job_pb2.JOB_STATE_QUEUED, "all learners lost", 102.0)
    r.transition(job_pb2.JOB_STATE_RUNNING, "running again", 103.0)
    r.transition(job_pb2.JOB_STATE_FAILED, "learner l1 failed: exit code 1", 104.0)
    assert [(h.from_state, h.to_state) for h in r.history] == [
        (job_pb2.JOB_STATE_UNSPECIFIED, job_pb2.JOB_STATE_QUEUED),
        (job_pb2.JOB_STATE_QUEUED, job_pb2.JOB_STATE_RUNNING),
        (job_pb2.JOB_STATE_RUNNING, job_pb2.JOB_STATE_QUEUED),
        (job_pb2.JOB_STATE_QUEUED, job_pb2.JOB_STATE_RUNNING),
        (job_pb2.JOB_STATE_RUNNING, job_pb2.JOB_STATE_FAILED),
    ]
    assert r.job.state_reason == "learner l1 failed: exit code 1"
    assert r.job.start_time.ToSeconds() == 101  # the first start is kept
    assert r.job.end_time.ToSeconds() == 104


def test_a_refused_transition_changes_nothing() -> None:
    r = record()
    r.transition(job_pb2.JOB_STATE_CANCELLED, "cancelled", 101.0)
    before = r.to_bytes()
    with pytest.raises(InvalidTransition, match="from CANCELLED to RUNNING"):
        r.transition(job_pb2.JOB_STATE_RUNNING, "no", 102.0)
    assert r.to_bytes() == before


def test_a_record_survives_serialization() -> None:
    r = record()
    r.coordinator_index, r.coordinator_address, r.opened = 1, "127.0.0.1:5", True
    lr = LearnerRecord("job-1-l1", "h1", "gpu0", "127.0.0.1:9", 3, "a-1", LearnerPhase.RUNNING)
    r.learners[lr.learner_id] = lr
    r.last_shrunk_at = 5.5
    r.forget_learner("job-1-l1", exit_code=0, reason="retired", now=7.0)
    r.transition(job_pb2.JOB_STATE_RUNNING, "running", 8.0)
    back = JobRecord.from_bytes(r.to_bytes(), revision=42)
    assert back.to_bytes() == r.to_bytes()
    assert back.revision == 42
    assert back.past_learners[0].agent_address == "127.0.0.1:9"


def _legacy_json(r: JobRecord) -> bytes:
    """``r`` in the JSON encoding records had before ``JobRecordState`` (FORMAT 1), as that
    release wrote it."""
    doc = {
        "format": 1,
        "job": json_format.MessageToDict(r.job, preserving_proto_field_name=True),
        "submit_seq": r.submit_seq,
        "request_id": r.request_id,
        "coordinator_index": r.coordinator_index,
        "coordinator_address": r.coordinator_address,
        "opened": r.opened,
        "closed": r.closed,
        "learner_seq": r.learner_seq,
        "learners": [{**lr.__dict__, "phase": lr.phase.value} for lr in r.learners.values()],
        "past_learners": [p.__dict__ for p in r.past_learners],
        "history": [
            {"time": h.time, "from": h.from_state, "to": h.to_state, "reason": h.reason}
            for h in r.history
        ],
        "last_shrunk_at": r.last_shrunk_at,
        "failures": r.failures,
        "last_failure": r.last_failure,
        "recoveries": r.recoveries,
        "traceparent": r.traceparent,
        "spec_digest": r.spec_digest,
    }
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


def _full_record() -> JobRecord:
    r = record()
    r.coordinator_index, r.coordinator_address, r.opened = 1, "127.0.0.1:5", True
    r.learner_seq, r.failures, r.last_failure, r.recoveries = 4, 1, "l0 exit 1", 2
    r.traceparent = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    for i, phase in enumerate((LearnerPhase.RUNNING, LearnerPhase.RETIRING, LearnerPhase.RUNNING)):
        lr = LearnerRecord(f"job-1-l{i}", "h1", f"gpu{i}", "127.0.0.1:9", 3, f"a-{i}", phase)
        lr.created_at, lr.phase_since, lr.simulated = 10.5 + i, 11.25 + i, True
        r.learners[lr.learner_id] = lr
    r.forget_learner("job-1-l1", exit_code=0, reason="retired", now=7.0)
    r.forget_learner("job-1-l0", exit_code=None, reason="host lost", now=8.0)
    r.transition(job_pb2.JOB_STATE_RUNNING, "running", 9.0)
    return r


def _fields(r: JobRecord) -> dict:
    return {k: v for k, v in r.__dict__.items() if k not in ("revision", "decided_priority")}


def test_a_record_is_stored_as_a_job_record_state_and_reads_back_equal() -> None:
    r = _full_record()
    data = r.to_bytes()
    assert not JobRecord.is_legacy(data)
    state = job_pb2.JobRecordState.FromString(data)  # plain protobuf: any reader can parse it
    assert state.job.job_id == "job-1" and len(state.past_learners) == 2
    back = JobRecord.from_bytes(data, revision=7)
    assert _fields(back) == _fields(r)
    assert back.past_learners[1].exit_code is None  # unknown stays unknown, not 0
    assert back.last_shrunk_at is None
    r.last_shrunk_at = 0.0  # a real time of 0 is not "never"
    assert JobRecord.from_bytes(r.to_bytes()).last_shrunk_at == 0.0


def test_a_record_of_the_earlier_json_encoding_reads_the_same() -> None:
    r = _full_record()
    r.last_shrunk_at = 5.5
    legacy = _legacy_json(r)
    assert JobRecord.is_legacy(legacy)
    back = JobRecord.from_bytes(legacy, revision=3)
    assert _fields(back) == _fields(r)
    assert back.to_bytes() == r.to_bytes()  # rewritten, it is the new encoding


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"\xff\xff\xff", "is not a JobRecordState"),
        (job_pb2.JobRecordState(submit_seq=3).SerializeToString(), "has no job_id"),
        (b'{"format": 2}', "format \\(2\\) is not 1"),
    ],
)
def test_an_unreadable_record_is_a_clear_error(data: bytes, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        JobRecord.from_bytes(data)


def test_an_unknown_learner_phase_is_a_clear_error() -> None:
    r = _full_record()
    state = job_pb2.JobRecordState.FromString(r.to_bytes())
    state.learners[0].phase = "teleporting"
    with pytest.raises(ValueError, match="phase \\('teleporting'\\) is unknown"):
        JobRecord.from_bytes(state.SerializeToString())


async def test_a_new_leader_rewrites_records_of_the_earlier_encoding() -> None:
    store = MemoryStore()
    old = _full_record()
    await store.put(JOBS + old.job_id, _legacy_json(old))
    table = JobTable(store)
    await table.become_leader(None)
    assert _fields(table.records[old.job_id]) == _fields(old)
    kv = await store.get(JOBS + old.job_id)
    assert kv is not None and not JobRecord.is_legacy(kv.value)
    assert _fields(JobRecord.from_bytes(kv.value)) == _fields(old)
    assert table.records[old.job_id].revision == kv.mod_revision  # later writes still CAS
    await store.close()


def test_workers_count_only_learners_holding_a_device_and_not_leaving() -> None:
    r = record()
    for i, phase in enumerate(LearnerPhase):
        r.learners[f"l{i}"] = LearnerRecord(f"l{i}", "h1", f"gpu{i}", phase=phase)
    assert r.workers() == 2  # STARTING, RUNNING
    assert r.holding() == 4  # all but PENDING


def test_update_is_refused_for_finished_jobs_and_checks_its_fields() -> None:
    r = record()
    with pytest.raises(InvalidField, match=r"max_workers \(0\) must be >= min_workers \(1\)"):
        validate_update(r.job, priority=None, max_workers=0, principal=ALICE)
    with pytest.raises(InvalidField, match=r"priority \(0\)"):
        validate_update(r.job, priority=0, max_workers=None, principal=ALICE)
    r.transition(job_pb2.JOB_STATE_CANCELLED, "cancelled", 1.0)
    with pytest.raises(FailedPrecondition, match="CANCELLED"):
        validate_update(r.job, priority=10, max_workers=None, principal=ALICE)


def test_owners_admins_and_services_see_a_job_other_users_do_not() -> None:
    assert can_see(ALICE, "alice")
    assert can_see(ROOT, "alice")
    assert can_see(SCHEDULER, "alice")
    assert not can_see(BOB, "alice")


def test_allocation_history_is_bounded_to_the_newest_events() -> None:
    events: list[job_pb2.AllocationEvent] = []
    for i in range(10):
        append_allocation_event(events, job_pb2.AllocationEvent(workers=i), limit=4)
    assert [e.workers for e in events] == [6, 7, 8, 9]


def jobs_for_paging(n: int) -> tuple[list[job_pb2.Job], dict[str, int]]:
    jobs = [
        job_pb2.Job(
            job_id=f"job-{i:02d}",
            state=job_pb2.JOB_STATE_RUNNING if i % 2 else job_pb2.JOB_STATE_QUEUED,
        )
        for i in range(n)
    ]
    return jobs, {j.job_id: i for i, j in enumerate(jobs)}


def test_pages_are_newest_first_without_gaps_or_repeats() -> None:
    jobs, seqs = jobs_for_paging(25)
    seen: list[str] = []
    token = ""
    pages = 0
    while True:
        page, token = page_jobs(jobs, seqs, states=[], page_size=10, page_token=token)
        seen.extend(j.job_id for j in page)
        pages += 1
        if not token:
            break
    assert pages == 3
    assert seen == [f"job-{i:02d}" for i in reversed(range(25))]


def test_a_page_token_stays_valid_when_jobs_are_submitted_meanwhile() -> None:
    jobs, seqs = jobs_for_paging(6)
    first, token = page_jobs(jobs, seqs, states=[], page_size=3, page_token="")
    newer, more = jobs_for_paging(8)
    second, _ = page_jobs(newer, more, states=[], page_size=3, page_token=token)
    assert [j.job_id for j in first] == ["job-05", "job-04", "job-03"]
    assert [j.job_id for j in second] == ["job-02", "job-01", "job-00"]


def test_pages_filter_by_state() -> None:
    jobs, seqs = jobs_for_paging(10)
    page, token = page_jobs(
        jobs, seqs, states=[job_pb2.JOB_STATE_RUNNING], page_size=100, page_token=""
    )
    assert [j.job_id for j in page] == ["job-09", "job-07", "job-05", "job-03", "job-01"]
    assert token == ""


@pytest.mark.parametrize(
    ("page_size", "token", "states", "field_name"),
    [
        (-1, "", [], "page_size"),
        (1001, "", [], "page_size"),
        (10, "garbage!", [], "page_token"),
        (10, encode_page_token(3, "job-03", [job_pb2.JOB_STATE_RUNNING]), [], "page_token"),
        (10, "", [99], "states"),
    ],
)
def test_bad_paging_arguments_name_the_field(
    page_size: int, token: str, states: list[int], field_name: str
) -> None:
    jobs, seqs = jobs_for_paging(5)
    with pytest.raises(InvalidField) as caught:
        page_jobs(jobs, seqs, states=states, page_size=page_size, page_token=token)
    assert caught.value.field_name == field_name


def test_page_tokens_round_trip() -> None:
    token = encode_page_token(123, "job-x", [2, 1])
    assert decode_page_token(token, [1, 2]) == (123, "job-x")
