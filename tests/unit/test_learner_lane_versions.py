"""What a learner does with OpenSharedLane replies of other shard versions (``open_lane``): an
older shard's reply names a segment file and gives no socket, a reply may offer a malformed
lane or a socket that hands nothing; each leaves the learner on gRPC streams (None), never an
exception. The shard here is a stand-in that answers with a fixed reply message; the real
shard's side is in tests/integration/test_shm_lane.py."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from shoal.contract.shm import PREFIX
from shoal.learner.grpc_lane import open_lane
from shoal.v1 import parameter_sync_service_pb2 as ps_pb2


class Shard:
    """Answers OpenSharedLane with ``reply`` and keeps the request."""

    def __init__(self, reply: ps_pb2.OpenSharedLaneResponse) -> None:
        self.reply = reply
        self.requests: list[ps_pb2.OpenSharedLaneRequest] = []

    async def OpenSharedLane(self, request: Any, **_: Any) -> ps_pb2.OpenSharedLaneResponse:
        self.requests.append(request)
        return self.reply


LAYOUT = {"size": 4096, "nonce": bytes(16), "in_offset": 64, "in_capacity": 64, "out_offset": 128}


@pytest.mark.parametrize(
    ("reply", "logged"),
    [
        (  # an older shard: a named segment, no socket
            ps_pb2.OpenSharedLaneResponse(path=f"/dev/shm/{PREFIX}1-{'ab' * 16}", **LAYOUT),
            "it offers a named segment",
        ),
        (
            ps_pb2.OpenSharedLaneResponse(
                socket_address="@shoal-lane-x", token=bytes(32), **{**LAYOUT, "in_offset": 0}
            ),
            "malformed lane",
        ),
        (  # nobody listens there
            ps_pb2.OpenSharedLaneResponse(
                socket_address="@shoal-lane-nobody-listens-here", token=bytes(32), **LAYOUT
            ),
            "Connection refused",
        ),
        (
            ps_pb2.OpenSharedLaneResponse(socket_address="/tmp/x", token=bytes(32), **LAYOUT),
            "socket_address ('/tmp/x') must be an abstract socket name",
        ),
        (ps_pb2.OpenSharedLaneResponse(refused="--shm-lane off"), "--shm-lane off"),
    ],
)
async def test_a_reply_the_learner_cannot_use_leaves_it_on_grpc(
    reply: ps_pb2.OpenSharedLaneResponse, logged: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="shoal.learner.grpc")
    shard = Shard(reply)
    lane = await open_lane(shard, job_id="j", learner_id="j-l0", metadata=(), address="shard-0")
    assert lane is None
    assert logged in caplog.text, caplog.text
    assert shard.requests[0].fetch_fd  # it says it fetches a descriptor
    if reply.path:  # it has the older shard drop the segment it made for nothing
        assert len(shard.requests) == 2 and shard.requests[1].close
