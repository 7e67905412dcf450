"""The coordinator record in etcd: key, encoding, and refusal of malformed values."""

import re

import pytest

from shoal.contract import data_plane as dp
from shoal.contract.ids import InvalidIdentifier


def test_a_coordinator_record_round_trips_through_its_json_value() -> None:
    record = dp.CoordinatorRecord(address="10.0.0.2:7301", index=1, epoch=3)
    value = dp.encode_coordinator(record)
    assert value == b'{"address": "10.0.0.2:7301", "epoch": 3, "index": 1}'
    assert dp.decode_coordinator(value) == record
    assert dp.decode_coordinator(value.decode()) == record


def test_the_key_lives_under_the_coordinators_prefix_and_checks_the_job_id() -> None:
    assert dp.coordinator_key("job-1") == "/shoal/v1/parameter-sync/coordinators/job-1"
    with pytest.raises(InvalidIdentifier):
        dp.coordinator_key("../etc")


@pytest.mark.parametrize(
    ("value", "names"),
    [
        (b"not json", "not JSON"),
        (b"[1, 2]", "not an object"),
        (b'{"address": "a:1", "index": 0}', "epoch"),
        (b'{"address": "nohost", "index": 0, "epoch": 1}', "address ('nohost')"),
        (b'{"address": "a:1", "index": -1, "epoch": 1}', "index (-1)"),
        (b'{"address": "a:1", "index": 0, "epoch": "2"}', "epoch ('2')"),
        (b'{"address": "a:1", "index": true, "epoch": 2}', "index (True)"),
    ],
)
def test_a_malformed_record_is_refused_naming_the_field(value: bytes, names: str) -> None:
    with pytest.raises(dp.InvalidCoordinatorRecord, match=re.escape(names)):
        dp.decode_coordinator(value)
