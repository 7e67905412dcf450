"""``ElasticTrainer``: a training loop written once, run standalone or elastically.

The user gives the model, a function that builds the datasets, a mean-reduced loss and the
optimizer by name; the trainer runs the iteration protocol of DESIGN.md against a
:class:`~shoal.learner.backend.SyncBackend` chosen from the environment (``local`` when run as
``python train.py``; the parameter-sync client on the cluster).

Each iteration the learner computes the mean gradient over its share of the global batch
(accumulating micro-batches when the share exceeds what the device holds), hands it with its
sample count, loss sum and buffers to the backend, and loads the parameters it gets back.

The loop is here; what it returns is in ``results.py``, the building blocks of an iteration
(batches, the gradient of a share, evaluation) in ``steps.py``, and mixed precision in
``precision.py``. This module re-exports their public names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeAlias

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from shoal.contract.batch_schedule import BatchRule, scaled_learning_rate
from shoal.contract.noise_scale import two_batch_estimate
from shoal.learner import partition
from shoal.learner.backend import (
    Assignment,
    EpochReport,
    IterationAborted,
    LocalBackend,
    OptimizerLike,
    OptimizerSpec,
    SyncBackend,
    TensorSpec,
    TrainingPlan,
    TrainingSetup,
    create_backend,
    global_grad_norm,
)
from shoal.learner.callbacks import Callback, CallbackList
from shoal.learner.early_forward import EarlyForward
from shoal.learner.env import LearnerEnv, train_marker
from shoal.learner.loader import BatchFetcher
from shoal.learner.metrics import MetricsFn, classification_metrics
from shoal.learner.precision import LossScaler, MixedPrecision
from shoal.learner.results import EpochResult, IterationRecord, TrainResult
from shoal.learner.schedules import resolve_schedule
from shoal.learner.steps import (
    LossFn,
    ModelTensors,
    compute_contribution,
    default_device,
    evaluate,
    fetch_batch,
    persistent_buffers,
    same_memory,
    with_param_groups,
)
from shoal.learner.tracing import LearnerTracing
from shoal.learner.user_metrics import MetricLog, means, with_noise_estimate, with_timings

__all__ = [
    "DatasetsFn",
    "ElasticTrainer",
    "EpochResult",
    "IterationRecord",
    "LRSchedule",
    "MixedPrecision",
    "TrainResult",
    "compute_contribution",
    "configure_default_logging",
    "evaluate",
    "fetch_batch",
    "persistent_buffers",
]

logger = logging.getLogger("shoal.learner")

#: ``() -> (train, test)``, or ``(dataset_uris) -> (train, test)``; ``test`` may be None (no
#: evaluation). Items are ``(input, target)``.
DatasetsFn: TypeAlias = Callable[..., tuple[Dataset[Any], Dataset[Any] | None]]
#: Learning rate of a global iteration (or of an epoch, with ``lr_schedule_unit="epoch"``).
LRSchedule: TypeAlias = Callable[[int], float]


_DEFAULT_HANDLER_NAME = "shoal-default-stderr"


def configure_default_logging() -> bool:
    """Send shoal's log records (INFO and up) to stderr when the script configured no logging
    (neither the root logger nor the ``shoal`` logger has a handler). Returns whether it did.
    A script that calls ``logging.basicConfig`` (or adds any handler) before ``train()`` keeps
    full control."""
    root, shoal = logging.getLogger(), logging.getLogger("shoal")
    if root.handlers or shoal.handlers:
        return False
    handler = logging.StreamHandler(sys.stderr)
    handler.name = _DEFAULT_HANDLER_NAME
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    shoal.addHandler(handler)
    if shoal.level == logging.NOTSET:
        shoal.setLevel(logging.INFO)
    return True


# --------------------------------------------------------------------------------------------
# The trainer
# --------------------------------------------------------------------------------------------


class ElasticTrainer:
    """Elastic data-parallel training of ``model``.

    Args:
        model: the ``nn.Module`` to train, built as for one machine (moved to ``device``).
        get_datasets: ``() -> (train, test)`` torch Datasets of ``(input, target)`` items;
            called in each learner process; ``test`` may be None. When it takes an argument
            it is called with the job's dataset URIs (``shoal submit --dataset``, else
            ``dataset_uris``), to read with ``shoal.learner.data``. A ``TensorDataset`` is
            batched fastest (one indexing operation per micro-batch).
        loss_fn: ``(outputs, targets) -> scalar`` mean over the batch, e.g.
            ``nn.CrossEntropyLoss()``.
        optimizer: re-creatable optimizer: ``("SGD", {"lr": 0.1, "momentum": 0.9})``,
            ``(torch.optim.AdamW, {"lr": 1e-3})``, ``"Adam"``, ``torch.optim.Adam``, an
            :class:`OptimizerSpec`, or ``("pkg.module:Class", {...})`` for another importable
            ``torch.optim.Optimizer`` subclass. Hyperparameters are plain values.
        metrics: evaluation hook ``(outputs, targets) -> {name: value}`` over the whole test
            set; default: accuracy for classification (arg-max of logits). None to disable.
        lr_schedule: ``step -> lr`` applied before every iteration's optimizer step, where
            ``step`` is the global iteration index (with ``lr_schedule_unit="epoch"``, the
            epoch index). It overrides the optimizer's ``lr`` and must be deterministic: every
            learner evaluates it. Or a schedule by name (``shoal.learner.schedules``):
            ``("warmup_cosine", {"warmup": 100})`` or ``("step", {"step_size": 30,
            "gamma": 0.1})``, given the optimizer's ``lr`` and the job's length.
        seed: data-order seed (SHOAL_SEED overrides it).
        backend: a :class:`SyncBackend`, a registered backend name, or None for the one the
            environment names (SHOAL_SYNC_BACKEND; ``local`` standalone). A backend passed as
            an object is not closed by the trainer.
        device: where to train (default: CUDA when available, else CPU).
        max_batch_per_device: most samples per forward/backward (SHOAL_MAX_BATCH_PER_DEVICE
            overrides it); None for no limit.
        eval_batch_size: batch size of evaluation (default: max_batch_per_device or 1024).
        on_epoch_end: called with each :class:`EpochResult` this learner evaluates.
        env: the environment contract (default: read from ``os.environ`` at ``train``).
        callbacks: :class:`~shoal.learner.Callback` instances, called in order on every
            learner (see ``shoal.learner.callbacks``).
        amp: mixed precision: ``"bfloat16"`` or ``"float16"`` (or the torch dtype, or a
            :class:`MixedPrecision` for the loss-scaling settings); None for full precision.
            Works in every sync mode.
        clip_grad_norm: clip the *global* gradient (the job's reduced gradient, not each
            learner's share) to this 2-norm, as ``torch.nn.utils.clip_grad_norm_`` before the
            optimizer step of a single process (in every sync mode).
        log_default: when the script configured no logging, send shoal's INFO records to
            stderr (see :func:`configure_default_logging`).
        num_workers: worker processes fetching each share's samples in parallel (for
            datasets whose ``__getitem__`` is slow; not used for a ``TensorDataset``); the
            samples each iteration sees do not change (``shoal.learner.loader``).
        param_groups: ``model -> [{"params": [...], "lr": ..., "weight_decay": ...}, ...]``,
            torch's parameter groups (parameters as tensors of ``model`` or as names); the
            parameters no group lists form a last group with the optimizer's defaults. A
            learning-rate schedule scales every group's rate by the same factor (each group
            keeps its ratio to the optimizer's ``lr``). Standalone and collective mode.
    """

    def __init__(
        self,
        model: nn.Module,
        get_datasets: DatasetsFn,
        loss_fn: LossFn,
        optimizer: OptimizerLike,
        *,
        metrics: MetricsFn | None = classification_metrics,
        lr_schedule: LRSchedule | str | tuple[str, Mapping[str, Any]] | None = None,
        lr_schedule_unit: Literal["iteration", "epoch"] = "iteration",
        seed: int = 0,
        backend: SyncBackend | str | None = None,
        device: torch.device | str | None = None,
        max_batch_per_device: int | None = None,
        eval_batch_size: int | None = None,
        on_epoch_end: Callable[[EpochResult], None] | None = None,
        env: LearnerEnv | None = None,
        callbacks: Sequence[Callback] = (),
        amp: MixedPrecision | str | torch.dtype | None = None,
        clip_grad_norm: float | None = None,
        log_default: bool = True,
        param_groups: Callable[[nn.Module], Sequence[Mapping[str, Any]]] | None = None,
        dataset_uris: Sequence[str] = (),
        num_workers: int = 0,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model ({type(model).__name__}) must be a torch.nn.Module")
        if not callable(get_datasets):
            raise ValueError(f"get_datasets ({get_datasets!r}) must be callable")
        if not callable(loss_fn):
            raise ValueError(f"loss_fn ({loss_fn!r}) must be callable")
        if lr_schedule_unit not in ("iteration", "epoch"):
            raise ValueError(
                f"lr_schedule_unit ({lr_schedule_unit!r}) must be 'iteration' or 'epoch'"
            )
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed ({seed!r}) must be an int >= 0")
        for name, value in (
            ("max_batch_per_device", max_batch_per_device),
            ("eval_batch_size", eval_batch_size),
        ):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} ({value!r}) must be None or an int >= 1")
        self.model = model
        self.get_datasets = get_datasets
        self.loss_fn = loss_fn
        self.optimizer_spec = OptimizerSpec.parse(optimizer)
        if param_groups is not None:
            self.optimizer_spec = with_param_groups(self.optimizer_spec, model, param_groups)
        self.metrics = metrics
        self.lr_schedule = lr_schedule
        if lr_schedule is not None and not callable(lr_schedule):
            resolve_schedule(lr_schedule, base_lr=self._base_lr(), total=1)  # validate now
        self._schedule: LRSchedule | None = None
        self.lr_schedule_unit = lr_schedule_unit
        self.seed = seed
        self.backend = backend
        self.device = torch.device(device) if device is not None else default_device()
        self.max_batch_per_device = max_batch_per_device
        self.eval_batch_size = eval_batch_size
        self.on_epoch_end = on_epoch_end
        self.env = env
        if isinstance(callbacks, Callback):
            callbacks = [callbacks]
        self.callbacks = CallbackList(callbacks)
        self.amp = MixedPrecision.parse(amp)
        if clip_grad_norm is not None and (
            isinstance(clip_grad_norm, bool)
            or not isinstance(clip_grad_norm, (int, float))
            or not math.isfinite(clip_grad_norm)
            or clip_grad_norm <= 0
        ):
            raise ValueError(
                f"clip_grad_norm ({clip_grad_norm!r}) must be None or a finite number > 0"
            )
        self.clip_grad_norm = None if clip_grad_norm is None else float(clip_grad_norm)
        self.log_default = log_default
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers ({num_workers!r}) must be an int >= 0")
        self.num_workers = num_workers
        if isinstance(dataset_uris, str):
            dataset_uris = [dataset_uris]
        self.dataset_uris = tuple(dataset_uris)
        self._assignment: Assignment | None = None
        self._batch_rule: BatchRule | None = None
        self._declared_batch = 0
        self._world_one = False
        self._metric_log = MetricLog()
        self._tensors = ModelTensors([], [])  # the model's, listed once per train()

    def log(self, values: Mapping[str, Any]) -> None:
        """Record the script's own metrics of the iteration, e.g.
        ``trainer.log({"accuracy": acc})``: from the loss function or the model's forward (a
        mean over the micro-batch, weighted by its samples), or from a callback between
        iterations (then it counts for the next iteration). The job's value per iteration is
        the sample-weighted mean over every learner (``shoal jobs metrics``, the dashboard);
        see :mod:`shoal.learner.user_metrics`. Raises ``ValueError`` for a bad name or a
        value that is not a finite number."""
        self._metric_log.log(values)

    @property
    def is_primary(self) -> bool:
        """Whether this learner is the job's primary: rank 0 of the iteration it runs (or last
        ran). Always true standalone; on the cluster false until the first assignment, and
        after ``train()`` true on exactly one learner of a completed job (rank 0 of the last
        iteration). Use it to write files or print once per job."""
        if self._world_one:
            return True
        return self._assignment is not None and self._assignment.rank == 0

    # -- the loop ------------------------------------------------------------------------------

    def train(
        self,
        epochs: int = 1,
        batch_size: int = 32,
        *,
        max_workers: int | None = None,
        checkpoint_every: int | None = None,
    ) -> TrainResult:
        """Train for ``epochs`` epochs of global batch ``batch_size`` (the job's SHOAL_EPOCHS,
        SHOAL_BATCH_SIZE and SHOAL_SEED win when set). ``max_workers`` caps the learners of
        the job on the cluster (ignored standalone); ``checkpoint_every`` is in epochs (the
        backend also checkpoints at the end when it has storage)."""
        if self.log_default:
            configure_default_logging()
        env = self.env if self.env is not None else LearnerEnv.from_environ()
        marker = train_marker()
        if marker:  # tells the host agent that the script did call train()
            with contextlib.suppress(OSError):
                Path(marker).touch()
        tracing = LearnerTracing.from_env(env)  # disabled without an OTLP endpoint
        train_set, test_set = self._datasets(env.dataset_uris or self.dataset_uris)
        num_samples = len(train_set)  # type: ignore[arg-type]
        if num_samples < 1:
            raise ValueError("the training dataset is empty")
        plan = TrainingPlan(
            epochs=env.epochs if env.epochs is not None else epochs,
            batch_size=env.batch_size if env.batch_size is not None else batch_size,
            num_samples=num_samples,
            seed=env.seed if env.seed is not None else self.seed,
            checkpoint_every=checkpoint_every,
            max_workers=max_workers,
        )
        max_per_device = (
            env.max_batch_per_device
            if env.max_batch_per_device is not None
            else self.max_batch_per_device
        )
        eval_batch_size = self.eval_batch_size or max_per_device or 1024

        model = self.model.to(self.device)
        model.train()
        named_params = list(model.named_parameters())
        named_buffers = persistent_buffers(model)
        self._tensors = tensors = ModelTensors(
            [p for _, p in named_params], [b for _, b in named_buffers]
        )
        setup = TrainingSetup(
            plan=plan,
            optimizer=self.optimizer_spec,
            param_specs=tuple(TensorSpec.of(n, p) for n, p in named_params),
            buffer_specs=tuple(TensorSpec.of(n, b) for n, b in named_buffers),
            params=[p.detach() for _, p in named_params],
            buffers=[b for _, b in named_buffers],
            clip_grad_norm=self.clip_grad_norm,
            skip_nonfinite=self.amp is not None and self.amp.scaling,
            # An adaptive batch measures its gradient noise scale from the global norm.
            measure_grad_norm=env.batch_rule is not None,
        )
        scaler = LossScaler(self.amp) if self.amp is not None and self.amp.scaling else None
        autocast_dtype = None if self.amp is None else self.amp.torch_dtype
        callbacks = self.callbacks
        callbacks.set_trainer(self)
        self._assignment = None

        # Forked before the backend opens connections (a TensorDataset needs no workers: it is
        # indexed in one operation).
        fetcher = (
            BatchFetcher(train_set, self.num_workers)
            if self.num_workers > 0 and not isinstance(train_set, TensorDataset)
            else None
        )
        owns_backend = not isinstance(self.backend, SyncBackend)
        backend = (
            self.backend
            if isinstance(self.backend, SyncBackend)
            else create_backend(self.backend, env)
        )
        self._world_one = isinstance(backend, LocalBackend)
        if self._world_one:
            # The local backend steps the model's parameters themselves, as a plain loop's
            # optimizer does: the gradients backward leaves on them need no handing over.
            setup = dataclasses.replace(setup, params=[p for _, p in named_params])
        # A backend without a coordinator keeps no reported metrics (SyncBackend.log_metrics):
        # nothing to build for it per iteration.
        keeps_metrics = type(backend).log_metrics is not SyncBackend.log_metrics
        # The local backend's assignments are the plan's own (TrainingPlan.assignment): there
        # is nothing to check in them (a coordinator's are checked against the plan).
        plans_own = type(backend).next_assignment is LocalBackend.next_assignment
        hooks = None
        # Parameter-server mode with SHOAL_PS_EARLY_FORWARD=on: the last sync's answer is
        # still arriving (early_forward.py); ``lost``: loading it failed (a shard died while
        # answering), the model is not whole until the next pull.
        early: EarlyForward | None = None
        lost = False

        def settle(hook: str | None = None) -> None:
            """Wait for the last answer and load all of it (before anything reads the
            model other than the next forward; before the callbacks' ``hook`` only when a
            callback overrides it)."""
            nonlocal lost
            if early is None or not early.unsettled:
                return
            if hook is not None and not callbacks.overrides(hook):
                return
            try:
                early.settle()
            except IterationAborted as exc:
                lost = True
                logger.warning(
                    "the answer of iteration %s failed while it was loaded; the parameters are "
                    "pulled at the next assignment: %s",
                    self._assignment.step if self._assignment is not None else "?",
                    exc,
                )

        try:
            tracing.begin_join()
            state = backend.initialize(setup)
            # Gradients sent as backward produces them (collective mode; None elsewhere).
            hooks = backend.overlap_hooks([p for _, p in named_params])
            if state.plan.num_samples != num_samples:
                raise ValueError(
                    f"num_samples ({num_samples}) of this learner's training set differs from "
                    f"the job's ({state.plan.num_samples})"
                )
            plan = state.plan
            self._schedule = self._resolve_schedule(plan)
            self._batch_rule = BatchRule(env.batch_rule) if env.batch_rule else None
            self._declared_batch = plan.batch_size
            if self._batch_rule is not None and self._schedule is None and self._base_lr() is None:
                raise ValueError(
                    f"the job has an adaptive batch (SHOAL_BATCH_RULE={env.batch_rule}) but the "
                    "optimizer has no numeric 'lr' and no lr_schedule: there is no learning "
                    "rate to scale with the batch"
                )
            # Collective mode: the next iteration may run while its vote's answer travels, when
            # nothing else reads the model or the result before the next sync.
            backend.vote_ahead(
                scaler is None
                and self._batch_rule is None
                and not callbacks.overrides("on_iteration_end")
            )
            have_state = state.params is not None and state.buffers is not None
            if state.params is not None and state.buffers is not None:
                self._load(state.params, state.buffers)
            synced_buffers = [b.detach().clone() for b in tensors.buffers]
            result = TrainResult(plan=plan, params={})
            logger.info(
                "training %d samples, %d epochs of batch %d (%d iterations each), from step %d",
                plan.num_samples,
                plan.epochs,
                plan.batch_size,
                plan.iterations_per_epoch,
                state.step,
            )
            callbacks.on_train_begin(plan, state.step)
            order_epoch, order = -1, torch.empty(0, dtype=torch.int64)
            begun_epoch = -1
            epoch_start = time.monotonic()
            last_sync: tuple[int, float] | None = None  # (generation, seconds) of the last sync
            # The last iteration's (|G|^2, tr(S)) estimate of an adaptive-batch job's
            # gradient noise scale, reported with the next iteration's metrics.
            noise_estimate: tuple[float, float] | None = None
            while (a := tracing.next_assignment(backend)) is not None:
                if a.retire:
                    settle()
                    logger.info("retired at step %d (generation %d)", a.step, a.generation)
                    result.retired = True
                    self._assignment = None
                    break
                if not plans_own:
                    plan.check_assignment(a, adaptive=self._batch_rule is not None)
                previous, self._assignment = self._assignment, a
                if previous is not None and (
                    previous.generation != a.generation or previous.world_size != a.world_size
                ):
                    settle("on_rescale")
                    callbacks.on_rescale(previous.world_size, a.world_size, a)
                if a.epoch != begun_epoch:
                    begun_epoch = a.epoch
                    settle("on_epoch_begin")
                    callbacks.on_epoch_begin(a.epoch)
                if a.pull_parameters or not have_state or lost:
                    if early is not None:
                        early.abandon()  # the pull overwrites every tensor
                    lost = False
                    try:
                        with tracing.phase("pull parameters"):
                            pulled = backend.pull_parameters()
                            self._load(pulled.params, pulled.buffers)
                    except IterationAborted as exc:
                        # A shard is down or restarted: the next boundary says what to run
                        # once the coordinator recovered it; pull again then.
                        tracing.end_iteration(aborted=True)
                        logger.warning(
                            "pull for iteration %d failed; asking again: %s", a.step, exc
                        )
                        have_state = False
                        continue
                    self._snapshot_buffers(synced_buffers)
                    have_state = True
                if a.epoch != order_epoch:
                    order_epoch = a.epoch
                    order = partition.epoch_order(plan.num_samples, plan.seed, a.epoch)
                start, stop = a.share
                self._metric_log.begin_step()
                compute_started = time.perf_counter()
                try:
                    with tracing.phase("compute"):
                        contribution = self._compute(
                            model,
                            train_set,
                            order[start:stop],
                            a,
                            early,
                            max_per_device=max_per_device,
                            autocast_dtype=autocast_dtype,
                            fetcher=fetcher,
                            scaler=scaler,
                            hooks=hooks,
                            tensors=tensors,
                        )
                except IterationAborted as exc:
                    # The last answer failed while this forward loaded it (a shard died while
                    # answering): abandon the iteration; the next assignment pulls.
                    if early is not None:
                        early.abandon()
                    if hooks is not None:
                        hooks.discard()
                    tensors.zero_grad()
                    tracing.end_iteration(aborted=True)
                    logger.warning(
                        "iteration %d abandoned: the answer of the previous one failed while it "
                        "was loaded; pulling the parameters: %s",
                        a.step,
                        exc,
                    )
                    self._restore_buffers(synced_buffers)
                    have_state = False
                    continue
                compute_s = time.perf_counter() - compute_started
                n = contribution.n_samples
                share_loss = contribution.loss_sum / n if n else math.nan
                # An adaptive batch's share gradient for the noise scale (McCandlish et al.
                # 2018, app. A): its squared norm against the global one after the sync. Only
                # a share strictly inside the batch helps, and not under float16 loss scaling
                # (the share's gradient is scaled).
                share_sq = (
                    float(global_grad_norm(contribution.grads)) ** 2
                    if self._batch_rule is not None and scaler is None and 0 < n < a.batch_size
                    else None
                )
                step_metrics = self._metric_log.end_step(n)
                # The compute/sync split travels with the script's metrics (the sync's of the
                # previous iteration of this generation: a collective learner reports inside
                # its sync).
                if keeps_metrics:
                    reported = with_timings(
                        step_metrics,
                        n,
                        compute_s,
                        last_sync[1] if last_sync and last_sync[0] == a.generation else None,
                    )
                    if noise_estimate is not None:
                        reported = with_noise_estimate(reported, n, noise_estimate)
                        noise_estimate = None
                    backend.log_metrics(a.step, reported)
                lr = self._lr(a)
                sync_started = time.perf_counter()
                try:
                    with tracing.phase("sync"):
                        synced = backend.sync(a, contribution, lr=lr)
                        last_sync = (a.generation, time.perf_counter() - sync_started)
                except IterationAborted as exc:
                    tracing.end_iteration(aborted=True)
                    if exc.ahead:  # it ran ahead of an answer that gave something else
                        logger.info("iteration %d runs again as assigned: %s", a.step, exc)
                        if exc.taken_back is not None:  # it did not complete after all
                            back = exc.taken_back
                            while result.history and result.history[-1].step >= back:
                                result.history.pop()
                        self._snapshot_buffers(synced_buffers)  # (the backend set them)
                        continue
                    logger.warning(
                        "iteration %d (generation %d) aborted; waiting for it to be re-issued: %s",
                        a.step,
                        a.generation,
                        exc,
                    )
                    self._restore_buffers(synced_buffers)
                    continue
                finally:
                    tensors.zero_grad()
                    # And the trainer's own hold on the gradients: kept until the next
                    # iteration's contribution replaced it, they stayed alive through its
                    # forward and backward, a second gradient's memory at the peak (a plain
                    # loop frees them with zero_grad before its backward).
                    del contribution
                if synced.arriving is None:
                    if not synced.in_place:  # (the local backend stepped the model's own)
                        self._load(synced.params, synced.buffers)
                    self._snapshot_buffers(synced_buffers)
                else:  # the answers are still arriving: loaded as the next forward needs them
                    if early is None:
                        early = EarlyForward(model, tensors, [n for n, _ in named_params])
                    early.begin(synced.arriving, [*synced.params, *synced.buffers], synced_buffers)
                    if not early.enabled:
                        settle()
                tracing.end_iteration()
                if share_sq is not None and synced.grad_norm is not None:
                    noise_estimate = two_batch_estimate(
                        n, share_sq, a.batch_size, synced.grad_norm**2
                    )
                loss_scale = None if scaler is None else scaler.scale
                if scaler is not None:
                    scaler.update(synced.skipped)
                # Positional, in IterationRecord's field order (every iteration): step, epoch,
                # iteration, generation, rank, world_size, batch_size, n_samples, loss,
                # share_loss, lr, grad_norm, skipped, loss_scale, metrics.
                record = IterationRecord(
                    a.step,
                    a.epoch,
                    a.iteration,
                    a.generation,
                    a.rank,
                    a.world_size,
                    a.batch_size,
                    n,
                    synced.loss,
                    share_loss,
                    lr,
                    synced.grad_norm,
                    synced.skipped,
                    loss_scale,
                    means(step_metrics),
                )
                result.history.append(record)
                if callbacks.callbacks:  # (none: nothing to call, nothing to settle for)
                    settle("on_iteration_end")
                    callbacks.on_iteration_end(record)
                if a.batch_stop == plan.num_samples:  # the epoch's last iteration
                    epoch_result = None
                    if a.rank == 0:
                        settle()
                        epoch_result = self._end_epoch(
                            a,
                            result,
                            None if lost else test_set,  # not whole: no evaluation
                            eval_batch_size,
                            time.monotonic() - epoch_start,
                        )
                        result.epochs.append(epoch_result)
                        backend.report_epoch(
                            EpochReport(
                                epoch=a.epoch,
                                step=a.step,
                                loss=epoch_result.test_loss,
                                metrics=dict(epoch_result.metrics),
                                num_samples=0 if test_set is None else len(test_set),  # type: ignore[arg-type]
                            )
                        )
                    settle("on_epoch_end")
                    callbacks.on_epoch_end(a.epoch, epoch_result)
                    epoch_start = time.monotonic()
            else:
                result.completed = True
            settle()  # the final parameters
            if lost:
                logger.warning(
                    "TrainResult.params are not whole: the last answer failed while it was "
                    "loaded (the job's final model, the shards', is)"
                )
        finally:
            if early is not None:  # settled unless train() is raising: just unhook
                early.abandon(wait=False)
            if hooks is not None:
                hooks.remove()
            tracing.close()
            if fetcher is not None:
                fetcher.close()
            if owns_backend:
                backend.close()
        result.params = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        result.is_primary = result.completed and self.is_primary
        callbacks.on_train_end(result)
        return result

    # -- helpers -------------------------------------------------------------------------------

    def _compute(
        self,
        model: nn.Module,
        train_set: Dataset[Any],
        indices: torch.Tensor,
        a: Assignment,
        early: EarlyForward | None,
        *,
        max_per_device: int | None,
        autocast_dtype: torch.dtype | None,
        fetcher: BatchFetcher | None,
        scaler: LossScaler | None,
        hooks: Any,
        tensors: ModelTensors,
    ) -> Any:
        """This learner's contribution to iteration ``a`` (``indices``: its share). With
        early forward the last answer's pending tensors load as forward reaches their
        modules, and the whole of it before the first backward (IterationAborted when it
        failed)."""
        n = int(indices.numel())
        if early is not None:
            early.before_forward()
        contribution = compute_contribution(
            model,
            self.loss_fn,
            train_set,
            indices,
            max_per_device=max_per_device,
            device=self.device,
            autocast_dtype=autocast_dtype,
            fetcher=fetcher,
            # Each sample's term of the scaled loss is scale / b, as in one process's scaled
            # mean over the global batch: the share overflows float16 exactly where that
            # process's per-sample terms would.
            loss_scale=(None if scaler is None or n == 0 else scaler.scale * n / a.batch_size),
            metrics=self._metric_log,
            hooks=hooks,
            tensors=tensors,
            forward_check=None if early is None or not early.unsettled else early.check,
        )
        if early is not None:
            early.settle()  # an empty share ran no forward
        if self.device.type == "cuda":  # the kernels queued count as compute
            torch.cuda.synchronize(self.device)
        return contribution

    def _datasets(self, uris: tuple[str, ...]) -> tuple[Dataset[Any], Dataset[Any] | None]:
        try:
            parameters = inspect.signature(self.get_datasets).parameters.values()
        except (TypeError, ValueError):  # a builtin without a signature: no arguments
            parameters = []  # type: ignore[assignment]
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        wants_uris = any(
            p.kind in positional and p.default is inspect.Parameter.empty for p in parameters
        )
        if wants_uris:
            return self.get_datasets(list(uris))
        return self.get_datasets()

    def _base_lr(self) -> float | None:
        lr = self.optimizer_spec.kwargs.get("lr")
        return float(lr) if isinstance(lr, (int, float)) and not isinstance(lr, bool) else None

    def _resolve_schedule(self, plan: TrainingPlan) -> LRSchedule | None:
        spec = self.lr_schedule
        if spec is None or callable(spec):
            return spec
        total = plan.epochs if self.lr_schedule_unit == "epoch" else plan.total_steps
        return resolve_schedule(spec, base_lr=self._base_lr(), total=total)

    def _lr(self, a: Assignment) -> float | None:
        lr = None
        if self._schedule is not None:
            lr = float(self._schedule(a.epoch if self.lr_schedule_unit == "epoch" else a.step))
        if self._batch_rule is None:
            return lr
        # An adaptive batch: the rate (the schedule's, else the optimizer's) scaled by the rule
        # from the declared batch to this iteration's (always sent, so that a batch back at
        # the declared one gets the declared rate again).
        base = lr if lr is not None else self._base_lr()
        assert base is not None  # checked at train()
        batch = a.global_batch or self._declared_batch
        return scaled_learning_rate(
            base,
            batch,
            self._declared_batch,
            self._batch_rule,
            a.gradient_noise_scale if a.gradient_noise_scale > 0 else None,
        )

    @torch.no_grad()
    def _load(self, params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]) -> None:
        model_params, model_buffers = self._tensors.params, self._tensors.buffers
        if len(params) != len(model_params) or len(buffers) != len(model_buffers):
            raise RuntimeError(
                f"backend sent {len(params)} parameters and {len(buffers)} buffers, the model "
                f"has {len(model_params)} and {len(model_buffers)}"
            )
        for dst, src in zip([*model_params, *model_buffers], [*params, *buffers], strict=True):
            if dst is not src and not same_memory(dst, src):
                # Blocking: a backend may reuse (e.g. pinned receive) buffers on its next call.
                dst.copy_(src)

    def _snapshot_buffers(self, saved: Sequence[torch.Tensor]) -> None:
        if saved:  # (no no_grad context per iteration for a model without buffers)
            with torch.no_grad():
                for dst, src in zip(saved, self._tensors.buffers, strict=True):
                    dst.copy_(src)

    def _restore_buffers(self, saved: Sequence[torch.Tensor]) -> None:
        if saved:
            with torch.no_grad():
                for dst, src in zip(self._tensors.buffers, saved, strict=True):
                    dst.copy_(src)

    def _end_epoch(
        self,
        a: Assignment,
        result: TrainResult,
        test_set: Dataset[Any] | None,
        eval_batch_size: int,
        seconds: float,
    ) -> EpochResult:
        # The epoch's records are the last ones (the history is in step order): no scan of
        # the whole run's at every epoch's end.
        records = []
        for r in reversed(result.history):
            if r.epoch != a.epoch:
                break
            records.append(r)
        records.reverse()
        if all(r.loss is not None for r in records):
            pairs = [(r.best_loss, r.batch_size) for r in records]
        else:  # only this learner's shares are known
            pairs = [(r.share_loss, r.n_samples) for r in records if r.n_samples]
        weight = sum(w for _, w in pairs)
        train_loss = sum(v * w for v, w in pairs) / weight if weight else math.nan
        values: dict[str, float] = {}
        if test_set is None:
            test_loss = math.nan
        else:
            test_loss, values = evaluate(
                self.model,
                self.loss_fn,
                test_set,
                batch_size=eval_batch_size,
                device=self.device,
                metrics=self.metrics,
            )
        epoch_result = EpochResult(a.epoch, a.step, train_loss, test_loss, values, seconds)
        logger.info("%s", epoch_result.summary(result.plan.epochs))
        if self.on_epoch_end is not None:
            self.on_epoch_end(epoch_result)
        return epoch_result
