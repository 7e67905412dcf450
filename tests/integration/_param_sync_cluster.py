"""Real data-plane processes for the integration tests: parameter-sync shard processes
(``python -m shoal.param_sync``), learner processes (``_sync_learner.py``), the scheduler's
calls (with the service token), and the single-process reference training they are compared
with."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
import safetensors.torch
import torch

from shoal.runtime.auth import LearnerTokenSigner, public_key_pem
from shoal.v1 import (
    job_pb2,
    parameter_sync_service_pb2 as ps_pb2,
    parameter_sync_service_pb2_grpc as ps_grpc,
)
from tests.support import free_port, make_tokens, wait_until

HERE = Path(__file__).resolve().parent
LEARNER = HERE / "_sync_learner.py"
REPO = HERE.parents[1]


class Proc:
    """A child process whose output goes to a log file."""

    def __init__(self, args: Sequence[str], log: Path, env: dict[str, str]) -> None:
        self.log = log
        self._out = open(log, "w")
        self.popen = subprocess.Popen(
            list(args), stdout=self._out, stderr=subprocess.STDOUT, env=env, cwd=REPO
        )

    def text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def wait_for(self, needle: str, timeout: float = 30) -> None:
        def seen() -> bool:
            if self.popen.poll() is not None and needle not in self.text():
                raise AssertionError(
                    f"{self.log.name} exited ({self.popen.returncode}):\n" + self.text()[-3000:]
                )
            return needle in self.text()

        wait_until(seen, timeout=timeout, interval=0.05, what=f"{needle!r} in {self.log.name}")

    def wait(self, timeout: float = 120) -> int:
        try:
            code = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.log.name} still running:\n{self.text()[-3000:]}") from None
        self._out.close()
        return code

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(timeout=10)
        self._out.close()


def release(procs: Sequence[Proc], gate: Path, timeout: float = 90) -> None:
    """Let learners started with ``gate`` go together, once each is warm (said READY: all is
    imported and built, joining is all that is left)."""
    for proc in procs:
        proc.wait_for("READY", timeout=timeout)
    gate.touch()


def child_env(**extra: str) -> dict[str, str]:
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "SHOAL_LOG_LEVEL": "INFO",
    }
    env.update(extra)
    return env


class DataPlane:
    """S shard processes, learner processes, and a scheduler's client of them."""

    def __init__(self, tmp: Path, tokens_file: Path, tokens: dict[str, str], shards: int = 2):
        self.tmp = tmp
        self.tokens_file = tokens_file
        self.tokens = tokens
        self.num_shards = shards
        self.storage = tmp / "storage"
        self.storage_uri = self.storage.as_uri()
        self.shards: list[Proc] = []
        self.addresses: list[str] = []
        self.learners: list[Proc] = []
        self._shard_extra_args: tuple[str, ...] = ()
        self._channel: grpc.Channel | None = None
        self._generation = 0
        # The scheduler's part: learners get credentials minted for them, which the shards
        # verify with the public key (--learner-public-keys).
        self.signer = LearnerTokenSigner.generate()
        self.learner_keys = tmp / "learner-keys.pem"
        self.learner_keys.write_text(public_key_pem(self.signer.public_key_raw))

    # -- shards -------------------------------------------------------------------------------

    def start_shards(
        self, extra_args: Sequence[str] = (), env: dict[int, dict[str, str]] | None = None
    ) -> list[str]:
        """Start the shards (``env``: extra environment by shard index, e.g. a test fault,
        ``shoal.contract.faults``)."""
        self._generation += 1
        self.addresses = [f"127.0.0.1:{free_port()}" for _ in range(self.num_shards)]
        self.shards = []
        self._shard_extra_args = tuple(extra_args)
        for i, address in enumerate(self.addresses):
            log = self.tmp / f"shard-{i}-{self._generation}.log"
            extra = (env or {}).get(i, {})
            self.shards.append(Proc(self._shard_args(i, address), log, child_env(**extra)))
        for shard in self.shards:
            shard.wait_for("LISTENING", timeout=120)  # 2 busy cores: imports take long
        if self._channel is not None:
            self._channel.close()
        self._channel = grpc.insecure_channel(self.addresses[0])
        return self.addresses

    def _shard_args(self, i: int, address: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "shoal.param_sync",
            "--shard-index",
            str(i),
            "--listen",
            address,
            "--storage-uri",
            self.storage_uri,
            "--tokens-file",
            str(self.tokens_file),
            "--service-token",
            self.tokens["service"],
            "--learner-public-keys",
            str(self.learner_keys),
            *self._shard_extra_args,
        ]

    def restart_shard(self, i: int) -> Proc:
        """Start shard ``i`` again on its address (after :meth:`Proc.kill`): a fresh process
        that holds nothing."""
        self._generation += 1
        log = self.tmp / f"shard-{i}-{self._generation}.log"
        proc = Proc(self._shard_args(i, self.addresses[i]), log, child_env())
        self.shards[i] = proc
        proc.wait_for("LISTENING", timeout=60)
        return proc

    def kill_all(self) -> None:
        for p in [*self.learners, *self.shards]:
            p.kill()
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    # -- the scheduler's calls ----------------------------------------------------------------

    @property
    def stub(self) -> ps_grpc.ParameterSyncServiceStub:
        assert self._channel is not None
        return ps_grpc.ParameterSyncServiceStub(self._channel)

    def call(self, method: str, request: Any, role: str = "service") -> Any:
        metadata = (("authorization", f"Bearer {self.tokens[role]}"),)
        return getattr(self.stub, method)(request, metadata=metadata, timeout=30)

    def open_job(
        self, job_id: str, *, batch: int, epochs: int, seed: int = 0, checkpoint_every: int = 0
    ) -> ps_pb2.OpenJobResponse:
        spec = job_pb2.JobSpec(
            batch_size=batch, epochs=epochs, seed=seed, checkpoint_every=checkpoint_every
        )
        return self.call(
            "OpenJob",
            ps_pb2.OpenJobRequest(
                job_id=job_id,
                spec=spec,
                storage_uri=self.storage_uri,
                shard_addresses=self.addresses,
            ),
        )

    def take_over(
        self,
        job_id: str,
        successor: int,
        *,
        lost: int,
        epoch: int,
        batch: int,
        epochs: int,
        seed: int = 0,
        checkpoint_every: int = 0,
        sync_mode: int = job_pb2.SYNC_MODE_UNSPECIFIED,
    ) -> ps_pb2.TakeOverJobResponse:
        """The scheduler's part of a coordinator failover: make shard ``successor`` the job's
        coordinator (epoch ``epoch``) in place of the lost shard ``lost``; the scheduler's
        calls go to it from now on."""
        spec = job_pb2.JobSpec(
            batch_size=batch, epochs=epochs, seed=seed, checkpoint_every=checkpoint_every
        )
        if self._channel is not None:
            self._channel.close()
        self._channel = grpc.insecure_channel(self.addresses[successor])
        return self.call(
            "TakeOverJob",
            ps_pb2.TakeOverJobRequest(
                job_id=job_id,
                spec=spec,
                storage_uri=self.storage_uri,
                shard_addresses=self.addresses,
                lost_shard_index=lost,
                coordinator_epoch=epoch,
                sync_mode=sync_mode,  # type: ignore[arg-type]
            ),
        )

    def progress(self, job_id: str) -> ps_pb2.GetJobProgressResponse:
        return self.call("GetJobProgress", ps_pb2.GetJobProgressRequest(job_id=job_id))

    def retire(self, job_id: str, *learners: str) -> None:
        self.call(
            "RetireLearners", ps_pb2.RetireLearnersRequest(job_id=job_id, learner_ids=learners)
        )

    def evict(self, job_id: str, learner: str) -> int:
        reply = self.call(
            "EvictLearner",
            ps_pb2.EvictLearnerRequest(job_id=job_id, learner_id=learner, reason="killed"),
        )
        return int(reply.aborted_iteration)

    # -- learners -----------------------------------------------------------------------------

    def start_learner(
        self,
        job_id: str,
        learner_id: str,
        *,
        epochs: int,
        batch: int,
        backend: str = "grpc",
        env: dict[str, str] | None = None,
        **hooks: Any,
    ) -> Proc:
        args = [
            sys.executable,
            str(LEARNER),
            "--epochs",
            str(epochs),
            "--batch-size",
            str(batch),
            "--history",
            str(self.history_path(learner_id)),
            "--backend",
            backend,
        ]
        for name, value in hooks.items():
            args += [f"--{name.replace('_', '-')}", str(value)]
        child = child_env(
            SHOAL_JOB_ID=job_id,
            SHOAL_LEARNER_ID=learner_id,
            SHOAL_SYNC_ENDPOINTS=",".join(self.addresses),
            SHOAL_COORDINATOR=self.addresses[0],
            SHOAL_TOKEN=self.signer.mint(job_id=job_id, learner_id=learner_id),
            SHOAL_SYNC_BACKEND=backend,
            **(env or {}),
        )
        proc = Proc(args, self.tmp / f"{learner_id}.log", child)
        self.learners.append(proc)
        return proc

    def history_path(self, learner_id: str) -> Path:
        return self.tmp / f"{learner_id}.history.json"

    def history(self, learner_id: str) -> dict[str, Any]:
        return json.loads(self.history_path(learner_id).read_text())

    # -- storage ------------------------------------------------------------------------------

    def job_dir(self, job_id: str) -> Path:
        return self.storage / "jobs" / job_id

    def iterations(self, job_id: str) -> list[dict[str, Any]]:
        path = self.job_dir(job_id) / "metrics" / "iterations.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def final_model(self, job_id: str) -> dict[str, torch.Tensor]:
        return safetensors.torch.load_file(self.job_dir(job_id) / "model.safetensors")


