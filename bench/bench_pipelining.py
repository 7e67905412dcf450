"""The shard's pipelining (issue 16): what stepping a slice group by group and answering each
chunk once stepped saves, and what summing a contribution while its bytes still arrive would
save, on a ResNet-18-sized gradient (44.6 MiB float32, 62 parameter tensors).

* **accumulate**: the time ``ShardJob.accumulate`` takes for one learner's complete
  contribution (1 MiB chunks as received), for the slice one of S=2 shards holds (~22 MiB)
  and for the whole model: the first contribution of an iteration (written) and a later one
  (multiplied and added). This is the tail after a learner's last byte that summing as bytes
  arrive could hide (not built: a contribution is summed only once its stream is complete and
  checked).
* **commit**: ``ShardJob.commit`` of the same slices, SGD with momentum, whole
  (``--step-group-mb 0``) and grouped (4 MiB), on a compute thread while one reader on the
  event loop encodes the answer's chunks as they are stepped: when the first group is
  stepped (an answer's first chunks may leave), when the commit ends, and when the answer's
  last chunk is encoded.
* **rounds** (``--rounds N``, 0 skips): bench_sync.py's round, W learners, S shards, gRPC
  streams (``--shm-lane off``: the lane's answer is written whole), the shards started with
  ``--step-group-mb 0`` and ``4`` alternately, ``--trials`` times each.

    .venv/bin/python bench/bench_pipelining.py [--rounds 8] [--trials 2] [--learners 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sync import bench_shoal, cpu_model, resnet18_tensors, summarize

from shoal.contract.wire import (
    TensorMeta,
    byte_view,
    decode_frame,
    encode_chunks,
    pack_layout,
)
from shoal.param_sync.coordinator import OptimizerConfig
from shoal.param_sync.shard import Contribution, Encoded, ShardJob
from shoal.v1 import parameter_sync_service_pb2 as ps_pb2

MiB = 1024 * 1024
SGD = OptimizerConfig("SGD", json.dumps({"lr": 0.01, "momentum": 0.9}))


def slice_job(names: list[tuple[str, tuple[int, ...]]], group_bytes: int) -> ShardJob:
    metas = pack_layout([TensorMeta.of(n, torch.empty(s)) for n, s in names])[0]
    sj = ShardJob("bench", 0, metas, SGD, chunk_bytes=MiB, step_group_bytes=group_bytes)
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(s, generator=g) for _, s in names]
    sj.initialize(contribution(sj, 0, values, 0, "init"))
    return sj


def contribution(
    sj: ShardJob, k: int, values: list[torch.Tensor], n: int, who: str
) -> Contribution:
    layout, total = pack_layout(list(sj.metas))
    c = Contribution(who, 1, k, n, 0.0, 0.0, list(enumerate(layout)), total)
    chunks = encode_chunks(layout, [byte_view(v) for v in values], total, MiB)
    c.chunks = [decode_frame(ps_pb2.SyncStepRequest, m).chunk for m in chunks]
    return c


async def answered(sj: ShardJob, k: int, executor: ThreadPoolExecutor) -> tuple[float, ...]:
    """Commit iteration ``k`` on ``executor`` (the shard's compute thread) while one reader
    on this event loop encodes the answer's chunks as they become ready (as a SyncStep answer
    does): seconds from the commit's start to its first group stepped, to the commit's end,
    and to the last chunk encoded."""
    loop = asyncio.get_running_loop()
    got = asyncio.Event()
    box: list[Encoded] = []
    stamps: list[float] = []

    def publish(encoded: Encoded) -> None:
        encoded.bind(loop)
        box.append(encoded)
        loop.call_soon_threadsafe(got.set)

    sj.group_stepped = lambda number: stamps.append(time.perf_counter()) if number == 0 else None
    ends: list[float] = []

    def commit_and_stamp() -> Encoded | None:
        result = sj.commit(1, k, 0.0, publish)
        ends.append(time.perf_counter())
        return result

    t0 = time.perf_counter()
    commit = loop.run_in_executor(executor, commit_and_stamp)
    await got.wait()
    encoded = box[0]
    for i in range(encoded.count):
        await encoded.ready(i)
        encoded.chunk(i)
    t_last = time.perf_counter()
    await commit
    return stamps[0] - t0, ends[0] - t0, t_last - t0


def in_process(names: list[tuple[str, tuple[int, ...]]], repeat: int) -> dict[str, float]:
    out: dict[str, list[float]] = {}
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(s, generator=g) for _, s in names]
    jobs = {size: slice_job(names, size) for size in (0, 4 * MiB)}
    executor = ThreadPoolExecutor(max_workers=1)
    for k in range(repeat):
        for size, sj in jobs.items():
            members = frozenset({"a", "b"})
            first, second = (contribution(sj, k, grads, 3, w) for w in ("a", "b"))
            t0 = time.perf_counter()
            sj.accumulate(first, members)
            t1 = time.perf_counter()
            assert sj.accumulate(second, members)
            t2 = time.perf_counter()
            first_group, end, last_chunk = asyncio.run(answered(sj, k, executor))
            label = "grouped 4 MiB" if size else "whole"
            if size == 0:
                out.setdefault("accumulate, first contribution (written)", []).append(t1 - t0)
                out.setdefault("accumulate, later contribution (n*g added)", []).append(t2 - t1)
            out.setdefault(f"commit, {label}", []).append(end)
            out.setdefault(f"commit start -> first group stepped, {label}", []).append(first_group)
            out.setdefault(f"commit start -> answer's last chunk encoded, {label}", []).append(
                last_chunk
            )
    executor.shutdown()
    return {k: statistics.median(v) * 1e3 for k, v in out.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    params, _ = resnet18_tensors()
    numel = sum(int(np.prod(s)) for _, s in params)
    print(f"machine: {cpu_model()}; torch {torch.__version__}; gradient {numel * 4 / MiB:.1f} MiB")
    # The slice shard 0 of 2 holds: every other tensor by size would do; take a half by bytes.
    half, size = [], 0
    for name, shape in params:
        if size < numel * 2:
            half.append((name, shape))
            size += int(np.prod(shape)) * 4
    results: dict[str, Any] = {"cpu": cpu_model()}
    for label, names in (
        (f"slice {size / MiB:.1f} MiB", half),
        (f"whole {numel * 4 / MiB:.1f} MiB", params),
    ):
        pieces = in_process(names, args.repeat)
        results[label] = pieces
        print(f"{label}, median of {args.repeat} (one core):")
        for name, ms in pieces.items():
            print(f"  {name}: {ms:.1f} ms")
    if args.rounds > 0:
        runs: dict[str, list[float]] = {"whole": [], "grouped": []}
        for trial in range(args.trials):
            for mode, mb in (("whole", "0"), ("grouped", "4")):
                extra = ("--shm-lane", "off", "--step-group-mb", mb)
                times = bench_shoal(args.learners, args.shards, args.rounds, 1.0, extra)
                runs[mode].extend(times)
                print(
                    f"trial {trial}: W={args.learners} S={args.shards} gRPC round, {mode} "
                    f"(--step-group-mb {mb}): median {statistics.median(times) * 1e3:.0f} ms "
                    f"(rounds {' '.join(f'{t * 1e3:.0f}' for t in times)})",
                    flush=True,
                )
        for mode, times in runs.items():
            s = summarize(times)
            results[f"rounds {mode}"] = s
            print(f"{mode}: median {s['median_ms']:.0f} ms (min {s['min_ms']:.0f}) of {len(times)}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
