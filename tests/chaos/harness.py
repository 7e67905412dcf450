"""The chaos harness: a real local cluster (every service a real process, optionally three
etcd members), real learners training, faults by signal, and the checks every scenario makes.

``ChaosCluster`` wraps :class:`shoal.cluster.local.LocalCluster` with what the scenarios need:

* ``leader(kind)``: the replica of ``resource-manager`` / ``job-scheduler`` that leads now
  (the one that answers a leader-only call; a standby refuses with a leader hint);
* ``sigterm_and_restart(name)``, ``kill(name, sig)``, ``freeze(name)`` / ``thaw(name)``;
* ``snapshot()``: each host's liveness and incarnation (a host declared lost and back has a new
  incarnation, so an unchanged incarnation proves it was never declared lost);
* ``time_to(predicate)``: seconds until a condition holds (the time to recover);
* ``assert_iterations_exact(job_id)``: the job's iteration record is contiguous from 0, each
  iteration exactly once;
* ``evictions(job_id, since)``: allocation events after ``since`` that took learners away.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.client import Client, ShoalClientError
from shoal.cluster.local import ClusterSpec, LocalCluster
from shoal.v1 import job_pb2

ROOT = Path(__file__).resolve().parents[2]
TINY_MODEL = ROOT / "tests" / "e2e" / "tiny_model"
TERMINAL = {job_pb2.JOB_STATE_COMPLETED, job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_CANCELLED}


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, period: float = 0.1) -> Any:
    """Poll ``predicate`` until it returns something truthy (returned); fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except (ShoalClientError, OSError) as exc:
            last_exc = exc
            value = None
        if value:
            return value
        time.sleep(period)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last error: {last_exc})")


def job_spec(name: str, artifact: str, *, max_workers: int, epochs: int = 2000, **kw: Any):
    """A tiny regression job: 7 iterations an epoch, cheap iterations, many epochs (the
    scenarios cancel it or let it run)."""
    return job_pb2.JobSpec(
        name=name,
        entry_point="train.py",
        artifact_id=artifact,
        batch_size=64,
        epochs=epochs,
        min_workers=1,
        max_workers=max_workers,
        priority=kw.pop("priority", 5000),
        sync_mode=kw.pop("sync_mode", job_pb2.SYNC_MODE_PARAMETER_SERVER),
        checkpoint_every=kw.pop("checkpoint_every", 50),
        **kw,
    )


