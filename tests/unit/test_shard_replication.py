"""A slice's replica (shoal.param_sync.shard.ShardJob) without a network: it starts from the
primary's state, takes the primary's exact sums and applies the same commit, and stays
bit-identical to the primary through Adam steps and a BatchNorm-like buffer."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

from shoal.contract.wire import TensorMeta, byte_view, pack_layout
from shoal.param_sync.coordinator import OptimizerConfig
from shoal.param_sync.shard import Contribution, ShardJob
from shoal.param_sync.shard_checkpoint import _safetensors_metadata
from shoal.runtime.errors import FailedPrecondition, InvalidField

METAS = [
    TensorMeta("w", "float32", (5, 3), 0, 60),
    TensorMeta("b", "float32", (5,), 0, 20),
    TensorMeta("bn.running_mean", "float32", (5,), 0, 20, buffer=True),
]
ADAM = OptimizerConfig("Adam", '{"lr": 0.01, "betas": [0.9, 0.99]}')


def shard() -> ShardJob:
    layout, _ = pack_layout(METAS)
    return ShardJob("job-1", 1, layout, ADAM)


def contribution(sj: ShardJob, learner: str, k: int, tensors: list[torch.Tensor], n: int):
    metas, total = pack_layout(list(sj.metas))
    flat = bytearray(total)
    for m, t in zip(metas, tensors, strict=True):
        flat[m.offset : m.end] = byte_view(t.contiguous()).tobytes()
    c = Contribution(learner, 1, k, n, 0.5 * n, 0.0, list(enumerate(metas)), total)
    c.chunks.append(memoryview(bytes(flat)))
    return c


def assert_same_state(a: ShardJob, b: ShardJob, iteration: int) -> None:
    """Same tensors (parameters, buffers, optimizer state) bit for bit, same JSON metadata."""
    blob_a, blob_b = a.state_bytes(iteration), b.state_bytes(iteration)
    ta, tb = safetensors.torch.load(blob_a), safetensors.torch.load(blob_b)
    assert ta.keys() == tb.keys()
    for key in ta:
        assert torch.equal(ta[key], tb[key]), key
    meta_a, meta_b = _safetensors_metadata(blob_a), _safetensors_metadata(blob_b)
    assert {k: json.loads(v) if k != "job_id" else v for k, v in meta_a.items()} == {
        k: json.loads(v) if k != "job_id" else v for k, v in meta_b.items()
    }


def test_a_replica_fed_the_primarys_sums_stays_bit_identical_through_adam_steps() -> None:
    torch.manual_seed(0)
    primary = shard()
    start = [torch.randn(m.shape) for m in METAS]
    primary.initialize(contribution(primary, "init", 0, start, 0))
    replica = shard()
    assert replica.load_state_bytes(primary.state_bytes(0)) == 0
    for k in range(4):
        for learner, n in (("a", 3), ("b", 5)):
            grads = [torch.randn(m.shape) for m in METAS]
            primary.accumulate(contribution(primary, learner, k, grads, n), frozenset("ab"))
        # Taking iteration k's sums applies k - 1's first (the primary committed it).
        assert replica.keep_pending(primary.pending_bytes(1, k)) == k
        assert replica.completed == primary.completed == k
        for name, p in primary.named_tensors().items():
            assert torch.equal(p, replica.named_tensors()[name]), (k, name)
        primary.commit(1, k)
    replica.settle(4)  # the coordinator says 4 iterations were committed: apply the last
    assert_same_state(primary, replica, 4)  # optimizer state included


def test_a_replica_drops_sums_of_an_aborted_iteration_and_takes_its_rerun() -> None:
    primary = shard()
    primary.initialize(contribution(primary, "init", 0, [torch.ones(m.shape) for m in METAS], 0))
    replica = shard()
    replica.load_state_bytes(primary.state_bytes(0))
    primary.accumulate(
        contribution(primary, "a", 0, [torch.full(m.shape, 9.0) for m in METAS], 1),
        frozenset("a"),
    )
    replica.keep_pending(primary.pending_bytes(1, 0))
    primary.abort(1, 0)  # a member was evicted: iteration 0 runs again in generation 2
    grads = [torch.full(m.shape, 0.5) for m in METAS]
    rerun = contribution(primary, "b", 0, grads, 1)
    rerun.generation = 2
    primary.accumulate(rerun, frozenset("b"))
    assert replica.keep_pending(primary.pending_bytes(2, 0)) == 0  # replaces the aborted sums
    primary.commit(2, 0)
    replica.settle(1)
    assert_same_state(primary, replica, 1)
    replica.settle(1)  # settling again changes nothing
    assert_same_state(primary, replica, 1)


def test_a_restored_slice_carries_parameters_buffers_and_optimizer_state() -> None:
    primary = shard()
    primary.initialize(contribution(primary, "init", 0, [torch.ones(m.shape) for m in METAS], 0))
    primary.accumulate(
        contribution(primary, "a", 0, [torch.full(m.shape, 0.5) for m in METAS], 2),
        frozenset("a"),
    )
    primary.commit(1, 0)
    copy = shard()
    assert copy.load_state_bytes(primary.state_bytes(1)) == 1
    assert copy.completed == 1 and copy.initialized
    assert (
        copy.optimizer.state_dict()["state"].keys()
        == primary.optimizer.state_dict()["state"].keys()
    )
    assert_same_state(copy, primary, 1)


def test_sums_for_another_iteration_or_a_malformed_blob_are_refused() -> None:
    primary = shard()
    primary.initialize(contribution(primary, "init", 0, [torch.zeros(m.shape) for m in METAS], 0))
    replica = shard()
    replica.load_state_bytes(primary.state_bytes(0))
    with pytest.raises(FailedPrecondition, match="holds no sums"):
        primary.pending_bytes(1, 0)
    primary.accumulate(
        contribution(primary, "a", 0, [torch.ones(m.shape) for m in METAS], 1), frozenset("a")
    )
    sums = primary.pending_bytes(1, 0)
    primary.commit(1, 0)
    replica.completed = 3  # a replica at another iteration must not take them
    with pytest.raises(FailedPrecondition, match="not 0"):
        replica.keep_pending(sums)
    with pytest.raises(InvalidField, match="chunk"):
        replica.keep_pending(b"not a safetensors blob")
    with pytest.raises(InvalidField, match="chunk"):
        replica.load_state_bytes(b"\x00" * 16)


def test_a_replica_clips_and_skips_with_the_global_norm_its_primary_committed_with() -> None:
    """The replica learns each commit's global gradient norm from the next sums (or, when it is
    promoted, from its new slice's last commit): clipped and skipped steps stay identical."""
    torch.manual_seed(1)
    config = OptimizerConfig(
        "SGD", '{"lr": 0.1, "momentum": 0.9}', clip_grad_norm=0.5, skip_nonfinite=True
    )
    layout, _ = pack_layout(METAS)
    primary, replica = ShardJob("job-1", 1, layout, config), ShardJob("job-1", 1, layout, config)
    primary.initialize(contribution(primary, "init", 0, [torch.randn(m.shape) for m in METAS], 0))
    replica.load_state_bytes(primary.state_bytes(0))
    norms = [40.0, 0.1, float("inf"), 7.0]  # clipped, not clipped, skipped, clipped
    for k, norm in enumerate(norms):
        grads = [torch.randn(m.shape) for m in METAS]
        primary.accumulate(contribution(primary, "a", k, grads, 4), frozenset("a"))
        replica.keep_pending(primary.pending_bytes(1, k))
        for name, p in primary.named_tensors().items():
            assert torch.equal(p, replica.named_tensors()[name]), (k, name)
        primary.commit(1, k, norm)
    replica.settle(len(norms), primary.last_grad_norm)
    assert_same_state(primary, replica, len(norms))


