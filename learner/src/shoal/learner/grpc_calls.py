"""Wire-level pieces of the ``"grpc"`` backend (``grpc_backend.py``): the tensor-stream
multi-callables with shoal's hand codec, the per-shard routing record, how a failed call maps
to the learner's exceptions, and the small tensor/byte helpers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import torch
from grpc import aio

from shoal.contract import environment
from shoal.contract.errors import decode_rpc_error
from shoal.contract.wire import MAX_INLINE_BYTES, byte_view, frame_decoder, serialize
from shoal.learner.backend import IterationAborted, TrainingSetup
from shoal.learner.env import switch
from shoal.learner.grpc_lane import ClientLane
from shoal.v1 import (
    parameter_sync_service_pb2 as ps_pb2,
    parameter_sync_service_pb2_grpc as ps_grpc,
)

__all__ = [
    "DEFAULT_INLINE_KB",
    "MAX_MESSAGE_BYTES",
    "SERVICE_PATH",
    "LearnerEvicted",
    "inline_bytes_from_env",
    "optimizer_proto",
    "stream_methods",
]

SERVICE_PATH = "/shoal.v1.ParameterSyncService/"
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
#: A tensor stream (SyncStep, PullParameters) failing so means its shard is down, or came back
#: without the job (it restarted): the coordinator notices, recovers the shard's slice, and the
#: next boundary says what to run; the learner waits a moment so that it does not spin.
_SHARD_LOST = (*_RETRYABLE, grpc.StatusCode.NOT_FOUND)
_SHARD_LOST_PAUSE_S = 0.5
#: What grpc.aio's client reports instead of the server's status when the server ends a
#: client-streaming call before the client finished writing (grpc/grpc#36066): a shard that
#: refused or dropped the stream (it lost the job), not a fault of the request.
_CORE_MASKED = "Internal error from Core"


def _shard_lost(exc: aio.AioRpcError) -> bool:
    """Whether a tensor stream failed because its shard is down or lost the job."""
    if exc.code() in _SHARD_LOST:
        return True
    return exc.code() == grpc.StatusCode.INTERNAL and (exc.details() or "") == _CORE_MASKED


class LearnerEvicted(RuntimeError):
    """The coordinator no longer knows this learner (it was evicted, or the job's data plane
    was restarted without it): the learner must exit."""


#: ``SHOAL_INLINE_KB``'s default: a bundle of at most 256 KiB travels as one message each way.
DEFAULT_INLINE_KB = 256


def boundary_ahead_enabled() -> bool:
    """``SHOAL_BOUNDARY_AHEAD``: ``on`` (the default) or ``off``."""
    return switch(environment.BOUNDARY_AHEAD, "on")


def inline_bytes_from_env() -> int:
    """``SHOAL_INLINE_KB`` in bytes: a gradient bundle of at most this size goes to its shard
    as one message (the bytes inline in the header) and the shards may answer so; 0: chunks
    only. Refused (ValueError naming the variable and the value) unless a whole number of KiB
    in 0..4096."""
    raw = os.environ.get(environment.INLINE_KB, str(DEFAULT_INLINE_KB)).strip()
    limit = MAX_INLINE_BYTES // 1024
    try:
        kib = int(raw)
    except ValueError:
        raise ValueError(
            f"{environment.INLINE_KB} ({raw!r}) must be a whole number of KiB in 0..{limit}"
        ) from None
    if not 0 <= kib <= limit:
        raise ValueError(f"{environment.INLINE_KB} ({kib}) must be 0..{limit} KiB (0: off)")
    return kib * 1024


def stream_methods(channel: aio.Channel) -> dict[str, Any]:
    """Multi-callables of the three tensor streams with shoal's hand codec
    (``shoal.contract.wire``): requests pass pre-encoded bytes through, responses are
    decoded into zero-copy :class:`~shoal.contract.wire.Frame` objects.

    ``SyncStepOnce`` calls the same ``SyncStep`` method with exactly one request message (a
    header carrying its bytes inline): gRPC sends the message and the end of the request
    stream in one batch, where a request iterator costs a write and then a half-close. The
    server cannot tell the difference (on the wire both are one stream). ``SyncStepUnary`` also
    reads the answer as one message, with the call's status in the same batch: only for an
    answer known to come inline (the learner asks for any size up to the most a header carries
    and its slice is smaller, ``answer_bytes_of``)."""
    return {
        "SyncStepUnary": channel.unary_unary(
            SERVICE_PATH + "SyncStep",
            request_serializer=serialize,
            response_deserializer=frame_decoder(ps_pb2.SyncStepResponse),
        ),
        "SyncStepOnce": channel.unary_stream(
            SERVICE_PATH + "SyncStep",
            request_serializer=serialize,
            response_deserializer=frame_decoder(ps_pb2.SyncStepResponse),
        ),
        "InitializeParameters": channel.stream_unary(
            SERVICE_PATH + "InitializeParameters",
            request_serializer=serialize,
            response_deserializer=ps_pb2.InitializeParametersResponse.FromString,
        ),
        "SyncStep": channel.stream_stream(
            SERVICE_PATH + "SyncStep",
            request_serializer=serialize,
            response_deserializer=frame_decoder(ps_pb2.SyncStepResponse),
        ),
        "PullParameters": channel.unary_stream(
            SERVICE_PATH + "PullParameters",
            request_serializer=ps_pb2.PullParametersRequest.SerializeToString,
            response_deserializer=frame_decoder(ps_pb2.PullParametersResponse),
        ),
    }


@dataclass
class _Shard:
    index: int
    address: str
    tensors: list[int]  # indices into the job layout (params first, then buffers)
    stub: ps_grpc.ParameterSyncServiceStub | None = None
    streams: dict[str, Any] | None = None
    lane: ClientLane | None = None  # the same-host lane (grpc_lane.py), when open
    lane_tried: bool = False
    # Its lanes' control connections end before their first answer (an older shard, which
    # closes it): its lanes are opened without one.
    no_lane_control: bool = False
    slice_bytes: int = -1  # the packed size of the whole slice (ps_overlap.py; -1: not yet)
    answer_bytes: int = -1  # at least the size of the shard's answer (answer_bytes_of)


#: A shard lays its slice out with each tensor 64-byte aligned (``shoal.param_sync.shard``).
SHARD_ALIGN = 64


def answer_bytes_of(nbytes: Sequence[int]) -> int:
    """An upper bound of the size of a shard's answer for a slice of tensors of ``nbytes``
    (each tensor 64-byte aligned in the shard's layout, whatever their order)."""
    return sum(-(-n // SHARD_ALIGN) * SHARD_ALIGN for n in nbytes)


def optimizer_proto(setup: TrainingSetup) -> ps_pb2.OptimizerSpec:
    """What the shards need to step their slices as this learner's optimizer would: the class,
    its arguments, the parameter groups by name, clipping and non-finite skipping."""
    groups = setup.optimizer.groups
    return ps_pb2.OptimizerSpec(
        name=setup.optimizer.name,
        hyperparameters_json=json.dumps(dict(setup.optimizer.kwargs), sort_keys=True),
        clip_grad_norm=setup.clip_grad_norm or 0.0,
        skip_nonfinite=setup.skip_nonfinite,
        measure_grad_norm=setup.measure_grad_norm,
        param_groups_json=json.dumps([[list(n), dict(o)] for n, o in groups], sort_keys=True)
        if groups
        else "",
    )


def _copy_sink(views: Sequence[np.ndarray], targets: Sequence[int]) -> Any:
    def sink(i: int, off: int, seg: memoryview) -> None:
        views[targets[i]][off : off + seg.nbytes] = np.frombuffer(seg, dtype=np.uint8)

    return sink


def _cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu").contiguous()


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    if tensor.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return byte_view(tensor)


def _why(exc: aio.AioRpcError, shard: _Shard | None) -> str:
    """Why a tensor stream failed, for the learner's log: the shard that refused it, the
    status code, the machine-readable reason and the shard's message."""
    reason = decode_rpc_error(exc).reason or "no reason"
    where = f"shard {shard.index} ({shard.address})" if shard is not None else "a shard"
    return f"{where}: {exc.code().name} {reason}: {exc.details() or ''}"


def _refusal_of(exc: aio.AioRpcError, shard: _Shard | None) -> ps_pb2.StaleRefusal | None:
    """A shard's refusal of this learner's SyncStep as stale, with the generation floor it
    said (the ``shoal-generation-floor`` trailer), for the next Boundary; None when the
    refusal says no floor (the learner is not a member, or an older shard)."""
    info = decode_rpc_error(exc)
    if (
        shard is None
        or info.reason != "ERROR_REASON_STALE_GENERATION"
        or info.generation_floor is None
    ):
        return None
    return ps_pb2.StaleRefusal(shard_index=shard.index, generation_floor=info.generation_floor)


def _translate(exc: aio.AioRpcError) -> Exception:
    """Map a failed call to the learner's exceptions."""
    code = exc.code()
    reason = decode_rpc_error(exc).reason
    text = exc.details() or str(code)
    if code == grpc.StatusCode.ABORTED:
        return IterationAborted(text)
    if code == grpc.StatusCode.FAILED_PRECONDITION and reason == "ERROR_REASON_STALE_GENERATION":
        return LearnerEvicted(text)
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
        return ValueError(text)
    return RuntimeError(f"{code.name}: {text}")
