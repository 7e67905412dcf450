"""The committed generated code matches protos/, and the API follows the conventions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from shoal.v1 import (
    host_agent_service_pb2,
    job_scheduler_service_pb2,
    parameter_sync_service_pb2,
    resource_manager_service_pb2,
)

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_not_stale_against_protos():
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_protos.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr


def test_every_rpc_has_its_own_request_and_response_and_a_comment_naming_status_codes():
    codes = (
        "NOT_FOUND",
        "INVALID_ARGUMENT",
        "UNAUTHENTICATED",
        "FAILED_PRECONDITION",
        "UNAVAILABLE",
    )
    for module in (
        job_scheduler_service_pb2,
        resource_manager_service_pb2,
        host_agent_service_pb2,
        parameter_sync_service_pb2,
    ):
        for service in module.DESCRIPTOR.services_by_name.values():
            assert service.name.endswith("Service")
            proto = (ROOT / "protos" / module.DESCRIPTOR.name).read_text()
            for method in service.methods:
                assert method.input_type.name == f"{method.name}Request"
                assert method.output_type.name == f"{method.name}Response"
                block = proto.split(f"rpc {method.name}(")[0].rsplit(";", 1)[-1]
                assert "Returns" in block and any(c in block for c in codes), method.full_name


def test_list_calls_paginate():
    for request in (
        job_scheduler_service_pb2.ListJobsRequest,
        resource_manager_service_pb2.ListHostsRequest,
    ):
        fields = request.DESCRIPTOR.fields_by_name
        assert {"page_size", "page_token"} <= set(fields)
