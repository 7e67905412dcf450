"""The learner's side of the same-host shared-memory lane (docs/data-plane.md, "The same-host
lane").

When a shard of the job runs on the learner's host (same :func:`shoal.contract.shm.host_id`)
and has the lane on, :func:`open_lane` gets this learner's lane from it (``OpenSharedLane``),
fetches the nameless segment's descriptor from the shard's Unix socket with the reply's
one-time token (``shoal.contract.lane_handoff``), checks it and maps it. A SyncStep to that
shard then writes the gradients into the segment's in-region and sends only the header
(``shared_memory``); the shard answers with a header naming where in the out-region it wrote
the new parameters. gRPC stays the control channel; anything that does not work (another
host, another user, another network namespace, an old shard that offers a named segment, a
refusal) leaves the learner on gRPC streams for that shard.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import torch
from grpc import aio

from shoal.contract.lane_handoff import fetch_fd
from shoal.contract.shm import SHM_DIR, LaneError, Segment, host_id
from shoal.contract.wire import BundleError, TensorMeta, validate_layout
from shoal.v1 import parameter_sync_service_pb2 as ps_pb2

__all__ = ["ClientLane", "lane_refused", "open_lane"]

log = logging.getLogger("shoal.learner.grpc")

#: The shard's answer to a lane SyncStep when it has no lane of this learner (it restarted,
#: or dropped the lane): the learner sends that iteration as chunks and opens a new lane.
_NO_LANE = "no shared-memory lane"


def lane_refused(exc: aio.AioRpcError) -> bool:
    """Whether a lane SyncStep failed only because the shard has no lane of this learner."""
    return exc.code() == grpc.StatusCode.FAILED_PRECONDITION and _NO_LANE in (exc.details() or "")


@dataclass
class ClientLane:
    """A mapped lane segment and its two regions (as the shard gave them, checked)."""

    segment: Segment
    in_offset: int
    in_capacity: int
    out_offset: int
    rounds: int = 0  # SyncSteps that went through it

    def write(self, metas: Sequence[TensorMeta], sources: Sequence[np.ndarray], total: int) -> int:
        """Copy a bundle's bytes (``sources[j]`` at ``metas[j].offset``) into the in-region;
        returns the offset the header must name."""
        view = self.segment.region(
            self.in_offset,
            total,
            lo=self.in_offset,
            hi=self.in_offset + self.in_capacity,
            what="bundle",
        )
        target = np.frombuffer(view, dtype=np.uint8)
        for m, source in zip(metas, sources, strict=True):
            target[m.offset : m.end] = source
        return self.in_offset

    def answer_views(
        self, header: ps_pb2.TensorBundleHeader, metas: Sequence[TensorMeta]
    ) -> list[torch.Tensor]:
        """The shard's answer as tensors viewing the out-region (no copy): ``metas[j]`` at
        ``header.shared_memory_offset + metas[j].offset``. The range must lie in the
        out-region and the layout be well formed (:class:`LaneError` otherwise). The shard
        writes that range again only with its answer to this learner's next contribution."""
        view = self.segment.region(
            header.shared_memory_offset,
            header.total_bytes,
            lo=self.out_offset,
            hi=self.segment.size,
            what="header.shared_memory_offset",
        )
        try:
            validate_layout(metas, header.total_bytes, what="header.tensors")
        except BundleError as exc:
            raise LaneError(str(exc)) from None
        flat = np.frombuffer(view, dtype=np.uint8)
        out: list[torch.Tensor] = []
        for m in metas:
            if m.numel == 0:
                out.append(torch.empty(m.shape, dtype=m.torch_dtype))
                continue
            raw = torch.from_numpy(flat[m.offset : m.end])
            out.append(raw.view(m.torch_dtype).view(m.shape))
        self.rounds += 1
        return out

    def close(self) -> None:
        self.segment.close()


#: Seconds the learner waits for the shard's socket to hand the descriptor.
FETCH_TIMEOUT_S = 10.0


def _take_segment(address: str, token: bytes, size: int, nonce: bytes) -> Segment:
    """Fetch the descriptor, check and map the segment behind it, close the descriptor."""
    fd = fetch_fd(address, token, timeout=FETCH_TIMEOUT_S)
    try:
        return Segment.from_fd(fd, size, nonce)
    finally:
        os.close(fd)


async def open_lane(
    stub: Any, *, job_id: str, learner_id: str, metadata: Any, address: str, shm_dir: str = SHM_DIR
) -> ClientLane | None:
    """This learner's lane on the shard behind ``stub``, or None (stay on gRPC streams)."""
    mine = host_id(shm_dir)
    if not mine:
        return None
    request = ps_pb2.OpenSharedLaneRequest(
        job_id=job_id, learner_id=learner_id, host_id=mine, fetch_fd=True
    )
    try:
        reply = await stub.OpenSharedLane(request, metadata=metadata, timeout=10.0)
    except aio.AioRpcError as exc:  # an older shard (UNIMPLEMENTED), a shard going away
        log.info("no shared-memory lane to shard %s: %s", address, exc.details() or exc.code())
        return None
    if reply.refused:
        log.info("no shared-memory lane to shard %s: %s", address, reply.refused)
        return None
    if not reply.socket_address:  # an older shard: a named segment, which this learner skips
        log.info("no shared-memory lane to shard %s: it offers a named segment", address)
        # Have it drop the segment now (its name would stay up to 30 s, the memory till the
        # job ends).
        close = ps_pb2.OpenSharedLaneRequest(job_id=job_id, learner_id=learner_id, close=True)
        with contextlib.suppress(aio.AioRpcError):
            await stub.OpenSharedLane(close, metadata=metadata, timeout=2.0)
        return None
    if not 0 < reply.in_offset <= reply.in_offset + reply.in_capacity <= reply.out_offset:
        log.warning("shard %s offered a malformed lane: %s", address, reply)
        return None
    try:
        segment = await asyncio.to_thread(
            _take_segment, reply.socket_address, reply.token, reply.size, reply.nonce
        )
    except (OSError, LaneError) as exc:  # another network namespace, another user, refused
        log.info("no shared-memory lane to shard %s: %s", address, exc)
        return None
    if reply.out_offset > segment.size:
        segment.close()
        return None
    log.info(
        "shared-memory lane to shard %s open (%d bytes): tensors move through it, gRPC "
        "carries the headers",
        address,
        reply.size,
    )
    return ClientLane(segment, reply.in_offset, reply.in_capacity, reply.out_offset)


async def close_lane(stub: Any, lane: ClientLane, *, job_id: str, learner_id: str, md: Any) -> None:
    """Tell the shard to drop the lane (best effort) and unmap it."""
    request = ps_pb2.OpenSharedLaneRequest(job_id=job_id, learner_id=learner_id, close=True)
    try:
        await stub.OpenSharedLane(request, metadata=md, timeout=2.0)
    except aio.AioRpcError:
        pass  # the shard drops it with the job, or when it exits
    finally:
        lane.close()