def running_plane(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[DataPlane]:
    """A data plane with its shard processes started in a fresh temporary directory ``name``,
    killed afterwards: the body of the test modules' ``plane`` fixtures."""
    tmp = tmp_path_factory.mktemp(name)
    tokens = make_tokens(tmp / "tokens")
    dp = DataPlane(tmp, tmp / "tokens", tokens)
    dp.start_shards()
    try:
        yield dp
    finally:
        dp.kill_all()


@functools.cache
def digits_data() -> tuple[torch.Tensor, torch.Tensor]:
    sys.path.insert(0, str(HERE))
    try:
        from _sync_learner import load_digits_example
    finally:
        sys.path.remove(str(HERE))
    digits = load_digits_example()
    train, _ = digits.get_datasets()
    return train.tensors[0], train.tensors[1]


@functools.cache
def reference_training(
    epochs: int,
    batch: int,
    lr: float = 0.05,
    momentum: float = 0.9,
    seed: int = 0,
    clip_grad_norm: float | None = None,
    amp: str | None = None,
    init_scale: float = 2.0**16,
    param_groups: bool = False,
) -> tuple[dict[str, torch.Tensor], tuple[float, ...]]:
    """Plain single-process PyTorch training of the digits MLP: the same seed (model and data
    order), the same global batch, a mean-reduced loss. Returns the final state dict and the
    loss of every iteration. With ``clip_grad_norm``/``amp`` it follows PyTorch's AMP recipe:
    autocast, GradScaler (float16), unscale_, clip_grad_norm_, scaler.step, scaler.update."""
    sys.path.insert(0, str(HERE))
    try:
        from _sync_learner import PARAM_GROUPS_WD, load_digits_example, param_groups as make_groups
    finally:
        sys.path.remove(str(HERE))
    digits = load_digits_example()
    x, y = digits_data()
    n = len(y)
    torch.manual_seed(seed)
    model = digits.build_model()
    kwargs = {"lr": lr, "momentum": momentum, **PARAM_GROUPS_WD[param_groups]}
    if param_groups:
        groups = make_groups(model)
        listed = {id(p) for g in groups for p in g["params"]}
        groups.append({"params": [p for p in model.parameters() if id(p) not in listed]})
        optimizer = torch.optim.SGD(groups, **kwargs)
    else:
        optimizer = torch.optim.SGD(model.parameters(), **kwargs)
    loss_fn = torch.nn.CrossEntropyLoss()
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(amp or "")
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, enabled=amp == "float16")
    losses = []
    for epoch in range(epochs):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
        for start in range(0, n, batch):
            idx = order[start : start + batch]
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = loss_fn(model(x[idx]), y[idx])
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            if clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            losses.append(float(loss.detach()))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, tuple(losses)


def assert_user_metrics(records: list[dict], first: int = 0) -> None:
    """What the learners' scripts logged with trainer.log (``--log-metrics 1``): loss_x2 from
    the loss function, weighted by micro-batch and learner samples, is twice the iteration's
    sample-weighted mean loss; prev_step, logged between steps, belongs to the next step."""
    for r in records:
        k = r["global_iteration"]
        values = r.get("values", {})
        assert values["loss_x2"] == pytest.approx(2 * r["loss"], rel=1e-6, abs=1e-9), k
        if k > first:
            assert values["prev_step"] == pytest.approx(k - 1), k
        # The learners' compute/sync split rides along (shoal's own names).
        assert values["shoal.compute_s"] > 0, k
    with_sync = [r for r in records if "shoal.sync_s" in r.get("values", {})]
    assert len(with_sync) >= len(records) // 2  # all but each generation's first iteration
    assert all(r["values"]["shoal.sync_s"] > 0 for r in with_sync)
