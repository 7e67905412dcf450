"""The ``"local"`` sync backend: standalone mode, a world of one with the real
``torch.optim`` optimizer stepping in-process.

It exercises the learner exactly as on the cluster (gradients out, parameters in) and writes
checkpoints, epoch reports and the final model when given a storage URI. Importing it
registers it as ``"local"``; ``backend.py`` imports it, so importing ``shoal.learner.backend``
is enough. Split out of ``backend.py``, which re-exports :class:`LocalBackend`.
"""

from __future__ import annotations

import json
import math
from typing import Any

import fsspec
import safetensors.torch
import torch

from shoal.learner.checkpoint_io import (
    LoadedCheckpoint,
    join_path,
    load_latest_checkpoint,
    save_checkpoint,
)
from shoal.learner.env import LOCAL_BACKEND, LearnerEnv
from shoal.learner.gradients import apply_gradient_policy, has_gradient_policy
from shoal.learner.interface import SyncBackend, register_backend
from shoal.learner.sync_types import (
    Assignment,
    Contribution,
    EpochReport,
    InitialState,
    ModelState,
    SyncResult,
    TrainingPlan,
    TrainingSetup,
    set_learning_rate,
)

# --------------------------------------------------------------------------------------------
# The local backend
# --------------------------------------------------------------------------------------------


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when it is a leaf tensor the optimizer may step in place, else a copy."""
    if t.is_leaf and t._base is None:
        return t
    return t.detach().clone()


class LocalBackend(SyncBackend):
    """Standalone mode: a world of one, the optimizer stepping in this process.

    Its optimizer steps the model's own tensors (those ``initialize`` gets), as a plain
    PyTorch loop does: the learner still hands gradients out and takes parameters in exactly
    as on the cluster, but the parameters it takes back are its own, so there is nothing to
    load (``SyncResult.in_place``). Tensors that are not leaves of their own (a view, a non-leaf)
    are copied once, as master copies. The trainer hands it the model's parameters themselves,
    so the gradients backward leaves on them are the optimizer's as they are (a gradient that
    is not the stepped tensor's own is lent for the step and taken back); the learning rate
    is set on the optimizer's groups only when it changes.
    With ``storage_uri`` it writes checkpoints (every ``checkpoint_every`` epochs and at the
    end), the epoch reports (``metrics/epochs.json``) and the final model
    (``final/model.safetensors``), and when ``resume`` is true :meth:`initialize` continues
    from the latest checkpoint there.
    """

    def __init__(self, *, storage_uri: str | None = None, resume: bool = True) -> None:
        self._storage_uri = storage_uri
        self._resume = resume
        self._setup: TrainingSetup | None = None
        self._plan: TrainingPlan | None = None
        self._params: list[torch.Tensor] = []
        self._buffers: list[torch.Tensor] = []
        self._optimizer: torch.optim.Optimizer | None = None
        self._in_place = False
        self._total_steps = 0
        self._policy = False
        #: The rate last set on the optimizer's groups (None: the optimizer's own).
        self._lr: float | None = None
        self._step = 0
        self._reports: list[dict[str, Any]] = []

    @classmethod
    def from_env(cls, env: LearnerEnv) -> LocalBackend:
        return cls(storage_uri=env.storage_uri)

    @property
    def step(self) -> int:
        """Iterations completed so far."""
        return self._step

    def initialize(self, setup: TrainingSetup) -> InitialState:
        if self._setup is not None:
            raise RuntimeError("initialize() was already called on this backend")
        self._setup = setup
        self._plan = setup.plan
        self._total_steps = setup.plan.total_steps
        self._policy = has_gradient_policy(setup)  # (else none to apply, every iteration)
        self._params = [_own(p).requires_grad_(p.requires_grad) for p in setup.params]
        self._buffers = [_own(b) for b in setup.buffers]
        # Every tensor the model's own (_own copied none): sync hands back nothing to load.
        self._in_place = all(
            a is b
            for a, b in zip(
                [*self._params, *self._buffers], [*setup.params, *setup.buffers], strict=True
            )
        )
        self._optimizer = setup.optimizer.create(self._params, [s.name for s in setup.param_specs])
        if self._storage_uri is not None and self._resume:
            checkpoint = load_latest_checkpoint(self._storage_uri)
            if checkpoint is not None:
                self._restore(checkpoint)
        return InitialState(self._plan, self._params, self._buffers, self._step)

    def _restore(self, checkpoint: LoadedCheckpoint) -> None:
        assert self._setup is not None and self._optimizer is not None
        plan = self._setup.plan
        old = checkpoint.plan
        for name in ("num_samples", "batch_size", "seed"):
            if getattr(old, name) != getattr(plan, name):
                raise ValueError(
                    f"{name} ({getattr(plan, name)}) differs from the checkpoint's "
                    f"({getattr(old, name)}) in {self._storage_uri}"
                )
        if (
            checkpoint.param_specs != self._setup.param_specs
            or checkpoint.buffer_specs != self._setup.buffer_specs
        ):
            raise ValueError(f"model does not match the checkpoint in {self._storage_uri}")
        with torch.no_grad():
            for dst, src in zip(self._params, checkpoint.params, strict=True):
                dst.copy_(src)
            for dst, src in zip(self._buffers, checkpoint.buffers, strict=True):
                dst.copy_(src)
        self._optimizer.load_state_dict(checkpoint.optimizer_state)
        self._lr = None  # (the groups' rates are the checkpoint's now)
        self._step = checkpoint.completed
        fs, root = fsspec.core.url_to_fs(self._storage_uri)
        reports = join_path(root, "metrics", "epochs.json")
        if fs.exists(reports):
            with fs.open(reports, "r") as f:
                self._reports = [r for r in json.load(f) if r["step"] < self._step]

    def next_assignment(self) -> Assignment | None:
        plan = self._plan
        if plan is None:
            raise RuntimeError("initialize() must be called first")
        if self._step >= self._total_steps:
            return None
        return plan.assignment(self._step)

    def sync(
        self, assignment: Assignment, contribution: Contribution, *, lr: float | None = None
    ) -> SyncResult:
        optimizer, setup, params = self._optimizer, self._setup, self._params
        if optimizer is None or setup is None:
            raise RuntimeError("initialize() must be called first")
        if assignment.step != self._step or assignment.world_size != 1:
            raise RuntimeError(
                f"assignment (step {assignment.step}, world {assignment.world_size}) does not "
                f"match the local backend (step {self._step}, world 1)"
            )
        grads = contribution.grads
        if len(grads) != len(params):
            raise ValueError(f"contribution has {len(grads)} gradients, expected {len(params)}")
        if lr is not None and lr != self._lr:  # (a schedule's rate changes once an epoch, or
            set_learning_rate(optimizer, lr)  # a few times a job: set only then)
            self._lr = lr
        grad_norm, skipped = apply_gradient_policy(grads, setup) if self._policy else (None, False)
        # Gradients that are already the stepped tensors' own ``.grad`` (the trainer's: its
        # model's parameters are the tensors stepped here, as in a plain loop) are used as they
        # are; any other is lent to the optimizer for the step and taken back after it.
        lent = False
        for p, g in zip(params, grads, strict=True):
            if p.grad is not g:
                p.grad = g
                lent = True
        if not skipped:
            optimizer.step()
        if lent:
            for p in params:
                p.grad = None
        if self._buffers:
            with torch.no_grad():
                for dst, src in zip(self._buffers, contribution.buffers, strict=True):
                    if dst is not src:
                        dst.copy_(src)
        n = contribution.n_samples
        loss = contribution.loss_sum / n if n else math.nan
        step = self._step
        self._step += 1
        if self._storage_uri is not None and self._require_plan().is_checkpoint_step(step):
            self._checkpoint(self._step)
        return SyncResult(
            self._params, self._buffers, step, loss, grad_norm, skipped, in_place=self._in_place
        )

    def _checkpoint(self, completed: int) -> None:
        setup, plan, optimizer = self._setup, self._plan, self._optimizer
        assert setup is not None and plan is not None and optimizer is not None
        assert self._storage_uri is not None
        save_checkpoint(
            self._storage_uri,
            completed=completed,
            plan=plan,
            optimizer_spec=setup.optimizer,
            param_specs=setup.param_specs,
            buffer_specs=setup.buffer_specs,
            params=self._params,
            buffers=self._buffers,
            optimizer=optimizer,
        )
        if completed == plan.total_steps:
            fs, root = fsspec.core.url_to_fs(self._storage_uri)
            fs.makedirs(join_path(root, "final"), exist_ok=True)
            tensors = {
                s.name: t.detach().cpu().contiguous()
                for s, t in zip(
                    (*setup.param_specs, *setup.buffer_specs),
                    (*self._params, *self._buffers),
                    strict=True,
                )
            }
            with fs.open(join_path(root, "final", "model.safetensors"), "wb") as f:
                f.write(safetensors.torch.save(tensors))

    def pull_parameters(self) -> ModelState:
        self._require_plan()
        return ModelState(self._params, self._buffers)

    def report_epoch(self, report: EpochReport) -> None:
        self._reports.append(
            {
                "epoch": report.epoch,
                "step": report.step,
                "loss": report.loss,
                "metrics": dict(report.metrics),
                "num_samples": report.num_samples,
            }
        )
        if self._storage_uri is not None:
            fs, root = fsspec.core.url_to_fs(self._storage_uri)
            fs.makedirs(join_path(root, "metrics"), exist_ok=True)
            with fs.open(join_path(root, "metrics", "epochs.json"), "w") as f:
                json.dump(self._reports, f, indent=1)

    def _require_plan(self) -> TrainingPlan:
        if self._plan is None:
            raise RuntimeError("initialize() must be called first")
        return self._plan


register_backend(LOCAL_BACKEND, LocalBackend.from_env)
