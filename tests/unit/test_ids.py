"""Identifiers that become paths: one pattern per kind (shoal.contract.ids), checked in every
request message by field name (shoal.runtime.validation)."""

from __future__ import annotations

import pytest

from shoal.contract import ids
from shoal.runtime.errors import InvalidField
from shoal.runtime.validation import check_request_ids
from shoal.v1 import (
    host_agent_service_pb2 as ha_pb2,
    job_pb2,
    job_scheduler_service_pb2 as js_pb2,
    parameter_sync_service_pb2 as ps_pb2,
    resource_manager_service_pb2 as rm_pb2,
)

#: What an attacker puts where an id goes: traversal, absolute paths, NUL bytes, unicode
#: look-alikes (Cyrillic a, fullwidth dot and solidus), control characters, very long names.
HOSTILE = [
    "..",
    ".",
    "../../../../etc/pwned",
    "/etc/passwd",
    "a/b",
    "a\\b",
    "job\0x",
    "job-1\n",
    "j\u043eb-1",  # a Cyrillic o
    "\uff0e\uff0e\uff0fx",  # fullwidth "../x"
    "job 1",
    ".hidden",
    "-rf",
    "x" * 5_000_000,
    "",
]


@pytest.mark.parametrize("kind", list(ids.IdKind))
@pytest.mark.parametrize("value", HOSTILE)
def test_no_kind_accepts_a_hostile_identifier(kind: ids.IdKind, value: str) -> None:
    assert not ids.is_valid(kind, value)
    with pytest.raises(ids.InvalidIdentifier) as caught:
        ids.check(kind, value)
    assert caught.value.field_name == kind.value
    assert len(str(caught.value)) < 300  # a 5 MB name is shortened in the message


@pytest.mark.parametrize(
    ("kind", "value"),
    [
        (ids.IdKind.JOB, "job-4f1c2a9b03de"),
        (ids.IdKind.LEARNER, "job-4f1c2a9b03de-l17"),
        (ids.IdKind.HOST, "gpu-07.dc2"),
        (ids.IdKind.DEVICE, "gpu0"),
        (ids.IdKind.ARTIFACT, "0" * 64),
        (ids.IdKind.CHECKPOINT, "iter-460"),
        (ids.IdKind.PRINCIPAL, "bob@example.org"),
    ],
)
def test_the_identifiers_shoal_makes_are_valid(kind: ids.IdKind, value: str) -> None:
    assert ids.check(kind, value) == value


def test_lengths_are_bounded_and_the_rule_says_so() -> None:
    assert ids.is_valid(ids.IdKind.JOB, "j" * 128)
    assert not ids.is_valid(ids.IdKind.JOB, "j" * 129)
    assert "1 to 128 characters" in ids.describe(ids.IdKind.JOB)
    assert not ids.is_valid(ids.IdKind.ARTIFACT, "A" * 64)  # lowercase only


def test_every_identifier_field_of_every_request_is_checked_at_any_depth() -> None:
    bad = "../x"
    cases = [
        (js_pb2.GetJobRequest(job_id=bad), "job_id"),
        (js_pb2.SubmitJobRequest(spec=job_pb2.JobSpec(artifact_id=bad)), "spec.artifact_id"),
        (ps_pb2.RetireLearnersRequest(job_id="j", learner_ids=["ok", bad]), "learner_ids[1]"),
        (
            rm_pb2.AcquireDevicesRequest(claims=[rm_pb2.DeviceClaim(job_id="j", host_id=bad)]),
            "claims[0].host_id",
        ),
        (ha_pb2.StartLearnerRequest(job_id="j", learner_id="l", device_id=bad), "device_id"),
        (
            ps_pb2.SyncStepRequest(header=ps_pb2.TensorBundleHeader(job_id="j", sender_id=bad)),
            "header.sender_id",
        ),
    ]
    for message, where in cases:
        with pytest.raises(InvalidField) as caught:
            check_request_ids(message)
        assert caught.value.field_name == where, message


def test_unset_identifiers_and_maps_pass_and_a_frame_is_checked_by_its_header() -> None:
    check_request_ids(js_pb2.ListJobsRequest())
    check_request_ids(
        js_pb2.SubmitJobRequest(spec=job_pb2.JobSpec(artifact_id="0" * 64, env={"../x": "y"}))
    )

    class Frame:
        header = ps_pb2.TensorBundleHeader(job_id="job\0", sender_id="l")
        chunk = None

    with pytest.raises(InvalidField):
        check_request_ids(Frame())
    check_request_ids(object())  # a raw chunk: nothing to check
