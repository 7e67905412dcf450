"""One synchronization round of a ResNet-18-sized gradient (11,689,512 float32 = 44.6 MiB in
ResNet-18's 62 parameter tensors, plus its BatchNorm buffers), shoal's parameter-sync shards
against ``torch.distributed.all_reduce`` with gloo, side by side in one run.

* **shoal**: S shard processes (``python -m shoal.param_sync``) and W learner processes using
  the real ``"grpc"`` backend. One round = every learner streams its gradient slices to every
  shard, the shards sum them weighted by sample counts, commit (two-phase), step SGD with
  momentum and stream the new parameters back. Timed from the first learner's start of
  ``sync()`` to the last learner's end (all on one host: one clock).
* **gloo**: W processes, ``all_reduce`` of one 11,689,512-float32 tensor, timed from the first
  start to the last end after a barrier. (It does not include an optimizer step.)

Also times the pieces of a round in this process (encoding, summing, the SGD step, raw gRPC
loopback streaming) to show what dominates.

    .venv/bin/python bench/bench_sync.py [--learners 2 4] [--shards 2] [--rounds 10]
        [--compare-lane]   # also shoal with --shm-lane off (learners and shards share this host)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROUNDS_WARMUP = 2


def resnet18_tensors() -> tuple[
    list[tuple[str, tuple[int, ...]]], list[tuple[str, tuple[int, ...], str]]
]:
    """ResNet-18's parameters (name, shape) and buffers (name, shape, dtype), torchvision's."""
    params: list[tuple[str, tuple[int, ...]]] = [("conv1.weight", (64, 3, 7, 7))]
    buffers: list[tuple[str, tuple[int, ...], str]] = []

    def bn(prefix: str, c: int) -> None:
        params.extend([(f"{prefix}.weight", (c,)), (f"{prefix}.bias", (c,))])
        buffers.extend(
            [
                (f"{prefix}.running_mean", (c,), "float32"),
                (f"{prefix}.running_var", (c,), "float32"),
                (f"{prefix}.num_batches_tracked", (), "int64"),
            ]
        )

    bn("bn1", 64)
    cin = 64
    for layer, cout in enumerate((64, 128, 256, 512), start=1):
        for block in range(2):
            p = f"layer{layer}.{block}"
            first_in = cin if block == 0 else cout
            params.append((f"{p}.conv1.weight", (cout, first_in, 3, 3)))
            bn(f"{p}.bn1", cout)
            params.append((f"{p}.conv2.weight", (cout, cout, 3, 3)))
            bn(f"{p}.bn2", cout)
            if block == 0 and cin != cout:
                params.append((f"{p}.downsample.0.weight", (cout, cin, 1, 1)))
                bn(f"{p}.downsample.1", cout)
        cin = cout
    params.extend([("fc.weight", (1000, 512)), ("fc.bias", (1000,))])
    return params, buffers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------------------------------
# shoal
# ------------------------------------------------------------------------------------------


def shoal_learner(
    rank: int, world: int, job: str, coordinator: str, rounds: int, out: Any, chunk_mb: float
) -> None:
    torch.set_num_threads(1)
    from shoal.learner.backend import (
        Contribution,
        OptimizerSpec,
        TensorSpec,
        TrainingPlan,
        TrainingSetup,
    )
    from shoal.learner.grpc_backend import GrpcBackend

    params_spec, buffers_spec = resnet18_tensors()
    g = torch.Generator().manual_seed(rank)
    params = [torch.randn(shape, generator=g) * 0.01 for _, shape in params_spec]
    grads = [torch.randn(shape, generator=g) * 0.01 for _, shape in params_spec]
    buffers = [torch.zeros(shape, dtype=getattr(torch, dtype)) for _, shape, dtype in buffers_spec]
    setup = TrainingSetup(
        plan=TrainingPlan(epochs=1, batch_size=world, num_samples=world * 100_000),
        optimizer=OptimizerSpec("SGD", {"lr": 0.01, "momentum": 0.9}),
        param_specs=tuple(
            TensorSpec.of(n, p) for (n, _), p in zip(params_spec, params, strict=False)
        ),
        buffer_specs=tuple(
            TensorSpec.of(n, b) for (n, _, _), b in zip(buffers_spec, buffers, strict=False)
        ),
        params=params,
        buffers=buffers,
    )
    backend = GrpcBackend(
        job_id=job,
        learner_id=f"learner-{rank}",
        coordinator=coordinator,
        chunk_bytes=int(chunk_mb * 1024 * 1024),
    )
    backend.initialize(setup)
    times = []
    done = 0
    while done < rounds + ROUNDS_WARMUP:
        a = backend.next_assignment()
        assert a is not None and not a.retire
        if a.pull_parameters:
            backend.pull_parameters()
        if a.world_size < world:  # not everyone is admitted yet: keep going
            contribution = Contribution(grads, 1, 1.0, buffers)
            backend.sync(a, contribution)
            continue
        contribution = Contribution(grads, 1, 1.0, buffers)
        start = time.time()
        backend.sync(a, contribution)
        times.append((a.step, start, time.time()))
        done += 1
    backend.close()
    out.put((rank, times[ROUNDS_WARMUP:]))


def start_shards(
    count: int, chunk_mb: float, extra: tuple[str, ...] = ()
) -> tuple[list[subprocess.Popen], list[str]]:
    procs, addresses = [], []
    for i in range(count):
        address = f"127.0.0.1:{free_port()}"
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "shoal.param_sync",
                    "--shard-index",
                    str(i),
                    "--listen",
                    address,
                    "--insecure-no-auth",
                    "--chunk-mb",
                    str(chunk_mb),
                    "--storage-uri",
                    Path("/tmp/shoal-bench-storage").as_uri(),
                    *extra,
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1", "SHOAL_LOG_LEVEL": "WARNING"},
            )
        )
        addresses.append(address)
    for p in procs:
        assert p.stdout is not None
        for line in p.stdout:
            if line.startswith("LISTENING"):
                break
    return procs, addresses


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_shoal(
    world: int,
    shards: int,
    rounds: int,
    chunk_mb: float,
    extra: tuple[str, ...] = (),
    cpu: list[float] | None = None,
) -> list[float]:
    """Median-ready round times; with ``cpu``, appends the shard processes' CPU seconds per
    round (all rounds, warm-up included: from the job's opening to the learners' end)."""
    import grpc

    from shoal.v1 import (
        job_pb2,
        parameter_sync_service_pb2 as ps_pb2,
        parameter_sync_service_pb2_grpc as ps_grpc,
    )

    procs, addresses = start_shards(shards, chunk_mb, extra)
    job = f"bench-{world}-{shards}-{time.time_ns()}"
    try:
        with grpc.insecure_channel(addresses[0]) as channel:
            ps_grpc.ParameterSyncServiceStub(channel).OpenJob(
                ps_pb2.OpenJobRequest(
                    job_id=job,
                    spec=job_pb2.JobSpec(batch_size=world, epochs=1),
                    shard_addresses=addresses,
                )
            )
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        learners = [
            ctx.Process(
                target=shoal_learner,
                args=(r, world, job, addresses[0], rounds, out, chunk_mb),
            )
            for r in range(world)
        ]
        cpu_start = sum(process_cpu_seconds(p.pid) for p in procs)
        for p in learners:
            p.start()
        results = [out.get(timeout=600) for _ in learners]
        if cpu is not None:
            used = sum(process_cpu_seconds(p.pid) for p in procs) - cpu_start
            cpu.append(used / (rounds + ROUNDS_WARMUP))
        for p in learners:
            p.join(timeout=60)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    by_step: dict[int, list[tuple[float, float]]] = {}
    for _, times in results:
        for step, start, end in times:
            by_step.setdefault(step, []).append((start, end))
    return [
        max(e for _, e in v) - min(s for s, _ in v)
        for _, v in sorted(by_step.items())
        if len(v) == world
    ]


# ------------------------------------------------------------------------------------------
# gloo
# ------------------------------------------------------------------------------------------


def gloo_worker(rank: int, world: int, port: int, rounds: int, out: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    numel = sum(int(np.prod(s)) for _, s in resnet18_tensors()[0])
    tensor = torch.randn(numel)
    times = []
    for i in range(rounds + ROUNDS_WARMUP):
        dist.barrier()
        start = time.time()
        dist.all_reduce(tensor)
        times.append((i, start, time.time()))
    dist.destroy_process_group()
    out.put((rank, times[ROUNDS_WARMUP:]))


def bench_gloo(world: int, rounds: int) -> list[float]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=gloo_worker, args=(r, world, port, rounds, out)) for r in range(world)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    by_round: dict[int, list[tuple[float, float]]] = {}
    for _, times in results:
        for i, start, end in times:
            by_round.setdefault(i, []).append((start, end))
    return [max(e for _, e in v) - min(s for s, _ in v) for _, v in sorted(by_round.items())]


# ------------------------------------------------------------------------------------------
# the pieces
# ------------------------------------------------------------------------------------------


def bench_pieces(chunk_mb: float) -> dict[str, float]:
    """Milliseconds of each piece of a round for the whole 44.6 MiB, in this process."""
    from shoal.contract.wire import (
        BundleReceiver,
        TensorMeta,
        byte_view,
        decode_frame,
        encode_chunks,
        pack_layout,
    )
    from shoal.v1 import parameter_sync_service_pb2 as ps_pb2

    torch.set_num_threads(1)
    params_spec, _ = resnet18_tensors()
    tensors = [torch.randn(s) for _, s in params_spec]
    metas, total = pack_layout(
        [TensorMeta.of(n, t) for (n, _), t in zip(params_spec, tensors, strict=False)]
    )
    chunk = int(chunk_mb * 1024 * 1024)
    out: dict[str, float] = {}

    def timed(name: str, fn: Any, repeat: int = 5) -> Any:
        best, result = float("inf"), None
        for _ in range(repeat):
            t0 = time.perf_counter()
            result = fn()
            best = min(best, time.perf_counter() - t0)
        out[name] = best * 1e3
        return result

    views = [byte_view(t) for t in tensors]
    chunks = timed(
        "encode (copy into chunk messages)", lambda: list(encode_chunks(metas, views, total, chunk))
    )
    frames = timed(
        "decode (zero-copy views)",
        lambda: [decode_frame(ps_pb2.SyncStepRequest, c) for c in chunks],
    )
    payloads = [bytes(f.chunk) for f in frames]
    timed(
        "protobuf runtime, given the payload bytes: construct + serialize",
        lambda: [ps_pb2.SyncStepRequest(chunk=p).SerializeToString() for p in payloads],
    )
    timed(
        "protobuf runtime: parse + read the field",
        lambda: [ps_pb2.SyncStepRequest.FromString(c).chunk for c in chunks],
    )
    acc = [np.zeros(t.numel(), np.float32) for t in tensors]
    scratch = np.empty(chunk // 4 + 16, np.float32)

    def add(i: int, off: int, seg: memoryview) -> None:
        src = np.frombuffer(seg, np.float32)
        tmp = scratch[: src.size]
        np.multiply(src, 3, out=tmp)
        dst = acc[i][off // 4 : off // 4 + src.size]
        np.add(dst, tmp, out=dst)

    def weighted_sum() -> None:
        receiver = BundleReceiver(metas, total, add)
        for f in frames:
            receiver.feed(f.chunk)

    timed("weighted sum of one contribution (n*g into the accumulator)", weighted_sum)
    params = [t.clone().requires_grad_() for t in tensors]
    for p, t in zip(params, tensors, strict=False):
        p.grad = t
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    opt.step()
    timed("SGD momentum step (11.69M parameters)", opt.step)
    out["grpc loopback stream, one way"] = asyncio.run(_grpc_loopback(chunks)) * 1e3
    return out


async def _grpc_loopback(chunks: list[bytes]) -> float:
    import grpc
    from grpc import aio

    ident = lambda b: b  # noqa: E731

    async def sink(request_iterator: Any, context: Any) -> bytes:
        async for _ in request_iterator:
            pass
        return b""

    server = aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    handler = grpc.method_handlers_generic_handler(
        "bench.Sink",
        {
            "Put": grpc.stream_unary_rpc_method_handler(
                sink, request_deserializer=ident, response_serializer=ident
            )
        },
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with aio.insecure_channel(
        f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 64 << 20)]
    ) as channel:
        put = channel.stream_unary(
            "/bench.Sink/Put", request_serializer=ident, response_deserializer=ident
        )
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            await put(iter(chunks))
            best = min(best, time.perf_counter() - t0)
    await server.stop(0)
    return best


# ------------------------------------------------------------------------------------------


def summarize(values: list[float]) -> dict[str, float]:
    ms = sorted(v * 1e3 for v in values)
    return {"median_ms": statistics.median(ms), "min_ms": ms[0], "max_ms": ms[-1], "n": len(ms)}


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--learners", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--chunk-mb", type=float, default=1.0)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument(
        "--compare-lane",
        action="store_true",
        help="also run shoal with the shards' --shm-lane off (gRPC streams), side by side",
    )
    args = parser.parse_args()
    params, _ = resnet18_tensors()
    numel = sum(int(np.prod(s)) for _, s in params)
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores; torch {torch.__version__}")
    print(f"gradient: {numel:,} float32 in {len(params)} tensors = {numel * 4 / 2**20:.1f} MiB")
    results: dict[str, Any] = {"cpu": cpu_model(), "cores": os.cpu_count(), "numel": numel}
    for world in args.learners:
        gloo = summarize(bench_gloo(world, args.rounds))
        shoal = summarize(bench_shoal(world, args.shards, args.rounds, args.chunk_mb))
        ratio = shoal["median_ms"] / gloo["median_ms"]
        results[f"W={world}"] = {"gloo": gloo, "shoal": shoal, "ratio": ratio}
        if args.compare_lane:
            off = ("--shm-lane", "off")
            grpc_only = summarize(bench_shoal(world, args.shards, args.rounds, args.chunk_mb, off))
            results[f"W={world}"]["shoal_grpc"] = grpc_only
            print(
                f"W={world}: shoal over gRPC streams (--shm-lane off) "
                f"{grpc_only['median_ms']:.0f} ms (min {grpc_only['min_ms']:.0f}); "
                f"{grpc_only['median_ms'] / gloo['median_ms']:.2f}x gloo",
                flush=True,
            )
        print(
            f"W={world}: gloo all_reduce {gloo['median_ms']:.0f} ms "
            f"(min {gloo['min_ms']:.0f}); shoal S={args.shards} round {shoal['median_ms']:.0f} ms "
            f"(min {shoal['min_ms']:.0f}); shoal/gloo {ratio:.2f}x",
            flush=True,
        )
    pieces = bench_pieces(args.chunk_mb)
    results["pieces_ms"] = pieces
    print("pieces of a round, whole 44.6 MiB, one core:")
    for name, ms in pieces.items():
        print(f"  {name}: {ms:.1f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
