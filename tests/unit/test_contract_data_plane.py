"""The coordinator record in etcd: key, encoding, and refusal of malformed values."""

import re

import pytest

from shoal.contract import data_plane as dp
from shoal.contract.ids import InvalidIdentifier
from shoal.v1 import job_pb2


def test_a_coordinator_record_round_trips_through_its_protobuf_value() -> None:
    record = dp.CoordinatorRecord(address="10.0.0.2:7301", index=1, epoch=3)
    value = dp.encode_coordinator(record)
    state = job_pb2.CoordinatorRecordState.FromString(value)
    assert (state.address, state.index, state.epoch) == ("10.0.0.2:7301", 1, 3)
    assert not dp.is_legacy(value)
    assert dp.decode_coordinator(value) == record


def test_a_record_in_the_legacy_json_encoding_is_still_read() -> None:
    legacy = b'{"address": "10.0.0.2:7301", "epoch": 3, "index": 1}'
    record = dp.CoordinatorRecord(address="10.0.0.2:7301", index=1, epoch=3)
    assert dp.is_legacy(legacy)
    assert dp.decode_coordinator(legacy) == record
    assert dp.decode_coordinator(legacy.decode()) == record
    assert dp.decode_coordinator(dp.encode_coordinator(record)) == dp.decode_coordinator(legacy)


def test_the_key_lives_under_the_coordinators_prefix_and_checks_the_job_id() -> None:
    assert dp.coordinator_key("job-1") == "/shoal/v1/parameter-sync/coordinators/job-1"
    with pytest.raises(InvalidIdentifier):
        dp.coordinator_key("../etc")


@pytest.mark.parametrize(
    ("value", "names"),
    [
        (b"not json", "not a CoordinatorRecordState"),
        (b"{not json", "not JSON"),
        ("[1, 2]", "not an object"),
        (b'{"address": "a:1", "index": 0}', "epoch"),
        (b'{"address": "nohost", "index": 0, "epoch": 1}', "address ('nohost')"),
        (b'{"address": "a:1", "index": -1, "epoch": 1}', "index (-1)"),
        (b'{"address": "a:1", "index": 0, "epoch": "2"}', "epoch ('2')"),
        (b'{"address": "a:1", "index": true, "epoch": 2}', "index (True)"),
    ],
)
def test_a_malformed_record_is_refused_naming_the_field(value: bytes | str, names: str) -> None:
    with pytest.raises(dp.InvalidCoordinatorRecord, match=re.escape(names)):
        dp.decode_coordinator(value)


@pytest.mark.parametrize(
    ("state", "names"),
    [
        (job_pb2.CoordinatorRecordState(index=0, epoch=1), "address ('')"),
        (job_pb2.CoordinatorRecordState(address="nohost", epoch=1), "address ('nohost')"),
        (job_pb2.CoordinatorRecordState(address="a:1", index=-2, epoch=1), "index (-2)"),
        (job_pb2.CoordinatorRecordState(address="a:1", index=0, epoch=-1), "epoch (-1)"),
    ],
)
def test_a_protobuf_record_with_a_bad_field_is_refused_naming_it(
    state: job_pb2.CoordinatorRecordState, names: str
) -> None:
    with pytest.raises(dp.InvalidCoordinatorRecord, match=re.escape(names)):
        dp.decode_coordinator(state.SerializeToString())


def test_bytes_that_are_neither_json_nor_the_message_are_refused() -> None:
    with pytest.raises(dp.InvalidCoordinatorRecord, match="not a CoordinatorRecordState"):
        dp.decode_coordinator(b"\x0a\x09trunc")  # field 1 claims 9 bytes, 5 follow
