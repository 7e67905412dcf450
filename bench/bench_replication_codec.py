"""CPU cost of one replication hop's encoding and decoding, without the network: a shard's
summed slice of bench_sync.py's ResNet-18-sized gradient (half of 44.6 MiB, as with 2 shards)
turned into Replicate messages by the primary and back into the backup's accumulators, the
way it was done before (a safetensors blob, ``bytes()`` chunks in protobuf messages, the
protobuf runtime's parse, ``b"".join``, ``safetensors.torch.load``, ``copy_``) and now
(``ShardJob.pending_frames``, ``replicate_messages``, ``decode_replicate``, ``keep_pending``).
Single-threaded; median of ``--repeats`` process-CPU times.

    .venv/bin/python bench/bench_replication_codec.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import safetensors.torch
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sync import cpu_model, resnet18_tensors

from shoal.contract.wire import TensorMeta, pack_layout
from shoal.param_sync.coordinator import OptimizerConfig
from shoal.param_sync.servicer_peers import decode_replicate, replicate_messages
from shoal.param_sync.shard import Contribution, ShardJob
from shoal.v1 import parameter_sync_service_pb2 as ps_pb2

CHUNK = 1 << 20


def slice_job() -> ShardJob:
    tensors = [
        TensorMeta(n, "float32", tuple(s), 0, 4 * int(torch.Size(s).numel()))
        for n, s in resnet18_tensors()[0]
    ]
    half = tensors[::2]
    layout, _ = pack_layout(half)
    sj = ShardJob("bench", 0, layout, OptimizerConfig("SGD", '{"lr": 0.1, "momentum": 0.9}'))
    metas, total = pack_layout(list(sj.metas))
    data = bytes(total)
    init = Contribution(
        "init", 1, 0, 0, 0.0, 0.0, list(enumerate(metas)), total, [memoryview(data)]
    )
    sj.initialize(init)
    grads = Contribution("a", 1, 0, 1, 0.0, 0.0, list(enumerate(metas)), total, [memoryview(data)])
    sj.accumulate(grads, frozenset("a"))
    return sj


def old_hop(primary: ShardJob, backup: ShardJob) -> None:
    blob = primary.pending_bytes(1, 0)
    view = memoryview(blob)
    wire = [
        ps_pb2.ReplicateRequest(
            job_id="bench",
            replica=True,
            kind=ps_pb2.REPLICATE_KIND_SUMS,
            chunk=bytes(view[s : s + CHUNK]),
        ).SerializeToString()
        for s in range(0, len(blob), CHUNK)
    ]
    joined = b"".join(ps_pb2.ReplicateRequest.FromString(m).chunk for m in wire)
    for name, value in safetensors.torch.load(joined).items():
        backup.acc[backup.index[name.removeprefix("acc/")]].copy_(value)


def new_hop(primary: ShardJob, backup: ShardJob) -> None:
    header, views = primary.pending_frames(1, 0)
    prefix = ps_pb2.ReplicateRequest(
        job_id="bench", replica=True, kind=ps_pb2.REPLICATE_KIND_SUMS
    ).SerializeToString()
    wire = list(replicate_messages(prefix, [header, *views], CHUNK))
    joined = b"".join(decode_replicate(m).chunk for m in wire)
    backup.pending = None
    backup.keep_pending(joined)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    primary, backup = slice_job(), slice_job()
    print(f"machine: {cpu_model()}; slice of {primary.total_bytes / 2**20:.1f} MiB")
    for name, hop in (("before", old_hop), ("now", new_hop)):
        times = []
        for _ in range(args.repeats):
            start = time.process_time()
            hop(primary, backup)
            times.append(time.process_time() - start)
        print(f"{name}: {statistics.median(times) * 1000:.1f} ms CPU per hop")
    return 0


if __name__ == "__main__":
    sys.exit(main())
