"""Collective mode against plain DistributedDataParallel, and the cost of a rescale.

* **Time per iteration**, side by side on the same model (an MLP on scikit-learn's digits,
  64 -> W -> W -> W -> 10, float32), the same global batch, world size and SGD with momentum:
  - **shoal collective**: one parameter-sync shard process (the coordinator, hosting the
    rendezvous store) and N learner processes running ``ElasticTrainer`` with the
    ``"collective"`` backend (gloo). Per iteration = the median gap between consecutive
    commits in the job's ``metrics/iterations.jsonl`` (boundary RPC included).
  - **DDP**: N processes, ``torch.nn.parallel.DistributedDataParallel`` over a gloo group,
    each on its share of the same global batch; per iteration = the median wall time of
    forward, backward (with DDP's bucketed all-reduce overlapping it) and ``step`` on rank 0.
* **Re-forming the group** in one running collective job: 2 learners, then 2 warm learners
  join (grow 2 -> 4), then 2 are retired (shrink 4 -> 2). Reported: the time the job paused
  (the gap between the last commit of the old generation and the first of the new one, minus
  one normal iteration) and the group formation itself as the learners timed it (tear down,
  rendezvous, state broadcast). torchrun restarts every worker instead; see RESULTS.

    .venv/bin/python bench/bench_collective.py [--world 2 4] [--width 1024] [--iters 60]
    python3 bench/bench_collective.py --device cuda --world 1 --no-rescale   # on GPUs: NCCL
    .venv/bin/python bench/bench_collective.py --world 1 --width 64 --no-rescale --parts
    .venv/bin/python bench/bench_collective.py --world 2 --width 64 --iters 2000 --no-rescale --cpu

``--parts`` also times shoal's iteration part by part inside the learners and the shard
(``collective_parts.py``: compute, reduce, the Boundary call, apply; the coordinator's
Boundary handler and its record write) and prints milliseconds per iteration
(``SHOAL_BENCH_PARTS_CPU=1``: the thread's CPU time instead of the wall time).

``--cpu`` prints the CPU time per iteration of every process of each run, its threads grouped
by name (``/proc/<pid>/task/*/stat``, 10 ms ticks, over the middle of the run: shoal's from
outside between two record counts, DDP's ranks from inside between two iterations). On a
machine with fewer cores than processes the sum over all of them bounds the iteration from
below: ``sum / cores``.

With ``--device cuda`` each learner (and each DDP rank) gets one GPU (``CUDA_VISIBLE_DEVICES``
= its rank; NCCL refuses two ranks on one device), shoal's group is NCCL, DDP runs over NCCL,
and the DDP time includes a ``torch.cuda.synchronize()``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

BATCH = 256
WARMUP = 5
ENV = {
    **os.environ,
    "PYTHONUNBUFFERED": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "SHOAL_LOG_LEVEL": "INFO",
}


SHARD_WITH_PARTS = (
    "import sys; sys.path.insert(0, {bench!r}); import collective_parts; "
    "collective_parts.install_shard(); from shoal.param_sync.main import main; sys.exit(main())"
)


def build_model(width: int, depth: int = 3) -> nn.Module:
    """64 -> width (x ``depth`` layers) -> 10."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(64, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    return x, y


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def thread_cpu(pid: int | str = "self") -> dict[str, float]:
    """CPU seconds (user + system) of the threads of process ``pid``, summed by thread name."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def cpu_per_iteration(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], iterations: int
) -> dict[str, float]:
    """``{"process/thread": ms per iteration}`` between two :func:`thread_cpu` snapshots per
    process (threads with none left out)."""
    out = {}
    for proc, threads in after.items():
        for name, seconds in threads.items():
            used = seconds - before.get(proc, {}).get(name, 0.0)
            if used > 0:
                out[f"{proc}/{name}"] = used * 1e3 / max(iterations, 1)
    return out


def print_cpu(label: str, per_iteration: dict[str, float], iteration_ms: float) -> None:
    total = sum(per_iteration.values())
    cores = os.cpu_count() or 1
    print(
        f"  CPU per iteration, {label}: {total:.2f} ms in all (/ {cores} cores = "
        f"{total / cores:.2f} ms; the iteration took {iteration_ms:.2f} ms)"
    )
    for key in sorted(per_iteration):
        print(f"    {key:<36} {per_iteration[key]:7.3f}")


# -- a shoal learner (a subprocess) ----------------------------------------------------------


def run_learner(args: argparse.Namespace) -> int:
    import logging

    from collective_parts import install_learner
    from torch.utils.data import TensorDataset

    from shoal.learner import ElasticTrainer

    install_learner()  # --parts only
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    x, y = digits()
    trainer = ElasticTrainer(
        build_model(args.width, args.depth),
        lambda: (TensorDataset(x, y), None),
        nn.CrossEntropyLoss(),
        ("SGD", {"lr": 0.05, "momentum": 0.9}),
        backend="collective",
        device=args.device,
    )
    if args.gate:
        print("READY", flush=True)
        while not Path(args.gate).exists():
            time.sleep(0.01)
    result = trainer.train(epochs=args.epochs, batch_size=BATCH)
    Path(args.history).write_text(
        json.dumps({"steps": [r.step for r in result.history], "retired": result.retired})
    )
    return 0


class Cluster:
    """One shard process (insecure, loopback) and the job's learners."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.address = f"127.0.0.1:{free_port()}"
        self.storage = tmp / "storage"
        self.log = open(tmp / "shard.log", "w")
        # --parts: the shard's Boundary timed (collective_parts.py), else plain.
        start = (
            ["-c", SHARD_WITH_PARTS.format(bench=str(Path(__file__).parent))]
            if ENV.get("SHOAL_BENCH_PARTS")
            else ["-m", "shoal.param_sync"]
        )
        self.shard = subprocess.Popen(
            [
                sys.executable,
                *start,
                "--listen",
                self.address,
                "--insecure-no-auth",
                "--storage-uri",
                self.storage.as_uri(),
            ],
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=ENV,
        )
        assert self.shard.stdout is not None
        for line in self.shard.stdout:
            if line.startswith("LISTENING"):
                break
        else:
            raise RuntimeError((tmp / "shard.log").read_text()[-2000:])
        self.learners: list[subprocess.Popen] = []

    def call(self, method: str, request: Any) -> Any:
        import grpc

        from shoal.v1 import parameter_sync_service_pb2_grpc as ps_grpc

        with grpc.insecure_channel(self.address) as channel:
            return getattr(ps_grpc.ParameterSyncServiceStub(channel), method)(request, timeout=30)

    def open_job(self, job: str, epochs: int) -> None:
        from shoal.v1 import job_pb2, parameter_sync_service_pb2 as ps_pb2

        self.call(
            "OpenJob",
            ps_pb2.OpenJobRequest(
                job_id=job,
                spec=job_pb2.JobSpec(batch_size=BATCH, epochs=epochs, seed=0),
                storage_uri=self.storage.as_uri(),
                shard_addresses=[self.address],
            ),
        )

    def learner(
        self,
        job: str,
        name: str,
        epochs: int,
        width: int,
        gate: Path | None = None,
        device: str = "cpu",
        gpu: int = 0,
        depth: int = 3,
        overlap: bool = True,
    ):
        args = [sys.executable, __file__, "--learner", "--epochs", str(epochs)]
        args += ["--width", str(width), "--depth", str(depth)]
        args += ["--history", str(self.tmp / f"{name}.json")]
        args += ["--device", device]
        if gate is not None:
            args += ["--gate", str(gate)]
        env = {
            **ENV,
            "SHOAL_JOB_ID": job,
            "SHOAL_LEARNER_ID": name,
            "SHOAL_COORDINATOR": self.address,
            "SHOAL_SYNC_ENDPOINTS": self.address,
            "SHOAL_SYNC_BACKEND": "collective",
            "SHOAL_COLLECTIVE_OVERLAP": "on" if overlap else "off",
        }
        if device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        out = open(self.tmp / f"{name}.log", "w")
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, text=True)
        self.learners.append(proc)
        return proc

    def records(self, job: str) -> list[dict[str, Any]]:
        path = self.storage / "jobs" / job / "metrics" / "iterations.jsonl"
        if not path.exists():
            return []
        lines = path.read_text().splitlines()
        return sorted((json.loads(x) for x in lines if x), key=lambda r: r["global_iteration"])

    def wait_records(self, job: str, count: int, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while len(self.records(job)) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{job}: fewer than {count} iterations after {timeout} s")
            time.sleep(0.05)

    def cpu_window(
        self, job: str, learners: list[subprocess.Popen], iters: int
    ) -> dict[str, float]:
        """CPU per iteration of the shard and the learners over the middle half of the run
        (from the 1/4th record on to the 3/4th)."""
        procs = {"shard": self.shard.pid, **{f"l{i}": p.pid for i, p in enumerate(learners)}}
        marks = (WARMUP + iters // 4, WARMUP + 3 * iters // 4)
        snapshots, counts = [], []
        for mark in marks:
            self.wait_records(job, mark)
            counts.append(len(self.records(job)))
            snapshots.append({name: thread_cpu(pid) for name, pid in procs.items()})
        return cpu_per_iteration(snapshots[0], snapshots[1], counts[1] - counts[0])

    def close(self) -> None:
        for p in [*self.learners, self.shard]:
            p.kill()
            p.wait()
        self.log.close()


def gaps(records: list[dict[str, Any]]) -> list[float]:
    return [b["time"] - a["time"] for a, b in itertools.pairwise(records)]


def bench_shoal(
    world: int,
    width: int,
    iters: int,
    device: str = "cpu",
    depth: int = 3,
    overlap: bool = True,
    cpu: bool = False,
) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        if "SHOAL_BENCH_PARTS" in ENV:  # --parts: timed in the processes of this run
            ENV["SHOAL_BENCH_PARTS"] = str(Path(tmp) / "parts")
        cluster = Cluster(Path(tmp))
        try:
            job, epochs = f"per-iter-{world}-{overlap}", -(-(iters + WARMUP) // 6)
            cluster.open_job(job, epochs)
            gate = Path(tmp) / "gate"
            procs = [
                cluster.learner(
                    job, f"l{i}", epochs, width, gate, device, gpu=i, depth=depth, overlap=overlap
                )
                for i in range(world)
            ]
            for i in range(world):
                log = Path(tmp) / f"l{i}.log"
                while "READY" not in log.read_text():
                    time.sleep(0.05)
            gate.touch()
            used = cluster.cpu_window(job, procs, iters) if cpu else None
            for p in procs:
                if p.wait(timeout=900) != 0:
                    raise RuntimeError((Path(tmp) / "l0.log").read_text()[-3000:])
            records = [r for r in cluster.records(job) if r["world_size"] == world]
            if "SHOAL_BENCH_PARTS" in ENV:
                print_parts(Path(ENV["SHOAL_BENCH_PARTS"]), world, overlap, len(records))
            median = statistics.median(gaps(records[WARMUP:]))
            if used is not None:
                label = f"shoal at world {world}, overlap {'on' if overlap else 'off'}"
                print_cpu(label, used, median * 1e3)
            return median
        finally:
            cluster.close()


def print_parts(prefix: Path, world: int, overlap: bool, iterations: int) -> None:
    from collective_parts import report

    print(
        f"  parts at world {world}, overlap {'on' if overlap else 'off'} ({iterations} "
        "iterations; ms per iteration, calls):"
    )
    for name, ms, calls in report(prefix):
        print(f"    {name:<40} {ms:7.3f}  {calls}")


# -- DDP --------------------------------------------------------------------------------------


def ddp_worker(
    rank: int,
    world: int,
    port: int,
    width: int,
    iters: int,
    out: Any,
    device: str = "cpu",
    depth: int = 3,
    cpu: Any = None,
) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    cuda = device == "cuda"
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
    )
    if cuda:
        torch.cuda.set_device(rank)
        model = nn.parallel.DistributedDataParallel(
            build_model(width, depth).cuda(), device_ids=[rank]
        )
    else:
        model = nn.parallel.DistributedDataParallel(build_model(width, depth))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    x, y = digits()
    if cuda:
        x, y = x.cuda(), y.cuda()
    n = len(y)
    times = []
    marks = {WARMUP + iters // 4: "before", WARMUP + 3 * iters // 4: "after"}
    used = {}
    for step in range(iters + WARMUP):
        if cpu is not None and step in marks:
            used[marks[step]] = {f"rank{rank}": thread_cpu()}
        start = (step * BATCH) % (n - BATCH)
        lo, hi = start + rank * BATCH // world, start + (rank + 1) * BATCH // world
        began = time.perf_counter()
        optimizer.zero_grad()
        loss_fn(model(x[lo:hi]), y[lo:hi]).backward()
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    if rank == 0:
        out.put(statistics.median(times[WARMUP:]))
    if cpu is not None:
        cpu.put(cpu_per_iteration(used["before"], used["after"], 3 * iters // 4 - iters // 4))
    dist.destroy_process_group()


def bench_ddp(
    world: int, width: int, iters: int, device: str = "cpu", depth: int = 3, cpu: bool = False
) -> float:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    used = ctx.Queue() if cpu else None
    port = free_port()
    procs = [
        ctx.Process(
            target=ddp_worker, args=(r, world, port, width, iters, out, device, depth, used)
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    value = out.get(timeout=600)
    if used is not None:
        per_iteration: dict[str, float] = {}
        for _ in procs:
            per_iteration.update(used.get(timeout=600))
        print_cpu(f"DDP at world {world}", per_iteration, value * 1e3)
    for p in procs:
        p.join(timeout=60)
    return float(value)


# -- re-forming ------------------------------------------------------------------------------


def bench_rescale(width: int) -> dict[str, Any]:
    from shoal.v1 import parameter_sync_service_pb2 as ps_pb2

    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(Path(tmp))
        try:
            job, epochs = "rescale", 20  # 6 iterations per epoch
            cluster.open_job(job, epochs)
            first = [cluster.learner(job, f"f{i}", epochs, width) for i in range(2)]
            gate = Path(tmp) / "later.gate"
            later = [cluster.learner(job, f"j{i}", epochs, width, gate) for i in range(2)]
            for i in range(2):
                log = Path(tmp) / f"j{i}.log"
                while "READY" not in log.read_text():  # warm: imports done, model built
                    time.sleep(0.05)
            cluster.wait_records(job, 20)
            gate.touch()  # grow 2 -> 4
            cluster.wait_records(job, 45)
            cluster.call(
                "RetireLearners", ps_pb2.RetireLearnersRequest(job_id=job, learner_ids=["j0", "j1"])
            )  # shrink 4 -> 2
            for p in [*first, *later]:
                if p.wait(timeout=900) != 0:
                    raise RuntimeError("a learner failed; see its log")
            records = cluster.records(job)
            formations = {}
            for name in ("f0", "f1", "j0", "j1"):
                text = (Path(tmp) / f"{name}.log").read_text()
                formations[name] = [
                    float(line.split(" formed in ")[1].split(" s")[0])
                    for line in text.splitlines()
                    if " formed in " in line
                ]
        finally:
            cluster.close()
    normal = statistics.median(gaps(records))
    out: dict[str, Any] = {"iteration_s": normal, "formations_s": formations}
    for a, b in itertools.pairwise(records):
        if a["world_size"] != b["world_size"]:
            kind = "grow" if b["world_size"] > a["world_size"] else "shrink"
            out[f"{kind}_pause_s"] = b["time"] - a["time"] - normal
    return out


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--learner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gate", help=argparse.SUPPRESS)
    parser.add_argument("--history", help=argparse.SUPPRESS)
    parser.add_argument("--epochs", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=3, help="hidden layers of the MLP")
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--overlap",
        choices=("on", "off", "both"),
        default="both",
        help="shoal's gradient buckets sent during backward (SHOAL_COLLECTIVE_OVERLAP)",
    )
    parser.add_argument("--no-rescale", action="store_true", help="skip the re-forming run")
    parser.add_argument(
        "--parts",
        action="store_true",
        help="time shoal's iteration part by part (collective_parts.py) and print the parts",
    )
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="print each process's CPU time per iteration (its threads by name), shoal and DDP",
    )
    args = parser.parse_args()
    if args.learner:
        return run_learner(args)
    if args.parts:
        ENV["SHOAL_BENCH_PARTS"] = ""
    params = sum(p.numel() for p in build_model(args.width, args.depth).parameters())
    where = cpu_model()
    if args.device == "cuda":
        where += f", {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    comm = "NCCL" if args.device == "cuda" else "gloo"
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.overlap]
    print(
        f"# {time.strftime('%Y-%m-%d')}, {where}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}; MLP 64-{args.width}x{args.depth}-10 ({params:,} params, "
        f"{params * 4 / 2**20:.1f} MiB), global batch {BATCH}"
    )
    names = {False: "shoal, overlap off", True: "shoal, overlap on"}
    head = " | ".join(f"{names[m]} (ms/iter)" for m in modes)
    print(f"| world | {head} | DDP {comm} (ms/iter) | shoal / DDP |")
    print("|---|" + "---|" * (len(modes) + 2))
    for world in args.world:
        shoal = [
            bench_shoal(world, args.width, args.iters, args.device, args.depth, m, args.cpu)
            for m in modes
        ]
        ddp = bench_ddp(world, args.width, args.iters, args.device, args.depth, args.cpu)
        cells = " | ".join(f"{t * 1e3:.1f}" for t in shoal)
        ratios = " / ".join(f"{t / ddp:.2f}" for t in shoal)
        print(f"| {world} | {cells} | {ddp * 1e3:.1f} | {ratios} |", flush=True)
    if args.no_rescale:
        return 0
    r = bench_rescale(args.width)
    print()
    print(f"normal iteration during the rescale run: {r['iteration_s'] * 1e3:.1f} ms")
    print(f"grow 2 -> 4: the job paused {r.get('grow_pause_s', float('nan')):.3f} s")
    print(f"shrink 4 -> 2: the job paused {r.get('shrink_pause_s', float('nan')):.3f} s")
    print(f"group formations as timed by the learners (s): {json.dumps(r['formations_s'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
