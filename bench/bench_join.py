"""What a new learner costs before the user's code runs: cold (a new interpreter that imports
torch and the learner package) against warm (a warm learner process of the host agent,
shoal.host_agent.warm), alternating in one run on one machine.

Two real ProcessManagers of the host agent (the code StartLearner runs), one with
``warm_learners=1`` and one with 0, start the same learner script, in turns. The script is what
every learner does first: ``import torch``, ``from shoal.learner import ElasticTrainer``, build
a model (the digits MLP) and print the time. Measured: from ``ProcessManager.start`` being
called to that line (its time stamp in the learner's log, one clock), and, for the warm start,
whether a ready warm process was used. Before each warm sample the bench waits for the pool to
be ready again (a grow or replacement on a host whose pool refilled since its last start).

Anchor: a bare ``python -c "import torch"`` on the same machine, measured in the same run.

    .venv/bin/python bench/bench_join.py [--repeats 5] [--data-mb N]

A third sample per repeat, **warm, artifact unpacked ahead**: the same job's next learner on
the warm host, once the copy of its artifact the agent unpacks as soon as the job is placed
there is ready (shoal.host_agent.prepared): a grow or a replacement. ``--data-mb N`` adds N MiB
of random (incompressible) data to the artifact, a model directory with its data, so that the
unpack, which the copy made ahead takes off the start, weighs what it would.

``--device cuda`` (a GPU machine; the host agent's NVML discovery): the script also moves the
model to the learner's GPU and runs it there, so the time includes creating the CUDA context;
every sample checks that CUDA was not initialised before the script ran (a warm process that
touched CUDA at import would pin every GPU it saw, whatever ``CUDA_VISIBLE_DEVICES`` the learner
is given later), and one extra warm start on a simulated device (``CUDA_VISIBLE_DEVICES=""``)
checks that the learner's device pinning, set after the warm process imported torch, is obeyed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SCRIPT = """
import time
import torch
from torch import nn
from shoal.learner import ElasticTrainer  # noqa: F401
model = nn.Sequential(
    nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)
)
model(torch.zeros(1, 64))
print(f"user code ran {time.time():.6f}", flush=True)
"""

# The GPU variant: CUDA untouched until the script runs, then the learner's device only.
SCRIPT_CUDA = """
import os
import time
import torch
from torch import nn
from shoal.learner import ElasticTrainer  # noqa: F401
initialised = torch.cuda.is_initialized()
visible = os.environ.get("CUDA_VISIBLE_DEVICES")
if not torch.cuda.is_available():
    print(f"cuda unavailable initialised={initialised} visible={visible!r}", flush=True)
    raise SystemExit(0)
model = nn.Sequential(
    nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)
).cuda()
model(torch.zeros(1, 64, device="cuda"))
torch.cuda.synchronize()
print(f"cuda ok initialised={initialised} visible={visible!r} count={torch.cuda.device_count()}",
      flush=True)
print(f"user code ran {time.time():.6f}", flush=True)
"""


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


async def one(
    manager, devices, artifact: str, n: int, *, device_id: str = "gpu0", learner: str = ""
) -> tuple[float, bool]:
    from shoal.host_agent.processes import LaunchRequest, read_log

    t0 = time.time()
    learner = await manager.start(
        LaunchRequest(
            learner_id=learner or f"l{n}",
            job_id=f"j{n}",
            device_id=device_id,
            artifact_id=artifact,
            entry_point="main.py",
        ),
        devices,
    )
    await asyncio.wait_for(learner.exited.wait(), timeout=300)
    for record in read_log(learner.log_path, 0):
        if record.text.startswith("cuda "):
            print(f"    {'warm' if learner.warm_token else 'cold'} learner: {record.text}")
            if "initialised=True" in record.text:
                raise RuntimeError(f"CUDA was initialised before the script ran: {record.text}")
        if record.text.startswith("user code ran "):
            if learner.exit_code != 0:
                raise RuntimeError(f"learner failed: {learner.exit_reason}")
            return float(record.text.split()[-1]) - t0, bool(learner.warm_token)
    raise RuntimeError(f"the learner printed nothing: {learner.exit_reason}")


async def pool_ready(pool) -> None:
    """Wait (at most 300 s) until the warm pool has a process ready again."""
    deadline = time.monotonic() + 300
    while pool.ready() < 1 and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.1)  # a bench: the pool has no public ready event


async def pinning_obeyed(manager, artifact: str) -> None:
    """A warm learner on a simulated device (``CUDA_VISIBLE_DEVICES=""``) must see no GPU."""
    from shoal.host_agent.devices import SimulatedDevices
    from shoal.host_agent.processes import LaunchRequest, read_log

    learner = await manager.start(
        LaunchRequest(
            learner_id="pin",
            job_id="jpin",
            device_id="gpu0",
            artifact_id=artifact,
            entry_point="main.py",
        ),
        SimulatedDevices("h1", 1).discover(),
    )
    await asyncio.wait_for(learner.exited.wait(), timeout=300)
    lines = [r.text for r in read_log(learner.log_path, 0)]
    print(f"  pinning check ({'warm' if learner.warm_token else 'cold'}): {lines}")
    if not learner.warm_token or not any(t.startswith("cuda unavailable") for t in lines):
        raise RuntimeError(f"a warm learner given no GPU saw one (or was not warm): {lines}")


async def prepared_ready(manager, job_id: str, artifact: str) -> None:
    """Wait (at most 300 s) until the job's copy unpacked ahead is ready."""
    deadline = time.monotonic() + 300
    while not manager.prepared.ready(job_id, artifact) and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)  # a bench: the copy has no public ready event