def test_a_replica_steps_at_the_commit_and_stays_bit_identical() -> None:
    """apply_replicated: the shard that keeps the replica steps it when its own slice of the
    same iteration is committed (not when the next sums come), with the commit's global norm;
    sums of another iteration or generation are left alone."""
    torch.manual_seed(1)
    primary = shard()
    primary.initialize(contribution(primary, "init", 0, [torch.randn(m.shape) for m in METAS], 0))
    replica = shard()
    replica.load_state_bytes(primary.state_bytes(0))
    for k in range(3):
        grads = [torch.randn(m.shape) for m in METAS]
        primary.accumulate(contribution(primary, "a", k, grads, 2), frozenset("a"))
        header, views = primary.pending_frames(1, k)
        assert replica.keep_pending(b"".join([header, *views])) == k
        assert not replica.apply_replicated(2, k, 0.0)  # another generation: not these sums
        assert not replica.apply_replicated(1, k + 1, 0.0)
        primary.commit(1, k, 0.25)
        assert replica.apply_replicated(1, k, 0.25)
        assert replica.completed == primary.completed == k + 1
        assert_same_state(primary, replica, k + 1)
        assert not replica.apply_replicated(1, k, 0.25)  # applied once
    replica.settle(3)  # nothing left to settle
    assert_same_state(primary, replica, 3)


