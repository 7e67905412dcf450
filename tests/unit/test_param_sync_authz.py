"""Per-job authorization of the parameter-sync methods (shoal.param_sync.authz), pure."""

from __future__ import annotations

import pytest

from shoal.param_sync.authz import (
    LEARNER_METHODS,
    OWNER_READS,
    SERVICE_METHODS,
    authorize,
    check_job_directory,
    check_storage_uri,
)
from shoal.param_sync.service import ROLES
from shoal.runtime.auth import Principal, Role
from shoal.runtime.errors import InvalidField, PermissionDenied
from shoal.v1 import parameter_sync_service_pb2 as ps_pb2

LEARNER = Principal("learner:job-1/job-1-l1", Role.LEARNER, job_id="job-1", learner_id="job-1-l1")
ALICE = Principal("alice", Role.USER)
BOB = Principal("bob", Role.USER)
SERVICE = Principal("scheduler", Role.SERVICE)
ALL = sorted(ps_pb2.DESCRIPTOR.services_by_name["ParameterSyncService"].methods_by_name)


def test_every_method_is_classified_once() -> None:
    assert set(ALL) == LEARNER_METHODS | SERVICE_METHODS
    assert not LEARNER_METHODS & SERVICE_METHODS
    assert OWNER_READS <= LEARNER_METHODS
    for method in ALL:  # the interceptor's roles agree with the per-job rules
        allowed = ROLES.allowed(method)
        assert (Role.LEARNER in allowed) == (method in LEARNER_METHODS), method
        assert (Role.USER in allowed) == (method in OWNER_READS), method


@pytest.mark.parametrize("method", ALL)
def test_services_and_admins_may_call_every_method_for_every_job(method: str) -> None:
    authorize(SERVICE, method, job_id="job-9", learner_id="x")
    authorize(Principal("root", Role.ADMIN), method, job_id="job-9")


@pytest.mark.parametrize("method", sorted(LEARNER_METHODS))
def test_a_learner_acts_only_for_its_own_job_and_only_as_itself(method: str) -> None:
    authorize(LEARNER, method, job_id="job-1", learner_id="job-1-l1")
    authorize(LEARNER, method, job_id="job-1")
    with pytest.raises(PermissionDenied, match="job 'job-2'"):
        authorize(LEARNER, method, job_id="job-2", learner_id="job-1-l1")
    with pytest.raises(PermissionDenied, match="may not act as learner 'job-1-l2'"):
        authorize(LEARNER, method, job_id="job-1", learner_id="job-1-l2")
    with pytest.raises(PermissionDenied):
        authorize(LEARNER, method, job_id="job-1", learner_id="")


@pytest.mark.parametrize("method", sorted(SERVICE_METHODS))
def test_a_learner_may_not_call_what_the_scheduler_and_the_shards_do(method: str) -> None:
    with pytest.raises(PermissionDenied, match="not a data-plane call"):
        authorize(LEARNER, method, job_id="job-1")


@pytest.mark.parametrize("method", ALL)
def test_a_user_reads_only_the_progress_of_its_own_jobs(method: str) -> None:
    if method in OWNER_READS:
        authorize(ALICE, method, job_id="job-1", owner="alice")
    for who, owner in ((BOB, "alice"), (ALICE, None), (ALICE, "")):
        if method in OWNER_READS or who is BOB:
            with pytest.raises(PermissionDenied):
                authorize(who, method, job_id="job-1", owner=owner)
    if method not in OWNER_READS:
        with pytest.raises(PermissionDenied):
            authorize(ALICE, method, job_id="job-1", owner="alice")


def test_storage_is_only_what_the_operator_configured() -> None:
    assert check_storage_uri("", "file:///s/") == "file:///s"
    assert check_storage_uri("file:///s", "file:///s/") == "file:///s"
    for bad in ("file:///tmp/elsewhere", "s3://bucket", "file:///s/../etc"):
        with pytest.raises(InvalidField, match="storage_uri"):
            check_storage_uri(bad, "file:///s")
    with pytest.raises(InvalidField, match="no --storage-uri"):
        check_storage_uri("", None)


def test_checkpoint_directories_stay_inside_the_jobs_own_checkpoints() -> None:
    ok = "file:///s/jobs/job-1/checkpoints/iter-40"
    check_job_directory("directory", ok, storage_uri="file:///s", job_id="job-1")
    for bad in (
        "file:///s/jobs/job-2/checkpoints/iter-40",
        "file:///s/jobs/job-1/checkpoints/../../job-2/checkpoints/iter-4",
        "file:///s/jobs/job-1/checkpoints/",
        "file:///etc",
        "/s/jobs/job-1/checkpoints/iter-40",
        "file:///s/jobs/job-1/checkpoints/iter-40/../../x",
    ):
        with pytest.raises(InvalidField, match="directory"):
            check_job_directory("directory", bad, storage_uri="file:///s", job_id="job-1")
