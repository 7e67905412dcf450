"""shoal's errors: defined once, in shoal.contract.errors (standard library only), mapped to
gRPC statuses by the server's table (shoal.runtime.errors), decoded on the receiving side by
one decode_rpc_error."""

from __future__ import annotations

import ast
import inspect
import pathlib
import subprocess
import sys

import grpc
import pytest

import shoal.contract.errors as contract_errors
from shoal.contract.errors import (
    REASONS,
    ArtifactNotFound,
    DeviceNotFound,
    FencedOut,
    InvalidTransition,
    NotFound,
    ShoalError,
    StoreError,
    decode_rpc_error,
)
from shoal.runtime.errors import DEFAULT_TABLE
from shoal.v1 import errors_pb2

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "clients" / "src", ROOT / "learner" / "src", ROOT / "services" / "src"]


def _modules_loaded_by(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nprint(','.join(sorted(sys.modules)))\n"
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()
    return set(out.split(","))


@pytest.mark.parametrize(
    "module",
    ["shoal.contract.errors", "shoal.resource_manager.core", "shoal.scheduler.jobs"],
)
def test_the_errors_and_the_pure_cores_import_no_grpc(module: str) -> None:
    loaded = _modules_loaded_by(f"import {module}")
    heavy = sorted(n for n in loaded if n.split(".")[0] in ("grpc", "aetcd", "torch"))
    assert heavy == [], f"importing {module} loaded {heavy}"


def test_the_errors_module_imports_only_the_standard_library() -> None:
    tree = ast.parse(inspect.getsource(contract_errors))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported


def test_the_reason_names_are_the_error_reason_enum() -> None:
    assert set(errors_pb2.ErrorReason.keys()) == REASONS


def test_every_error_class_names_a_known_reason_and_a_typo_fails_at_once() -> None:
    for value in vars(contract_errors).values():
        if isinstance(value, type) and issubclass(value, ShoalError):
            assert value.reason in REASONS, value
    with pytest.raises(ValueError, match="ERROR_REASON_TYPO"):
        NotFound("job", "j1", reason="ERROR_REASON_TYPO")


def test_each_error_class_is_defined_once_in_the_whole_tree() -> None:
    names = {n for n, v in vars(contract_errors).items() if isinstance(v, type)}
    for src in SOURCES:
        for path in src.rglob("*.py"):
            if path.name.endswith("_pb2.py") or path.name.endswith("_pb2_grpc.py"):
                continue
            if path.resolve() == pathlib.Path(contract_errors.__file__).resolve():
                continue
            tree = ast.parse(path.read_text())
            defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
            assert not defined & names, f"{path} defines {sorted(defined & names)} again"


def test_one_fenced_out_for_the_store_and_the_services() -> None:
    from shoal.runtime import store

    assert store.FencedOut is FencedOut
    assert store.StoreError is StoreError
    fence = store.Fence("/shoal/leader", 3)
    fenced = FencedOut.of_fence(fence, 5)
    assert isinstance(fenced, StoreError) and fenced.fence is fence
    assert "has create_revision 5" in str(fenced)
    assert "is gone" in str(FencedOut.of_fence(fence, None))
    for error in (fenced, FencedOut("fencing_token (revision 2) is stale")):
        mapped = DEFAULT_TABLE.lookup(error)
        assert mapped is not None
        assert mapped.code == grpc.StatusCode.FAILED_PRECONDITION
        assert ("shoal-error-reason", "ERROR_REASON_FENCED_OUT") in mapped.metadata
        assert mapped.message == str(error)


@pytest.mark.parametrize(
    ("error", "message", "reason"),
    [
        (
            DeviceNotFound("gpu7", ["gpu0", "gpu1"]),
            "device 'gpu7' not found on this host (it has: gpu0, gpu1)",
            "ERROR_REASON_DEVICE_NOT_FOUND",
        ),
        (
            DeviceNotFound("gpu7", host_id="h1"),
            "device on host 'h1': 'gpu7' not found",
            "ERROR_REASON_DEVICE_NOT_FOUND",
        ),
        (ArtifactNotFound("a1"), "artifact 'a1' not found", "ERROR_REASON_ARTIFACT_NOT_FOUND"),
        (
            ArtifactNotFound("a1", "no such file"),
            "artifact 'a1' not found (no such file)",
            "ERROR_REASON_ARTIFACT_NOT_FOUND",
        ),
        (InvalidTransition("lost -> lost is not allowed"), None, "ERROR_REASON_WRONG_STATE"),
    ],
)
def test_the_merged_errors_keep_each_callers_message(
    error: ShoalError, message: str | None, reason: str
) -> None:
    mapped = DEFAULT_TABLE.lookup(error)
    assert mapped is not None
    assert (message or error.message) == mapped.message == str(error)
    assert ("shoal-error-reason", reason) in mapped.metadata


def test_a_job_transition_error_names_the_states_and_keeps_them() -> None:
    from shoal.scheduler.jobs import check_transition
    from shoal.v1 import job_pb2

    with pytest.raises(InvalidTransition, match="from CANCELLED to RUNNING") as caught:
        check_transition("j1", job_pb2.JOB_STATE_CANCELLED, job_pb2.JOB_STATE_RUNNING)
    assert caught.value.current == job_pb2.JOB_STATE_CANCELLED
    assert caught.value.target == job_pb2.JOB_STATE_RUNNING


class FakeRpcError:
    def __init__(self, code: grpc.StatusCode | None, details: str | None, trailers: object):
        self._code, self._details, self._trailers = code, details, trailers

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str | None:
        return self._details

    def trailing_metadata(self) -> object:
        return self._trailers


@pytest.mark.parametrize(
    ("trailers", "reason", "leader"),
    [
        ((("shoal-error-reason", "ERROR_REASON_NOT_LEADER"), ("shoal-leader", "rm-2:7000")),
         "ERROR_REASON_NOT_LEADER", "rm-2:7000"),
        ((("shoal-error-reason", b"ERROR_REASON_FENCED_OUT"),), "ERROR_REASON_FENCED_OUT", ""),
        ((("other", "x"),), "", ""),
        (None, "", ""),
    ],
)  # fmt: skip
def test_decode_rpc_error_reads_the_status_and_the_trailers(
    trailers: object, reason: str, leader: str
) -> None:
    info = decode_rpc_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "down", trailers))
    assert (info.code, info.code_name, info.message) == (
        grpc.StatusCode.UNAVAILABLE,
        "UNAVAILABLE",
        "down",
    )
    assert (info.reason, info.leader) == (reason, leader)
    unknown = decode_rpc_error(FakeRpcError(None, None, ()))
    assert (unknown.code_name, unknown.message) == ("UNKNOWN", "")


def test_the_error_trailer_is_decoded_only_by_decode_rpc_error() -> None:
    decoder = pathlib.Path(contract_errors.__file__).resolve()
    for src in SOURCES:
        for path in src.rglob("*.py"):
            if path.resolve() == decoder or path.name.endswith("_pb2_grpc.py"):
                continue
            text = path.read_text()
            assert "trailing_metadata()" not in text, f"{path} reads trailers itself"