def test_sums_that_do_not_fit_the_replica_are_refused_and_change_nothing() -> None:
    primary = shard()
    primary.initialize(contribution(primary, "init", 0, [torch.ones(m.shape) for m in METAS], 0))
    replica = shard()
    replica.load_state_bytes(primary.state_bytes(0))
    primary.accumulate(
        contribution(primary, "a", 0, [torch.full(m.shape, 2.0) for m in METAS], 1),
        frozenset("a"),
    )
    blob = primary.pending_bytes(1, 0)
    size = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + size])
    header["acc/w"]["dtype"] = "F64"
    forged = json.dumps(header).encode()
    forged += b" " * (-len(forged) % 8)
    with pytest.raises(InvalidField):
        replica.keep_pending(len(forged).to_bytes(8, "little") + forged + blob[8 + size :])
    with pytest.raises(InvalidField):
        replica.keep_pending(blob[:-4])  # truncated
    assert replica.pending is None and replica.completed == 0
    # The blob is a safetensors file: any safetensors reader gets the sums.
    sums = safetensors.torch.load(blob)
    assert torch.equal(sums["acc/w"], torch.full((15,), 2.0))


@pytest.mark.parametrize("chunk_bytes", [16, 1000, 1 << 20])
def test_replicate_messages_are_replicate_requests_and_decode_without_a_copy(
    chunk_bytes: int,
) -> None:
    from shoal.param_sync.servicer_peers import decode_replicate, replicate_messages
    from shoal.v1 import parameter_sync_service_pb2 as ps_pb2

    blob = bytes(range(256)) * 20
    parts = [
        blob[:7],
        memoryview(blob)[7:3000],
        torch.frombuffer(bytearray(blob[3000:]), dtype=torch.uint8).numpy(),
    ]
    prefix = ps_pb2.ReplicateRequest(
        job_id="job-1", shard_index=3, replica=True, kind=ps_pb2.REPLICATE_KIND_SUMS
    ).SerializeToString()
    messages = list(replicate_messages(prefix, parts, chunk_bytes))
    assert all(len(ps_pb2.ReplicateRequest.FromString(m).chunk) <= chunk_bytes for m in messages)
    joined = b""
    for data in messages:
        frame = decode_replicate(data)
        message, chunk = frame.header, frame.chunk
        assert isinstance(chunk, memoryview) and chunk.obj is data  # a view, not a copy
        assert (message.job_id, message.shard_index, message.replica) == ("job-1", 3, True)
        assert message.chunk == b""
        assert bytes(chunk) == ps_pb2.ReplicateRequest.FromString(data).chunk
        joined += chunk
    assert joined == blob
    # A message with the chunk before another field (valid protobuf) decodes too.
    other = b"\x2a\x03abc" + b"\x0a\x01j"
    frame = decode_replicate(other)
    assert (frame.header.job_id, frame.header.chunk, bytes(frame.chunk)) == ("j", b"", b"abc")
    assert bytes(decode_replicate(prefix).chunk) == b""  # no chunk at all
    assert list(replicate_messages(prefix, [b""], chunk_bytes)) == [prefix + b"\x2a\x00"]