@dataclass
class ChaosCluster:
    cluster: LocalCluster
    client: Client
    frozen: set[str] = field(default_factory=set)

    @classmethod
    def start(cls, state_dir: Path, **spec: Any) -> ChaosCluster:
        defaults: dict[str, Any] = dict(
            hosts=2,
            gpus_per_host=2,
            shards=1,
            replicas=2,
            heartbeat_interval_s=0.3,
            host_lost_after_s=3.0,
            election_ttl_s=2.0,
            etcd_members=3,
            # 10x load is shed above this (the services' unary calls in flight)
            extra_env={"SHOAL_MAX_CONCURRENT_CALLS": "16"},
        )
        defaults.update(spec)
        cluster = LocalCluster(ClusterSpec(state_dir=state_dir, **defaults))
        cluster.start(timeout=180)
        return cls(cluster, Client(cluster.client_config(), timeout=10, retries=8))

    def close(self) -> None:
        for name in list(self.frozen):
            self.thaw(name)
        self.client.close()
        self.cluster.stop()

    # -- processes ---------------------------------------------------------------------------

    def names(self, kind: str) -> list[str]:
        return [n for n, s in self.cluster.services.items() if s.kind == kind]

    def leader(self, kind: str, timeout: float = 60.0) -> str:
        """The name of the replica of ``kind`` that leads now."""

        def probe() -> str | None:
            for name in self.names(kind):
                svc = self.cluster.services[name]
                if not svc.alive() or name in self.frozen:
                    continue
                config = self.cluster.client_config()
                if kind == "resource-manager":
                    config = _only(config, resource_manager=(svc.address,))
                else:
                    config = _only(config, scheduler=(svc.address,))
                with Client(config, timeout=3, retries=0) as one:
                    try:
                        if kind == "resource-manager":
                            one.list_hosts()  # the leader's memory: a standby refuses
                        else:
                            # Standbys serve reads; a write is leader-only: cancelling a job
                            # that does not exist is NOT_FOUND on the leader, and changes
                            # nothing.
                            one.cancel_job("job-000000000000")
                    except ShoalClientError as exc:
                        if exc.code != "NOT_FOUND":
                            continue
                    return name
            return None

        return wait_for(probe, timeout, f"a {kind} leader")

    def standby(self, kind: str) -> str:
        leader = self.leader(kind)
        return next(n for n in self.names(kind) if n != leader)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        self.cluster.kill(name, sig)

    def freeze(self, name: str) -> None:
        os.kill(self.cluster.services[name].pid, signal.SIGSTOP)  # type: ignore[arg-type]
        self.frozen.add(name)

    def thaw(self, name: str) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.cluster.services[name].pid, signal.SIGCONT)  # type: ignore[arg-type]
        self.frozen.discard(name)

    def sigterm(self, name: str, timeout: float = 60.0) -> None:
        """SIGTERM and wait for the exit (graceful shutdown, as an operator restarts)."""
        svc = self.cluster.services[name]
        assert svc.proc is not None
        svc.proc.send_signal(signal.SIGTERM)
        try:
            svc.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} did not exit within {timeout} s of SIGTERM") from None

    def start_again(self, name: str, env: dict[str, str] | None = None) -> None:
        """Start the process again (after it exited), with ``env`` added to its environment."""
        saved = dict(os.environ)
        os.environ.update(env or {})
        try:
            self.cluster.restart(name, timeout=120)
        finally:
            os.environ.clear()
            os.environ.update(saved)

    # -- observations --------------------------------------------------------------------------

    def snapshot(self) -> dict[str, tuple[int, int]]:
        """host id -> (HostState value, incarnation), lost hosts included."""
        return {
            h.host_id: (int(h.state), int(h.incarnation))
            for h in self.client.list_hosts(include_lost=True)
        }

    def iterations_done(self, job_id: str) -> int:
        return len(self.client.get_metrics(job_id).iterations)

    def assert_iterations_exact(self, job_id: str) -> int:
        """Every recorded iteration once, contiguous from 0; returns how many."""
        job = self.client.get_job(job_id)
        per_epoch = job.progress.iterations_per_epoch
        metrics = self.client.get_metrics(job_id).iterations
        seen = [m.epoch * per_epoch + m.iteration for m in metrics]
        assert len(seen) == len(set(seen)), f"{job_id}: an iteration was recorded twice"
        assert sorted(seen) == list(range(len(seen))), f"{job_id}: an iteration is missing"
        return len(seen)

    def evictions(self, job_id: str, since: float) -> list[job_pb2.AllocationEvent]:
        """Allocation events after ``since`` (epoch seconds) that took learners away."""
        events = self.client.allocation_history(job_id)
        out = []
        previous = None
        for event in events:
            if previous is not None and event.time.ToNanoseconds() / 1e9 >= since:
                if event.workers < previous.workers:
                    out.append(event)
            previous = event
        return out

    def wait_training(self, job_id: str, more: int, timeout: float = 180.0) -> None:
        """Wait until the job has done ``more`` iterations beyond what it has now."""
        start = self.iterations_done(job_id)
        wait_for(
            lambda: self.iterations_done(job_id) >= start + more,
            timeout,
            f"{job_id} to run {more} more iterations",
            period=0.3,
        )

    def wait_workers(self, job_id: str, workers: int, timeout: float = 180.0) -> None:
        wait_for(
            lambda: self.client.get_job(job_id).allocated_workers >= workers,
            timeout,
            f"{job_id} to run on {workers} learners",
            period=0.3,
        )

    def log_text(self, name: str) -> str:
        return self.cluster.services[name].log.read_text(errors="replace")

    def count_in_logs(self, kind: str, text: str) -> int:
        return sum(self.log_text(n).count(text) for n in self.names(kind))


def _only(config: Any, **fields: Any) -> Any:
    import dataclasses

    return dataclasses.replace(config, **fields)


FAKETIME_LIB = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1"