async def main_async(repeats: int, device: str, data_mb: int) -> None:
    from shoal.host_agent.artifacts import ArtifactCache, DirectorySource
    from shoal.host_agent.devices import NvmlDevices, SimulatedDevices
    from shoal.host_agent.processes import ProcessManager
    from tests.integration._shoal_processes import pack_artifact

    with tempfile.TemporaryDirectory(prefix="shoal-join-") as tmp:
        root = Path(tmp)
        script = SCRIPT_CUDA if device == "cuda" else SCRIPT
        files: dict[str, str | bytes] = {"main.py": script}
        if data_mb:  # the model directory's data (incompressible: the unpack's worst case)
            files["data.bin"] = os.urandom(data_mb * 1024 * 1024)
        artifact = pack_artifact(root / "artifacts", files)
        devices = (NvmlDevices() if device == "cuda" else SimulatedDevices("h1", 1)).discover()
        if not devices:
            raise SystemExit(f"no {device} device found")
        gpu0 = devices[0].device_id
        managers = {}
        for kind, warm in (("cold", 0), ("warm", 1)):
            managers[kind] = ProcessManager(
                root / kind,
                ArtifactCache(root / kind / "cache", [DirectorySource(str(root / "artifacts"))]),
                host_id="h1",
                warm_learners=warm,
            )
            managers[kind].warm.start()
        results: dict[str, list[float]] = {
            "cold": [],
            "warm": [],
            "warm, artifact unpacked ahead": [],
            "import torch": [],
        }
        try:
            for r in range(repeats):
                await pool_ready(managers["warm"].warm)
                for kind in ("warm", "cold"):
                    seconds, was_warm = await one(
                        managers[kind], devices, artifact, r, device_id=gpu0
                    )
                    if was_warm != (kind == "warm"):
                        raise RuntimeError(f"repeat {r}: the {kind} sample started otherwise")
                    results[kind].append(seconds)
                    if kind == "warm":
                        # The same job's next learner on this host: a grow or a replacement.
                        await pool_ready(managers["warm"].warm)
                        await prepared_ready(managers["warm"], f"j{r}", artifact)
                        seconds, was_warm = await one(
                            managers["warm"], devices, artifact, r, device_id=gpu0, learner=f"l{r}b"
                        )
                        ahead = managers["warm"].get(f"l{r}b").unpacked_ahead
                        if not (was_warm and ahead):
                            raise RuntimeError(
                                f"repeat {r}: warm={was_warm} unpacked ahead={ahead}"
                            )
                        results["warm, artifact unpacked ahead"].append(seconds)
                t = time.monotonic()
                await asyncio.to_thread(
                    subprocess.run, [sys.executable, "-c", "import torch"], check=True
                )
                results["import torch"].append(time.monotonic() - t)
                print(
                    f"  [{r}] warm {results['warm'][-1]:.3f} s, unpacked ahead "
                    f"{results['warm, artifact unpacked ahead'][-1]:.3f} s, "
                    f"cold {results['cold'][-1]:.3f} s, "
                    f"bare import torch {results['import torch'][-1]:.3f} s "
                    f"(load {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
            if device == "cuda":
                await pool_ready(managers["warm"].warm)
                await pinning_obeyed(managers["warm"], artifact)
        finally:
            for manager in managers.values():
                await manager.stop_all(1.0)
                await manager.warm.close()
                await manager.prepared.close()
    print()
    print("| start | median (s) | min (s) | max (s) | samples |")
    print("|---|---|---|---|---|")
    for kind, values in results.items():
        print(
            f"| {kind} | {statistics.median(values):.3f} | {min(values):.3f} | "
            f"{max(values):.3f} | {len(values)} |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--data-mb", type=int, default=0, help="random data added to the artifact (MiB)"
    )
    args = parser.parse_args()
    print(
        f"machine: {cpu_model()}, {os.cpu_count()} cores, load average "
        f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}",
        flush=True,
    )
    print(f"artifact data: {args.data_mb} MiB", flush=True)
    asyncio.run(main_async(args.repeats, args.device, args.data_mb))
    print(f"\nload average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