def faketime_env(offset_file: Path) -> dict[str, str]:
    """The environment of a process whose clock (wall and monotonic) is moved by the offset
    written in ``offset_file`` ("+3600" jumps it an hour ahead), re-read on every call."""
    offset_file.write_text("+0\n")
    return {
        "LD_PRELOAD": FAKETIME_LIB,
        "FAKETIME_TIMESTAMP_FILE": str(offset_file),
        "FAKETIME_NO_CACHE": "1",
    }


def leads(chaos: ChaosCluster, kind: str, not_name: str = "") -> Callable[[], bool]:
    """A check that a replica of ``kind`` other than ``not_name`` leads and answers."""

    def check() -> bool:
        try:
            return chaos.leader(kind, timeout=0.5) != not_name
        except AssertionError:  # nobody leads yet
            return False

    return check


def time_to(predicate: Callable[[], Any], timeout: float, what: str) -> float:
    """Seconds until ``predicate`` holds (the time to recover)."""
    start = time.monotonic()
    wait_for(predicate, timeout, what, period=0.05)
    return time.monotonic() - start


def learner_pids(job_id: str) -> dict[str, int]:
    """learner id -> pid of the job's learner processes running on this machine (found by the
    SHOAL_JOB_ID / SHOAL_LEARNER_ID their host agent puts in their environment)."""
    found: dict[str, int] = {}
    job = f"SHOAL_JOB_ID={job_id}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            if job not in env or process_state(int(entry.name)) in ("Z", "X", ""):
                continue
        except OSError:
            continue
        for item in env:
            if item.startswith(b"SHOAL_LEARNER_ID="):
                learner = item.split(b"=", 1)[1].decode()
                # the learner's own process (the lowest pid; its children share the env)
                found[learner] = min(found.get(learner, 1 << 30), int(entry.name))
    return found


def process_state(pid: int) -> str:
    """The one-letter state of a process (R, S, T for stopped, Z, ...); "" if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[0]


def tiny_reference(epochs: int, batch: int = 64, seed: int = 0) -> dict[str, Any]:
    """Plain single-process PyTorch training of tests/e2e/tiny_model (the same model seed, data,
    data order per epoch, global batch and optimizer as the job): the state dict a COMPLETED
    job of that model must end with, whatever faults it went through."""
    import importlib.util

    import torch

    from shoal.learner import partition

    spec = importlib.util.spec_from_file_location("shoal_tiny_model", TINY_MODEL / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    train, _ = module.get_datasets()
    x, y = train.tensors
    n = len(y)
    torch.manual_seed(0)  # as the script does before building its model
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    mse = torch.nn.MSELoss()
    for epoch in range(epochs):
        order = partition.epoch_order(n, seed, epoch)
        for start in range(0, partition.iterations_per_epoch(n, batch) * batch, batch):
            idx = order[start : start + batch]
            optimizer.zero_grad()
            mse(model(x[idx]), y[idx]).backward()
            optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def model_difference(chaos: ChaosCluster, job_id: str, epochs: int, workdir: Path) -> float:
    """The largest absolute difference between the job's final model (downloaded) and its
    single-process reference; raises AssertionError if the tensors' names or shapes differ."""
    from safetensors.torch import load_file

    path = workdir / f"{job_id}.safetensors"
    chaos.client.download_model(job_id, path)
    model = load_file(str(path))
    reference = tiny_reference(epochs)
    assert set(model) == set(reference), f"{job_id}: tensors {sorted(model)} != {sorted(reference)}"
    worst = 0.0
    for name, value in reference.items():
        assert model[name].shape == value.shape, f"{job_id}: {name} has shape {model[name].shape}"
        worst = max(worst, float((model[name].float() - value.float()).abs().max()))
    return worst


def longest_pause(chaos: ChaosCluster, job_id: str, since: float) -> float:
    """The longest time (s) the job went without committing an iteration from ``since``
    (epoch seconds, the fault) to its latest iteration: how long the fault stopped training
    (0 if it did not slow it below its own pace)."""
    times = sorted(
        m.time.ToNanoseconds() / 1e9 for m in chaos.client.get_metrics(job_id).iterations
    )
    last_before = max((t for t in times if t < since), default=since)
    after = [t for t in times if t >= since]
    points = [last_before, *after]
    return max((b - a for a, b in itertools.pairwise(points)), default=0.0)
