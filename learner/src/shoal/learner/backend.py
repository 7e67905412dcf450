"""The interface between the trainer and whatever synchronizes it, and the local backend.

A :class:`SyncBackend` is everything a learner needs from the outside world. The trainer
(``trainer.py``) drives it in this order::

    state = backend.initialize(setup)           # join the job: first learner initializes,
                                                # later ones get the current parameters
    while (a := backend.next_assignment()) is not None:   # blocks at the iteration boundary
        if a.retire:
            break                                          # leave cleanly
        if a.pull_parameters:                              # new in the job, or restored
            <load backend.pull_parameters() into the model>
        contribution = <local gradient on a's share>       # mean over the share
        try:
            result = backend.sync(a, contribution, lr=lr)  # new parameters and buffers
        except IterationAborted:
            continue                                       # the coordinator re-issues it
        <load result.params / result.buffers into the model>
        if plan.is_last_of_epoch(a.iteration) and a.rank == 0:
            backend.report_epoch(<evaluation>)
    backend.close()

Backends are chosen by name from a registry (:func:`register_backend`, :func:`get_backend`),
as PyTorch's rendezvous handlers are. :class:`LocalBackend` (``"local"``) is the standalone
mode: a world of one, the real ``torch.optim`` optimizer stepping in-process.

The weighting rule every backend must implement is :func:`reduce_contributions`: it is the
reference the parameter-sync shards are tested against.
"""

from __future__ import annotations

import importlib
import json
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from importlib.metadata import entry_points
from typing import Any, TypeAlias

import fsspec
import safetensors.torch
import torch

from shoal.learner import partition
from shoal.learner.env import LOCAL_BACKEND, LearnerEnv

__all__ = [
    "ENTRY_POINT_GROUP",
    "Assignment",
    "BackendFactory",
    "Contribution",
    "EpochReport",
    "InitialState",
    "IterationAborted",
    "LocalBackend",
    "ModelState",
    "OptimizerLike",
    "OptimizerSpec",
    "SyncBackend",
    "SyncResult",
    "TensorSpec",
    "TrainingPlan",
    "TrainingSetup",
    "apply_gradient_policy",
    "create_backend",
    "get_backend",
    "global_grad_norm",
    "load_latest_checkpoint",
    "reduce_contributions",
    "register_backend",
    "registered_backends",
    "save_checkpoint",
    "set_learning_rate",
]


# --------------------------------------------------------------------------------------------
# Value types exchanged with a backend
# --------------------------------------------------------------------------------------------


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype ({name!r}) is not a torch dtype")
    return dtype


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one parameter or buffer (``dtype`` as ``"float32"`` etc.).

    Parameters and buffers always travel as lists in the order of their specs, so names are
    sent once, at :meth:`SyncBackend.initialize`, never on the hot path.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, tuple(tensor.shape), _dtype_name(tensor.dtype))

    @property
    def torch_dtype(self) -> torch.dtype:
        return _dtype_of(self.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TensorSpec:
        return cls(str(data["name"]), tuple(int(d) for d in data["shape"]), str(data["dtype"]))


#: The forms in which a user gives the optimizer (see :meth:`OptimizerSpec.parse`).
OptimizerLike: TypeAlias = (
    "OptimizerSpec | str | type[torch.optim.Optimizer] "
    "| tuple[str | type[torch.optim.Optimizer], Mapping[str, Any]]"
)

_PLAIN = (int, float, bool, str, type(None))


def _check_plain(name: str, value: Any) -> Any:
    """Hyperparameters must survive JSON (they are re-created on the sync shards)."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (list, tuple)):
        return tuple(_check_plain(name, v) for v in value)
    raise ValueError(
        f"optimizer argument {name} ({value!r}) must be a number, bool, str, None or a "
        "tuple of them, so that the optimizer can be re-created by the parameter-sync shards"
    )


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer by name and keyword arguments, so that it can be re-created elsewhere (in
    cluster mode the parameter-sync shards run it on their slices of the parameters).

    ``name`` is either the name of a class in ``torch.optim`` (``"SGD"``, ``"AdamW"``) or
    ``"package.module:ClassName"`` for any other ``torch.optim.Optimizer`` subclass, which must
    then be importable wherever the optimizer runs. ``kwargs`` are plain values (numbers,
    bools, strings, None and tuples of them); a learning-rate schedule is given to the trainer
    separately and overrides ``lr`` at every iteration.
    """

    name: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    #: Parameter groups by parameter name: ``((names, overrides), ...)``; the parameters no
    #: group names form a last group with the optimizer's defaults. Empty: one group.
    groups: tuple[tuple[tuple[str, ...], Mapping[str, Any]], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"optimizer name ({self.name!r}) must be a non-empty str")
        if not isinstance(self.kwargs, Mapping):
            raise ValueError(f"optimizer kwargs ({self.kwargs!r}) must be a mapping")
        object.__setattr__(self, "kwargs", self._clean(self.kwargs))
        groups = []
        seen: set[str] = set()
        for i, group in enumerate(self.groups):
            if not (isinstance(group, (tuple, list)) and len(group) == 2):
                raise ValueError(f"param group {i} ({group!r}) must be (names, overrides)")
            names, overrides = group
            if isinstance(names, str) or not all(isinstance(n, str) for n in names):
                raise ValueError(f"param group {i} names ({names!r}) must be parameter names")
            for n in names:
                if n in seen:
                    raise ValueError(f"parameter {n!r} is in more than one param group")
                seen.add(n)
            if not isinstance(overrides, Mapping) or "params" in overrides:
                raise ValueError(
                    f"param group {i} overrides ({overrides!r}) must be a mapping without 'params'"
                )
            groups.append((tuple(names), self._clean(overrides)))
        object.__setattr__(self, "groups", tuple(groups))

    @staticmethod
    def _clean(kwargs: Mapping[str, Any]) -> dict[str, Any]:
        clean = {}
        for key, value in kwargs.items():
            if not isinstance(key, str):
                raise ValueError(f"optimizer argument name ({key!r}) must be a str")
            clean[key] = _check_plain(key, value)
        return clean

    @classmethod
    def parse(cls, optimizer: OptimizerLike) -> OptimizerSpec:
        """Accepts, and validates by building it once on a dummy parameter:

        * ``OptimizerSpec("SGD", {"lr": 0.1})``
        * ``("SGD", {"lr": 0.1, "momentum": 0.9})`` or ``(torch.optim.SGD, {...})``
        * ``"Adam"`` or ``torch.optim.Adam`` (the optimizer's default hyperparameters)
        * ``("my_pkg.opt:Lion", {"lr": 1e-4})`` for an importable custom optimizer class.
        """
        if isinstance(optimizer, OptimizerSpec):
            spec = optimizer
        else:
            kwargs: Mapping[str, Any] = {}
            target: Any = optimizer
            if isinstance(optimizer, tuple):
                if len(optimizer) != 2:
                    raise ValueError(f"optimizer ({optimizer!r}) must be (name or class, kwargs)")
                target, kwargs = optimizer
            if isinstance(target, type):
                target = cls._name_of_class(target)
            if not isinstance(target, str):
                raise ValueError(
                    f"optimizer ({optimizer!r}) must be a name, a torch.optim.Optimizer "
                    "subclass, or a (name or class, kwargs) pair"
                )
            spec = cls(target, kwargs)
        spec.create([torch.zeros(1, requires_grad=True)])
        return spec

    @staticmethod
    def _name_of_class(klass: type) -> str:
        if not issubclass(klass, torch.optim.Optimizer):
            raise ValueError(f"optimizer ({klass!r}) is not a torch.optim.Optimizer subclass")
        if getattr(torch.optim, klass.__name__, None) is klass:
            return klass.__name__
        return f"{klass.__module__}:{klass.__qualname__}"

    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        """The class named by ``name`` (imported when given as ``module:Class``)."""
        if ":" in self.name:
            module_name, _, qualname = self.name.partition(":")
            try:
                obj: Any = importlib.import_module(module_name)
                for part in qualname.split("."):
                    obj = getattr(obj, part)
            except (ImportError, AttributeError) as exc:
                raise ValueError(f"optimizer ({self.name!r}) cannot be imported: {exc}") from exc
        else:
            obj = getattr(torch.optim, self.name, None)
        if not (isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer)):
            raise ValueError(
                f"optimizer ({self.name!r}) is not a torch.optim.Optimizer "
                "(give a torch.optim class name such as 'SGD', or 'module:Class')"
            )
        return obj

    def create(
        self, params: Iterable[torch.Tensor], names: Sequence[str] | None = None
    ) -> torch.optim.Optimizer:
        """Build the optimizer over ``params`` (named ``names``, needed with :attr:`groups`);
        bad arguments raise ``ValueError``. With groups, each group also records
        ``lr_scale``, its ``lr`` over the optimizer's default, so that a learning-rate
        schedule (:func:`set_learning_rate`) keeps the groups' ratios."""
        klass = self.optimizer_class()
        target: Any = params
        if self.groups:
            params = list(params)
            if names is None or len(names) != len(params):
                raise ValueError("an optimizer with param groups needs every parameter's name")
            by_name = dict(zip(names, params, strict=True))
            listed: set[str] = set()
            target = []
            for group_names, overrides in self.groups:
                unknown = [n for n in group_names if n not in by_name]
                if unknown:
                    raise ValueError(f"param group names unknown parameters {unknown!r}")
                listed.update(group_names)
                target.append({"params": [by_name[n] for n in group_names], **overrides})
            rest = [p for n, p in zip(names, params, strict=True) if n not in listed]
            if rest:
                target.append({"params": rest})
        try:
            optimizer = klass(target, **self.kwargs)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"optimizer {self.name} rejected its arguments {dict(self.kwargs)!r} "
                f"(groups {[dict(o) for _, o in self.groups]!r}): {exc}"
            ) from exc
        if self.groups:
            base = optimizer.defaults.get("lr")
            for group in optimizer.param_groups:
                lr = group.get("lr")
                ok = isinstance(base, (int, float)) and base > 0 and isinstance(lr, (int, float))
                group["lr_scale"] = float(lr) / float(base) if ok else 1.0
        return optimizer

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"name": self.name, "kwargs": dict(self.kwargs)}
        if self.groups:
            data["groups"] = [[list(n), dict(o)] for n, o in self.groups]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OptimizerSpec:
        groups = tuple((tuple(n), dict(o)) for n, o in data.get("groups", []))
        return cls(str(data["name"]), dict(data.get("kwargs", {})), groups)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set a schedule's ``lr`` on every parameter group, times the group's ``lr_scale`` (its
    own ``lr`` over the optimizer's, recorded by :meth:`OptimizerSpec.create`; 1 without
    groups), as ``torch.optim.lr_scheduler.LambdaLR`` scales every group's base rate."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


@dataclass(frozen=True)
class TrainingPlan:
    """The job's settings that fix the partition: every learner must agree on them.

    ``checkpoint_every`` is in epochs (None: only at the end); ``max_workers`` is the most
    learners the job may get (None: no limit beyond the cluster's; ignored standalone).
    """

    epochs: int
    batch_size: int
    num_samples: int
    seed: int = 0
    checkpoint_every: int | None = None
    max_workers: int | None = None

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "num_samples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} ({value!r}) must be an int >= 1")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed ({self.seed!r}) must be an int >= 0")
        for name in ("checkpoint_every", "max_workers"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"{name} ({value!r}) must be None or an int >= 1")

    @property
    def iterations_per_epoch(self) -> int:
        return partition.iterations_per_epoch(self.num_samples, self.batch_size)

    @property
    def total_steps(self) -> int:
        """Iterations of the whole job."""
        return self.epochs * self.iterations_per_epoch

    def position(self, step: int) -> tuple[int, int]:
        """``(epoch, iteration within the epoch)`` of global iteration ``step``."""
        return divmod(step, self.iterations_per_epoch)

    def assignment(
        self, step: int, *, rank: int = 0, world_size: int = 1, generation: int = 0
    ) -> Assignment:
        """The assignment of ``rank`` of ``world_size`` for global iteration ``step``."""
        epoch, iteration = self.position(step)
        start, stop = partition.batch_range(iteration, self.batch_size, self.num_samples)
        return Assignment(
            generation=generation,
            epoch=epoch,
            iteration=iteration,
            step=step,
            rank=rank,
            world_size=world_size,
            batch_start=start,
            batch_stop=stop,
        )

    def is_last_of_epoch(self, iteration: int) -> bool:
        """Whether ``iteration`` (within its epoch) is the epoch's last."""
        return iteration == self.iterations_per_epoch - 1

    def is_checkpoint_step(self, step: int) -> bool:
        """Whether a checkpoint is due after global iteration ``step`` completes: at the end of
        every ``checkpoint_every``-th epoch and at the end of the job."""
        if step == self.total_steps - 1:
            return True
        epoch, iteration = self.position(step)
        return (
            self.checkpoint_every is not None
            and iteration == self.iterations_per_epoch - 1
            and (epoch + 1) % self.checkpoint_every == 0
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainingPlan:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


@dataclass(frozen=True)
class TrainingSetup:
    """What a learner brings when it joins (:meth:`SyncBackend.initialize`).

    ``params``/``buffers`` are the learner's freshly built model tensors, in spec order; they
    initialize the job only when this learner is the first (otherwise they are ignored, the
    current values are pulled). Buffers are the model's persistent buffers (those in its
    ``state_dict``, e.g. BatchNorm running statistics).
    """

    plan: TrainingPlan
    optimizer: OptimizerSpec
    param_specs: tuple[TensorSpec, ...]
    buffer_specs: tuple[TensorSpec, ...]
    params: Sequence[torch.Tensor]
    buffers: Sequence[torch.Tensor]
    clip_grad_norm: float | None = None
    skip_nonfinite: bool = False

    def __post_init__(self) -> None:
        clip = self.clip_grad_norm
        if clip is not None and (
            isinstance(clip, bool)
            or not isinstance(clip, (int, float))
            or not math.isfinite(clip)
            or clip <= 0
        ):
            raise ValueError(f"clip_grad_norm ({clip!r}) must be None or a finite number > 0")


@dataclass(frozen=True)
class ModelState:
    """Parameters and buffers, in spec order."""

    params: Sequence[torch.Tensor]
    buffers: Sequence[torch.Tensor]


@dataclass(frozen=True)
class InitialState:
    """The job's state as the learner joins: the plan in force (the job's, which wins over the
    script's), and the number of iterations the job has already completed (0 for a new job;
    more after a resume or for a late joiner).

    ``params``/``buffers`` are the values to load, or both None when the backend defers the
    pull to the learner's first assignment (``Assignment.pull_parameters``), as a learner that
    waits to be admitted should: the job keeps training meanwhile."""

    plan: TrainingPlan
    params: Sequence[torch.Tensor] | None
    buffers: Sequence[torch.Tensor] | None
    step: int = 0

    def __post_init__(self) -> None:
        if (self.params is None) != (self.buffers is None):
            raise ValueError("params and buffers must both be given or both be None")


@dataclass(frozen=True)
class Assignment:
    """The coordinator's answer at an iteration boundary; the same for all members of a
    generation except ``rank``.

    ``step`` is the global iteration index (``epoch * iterations_per_epoch + iteration``), the
    argument of per-iteration learning-rate schedules. ``[batch_start, batch_stop)`` are the
    positions of the whole global batch in the epoch's order; this learner's share is
    :attr:`share`. When ``retire`` is true the learner must stop without computing anything;
    the other fields then describe where the job is and are informational. When
    ``pull_parameters`` is true the learner must load :meth:`SyncBackend.pull_parameters`
    before running the iteration (it is new in the job, or the job was restored from a
    checkpoint).

    Wire mapping (``shoal.v1.Assignment``): ``step`` is ``global_iteration``; ``batch_start``
    is ``iteration * B`` and ``batch_stop`` is ``batch_start + batch_samples``; :attr:`share`
    is ``[sample_start, sample_end)``.
    """

    generation: int
    epoch: int
    iteration: int
    step: int
    rank: int
    world_size: int
    batch_start: int
    batch_stop: int
    retire: bool = False
    pull_parameters: bool = False

    def __post_init__(self) -> None:
        if self.retire:
            return
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank ({self.rank}) must be in [0, world_size ({self.world_size}))")
        if not 0 <= self.batch_start < self.batch_stop:
            raise ValueError(
                f"batch range [{self.batch_start}, {self.batch_stop}) must be non-empty"
            )

    @property
    def batch_size(self) -> int:
        """``b``: samples in this iteration's global batch (the last one may be short)."""
        return self.batch_stop - self.batch_start

    @property
    def share(self) -> tuple[int, int]:
        """Positions ``[i*B + r*b//W, i*B + (r+1)*b//W)`` of this learner's share."""
        b, w, r = self.batch_size, self.world_size, self.rank
        return self.batch_start + r * b // w, self.batch_start + (r + 1) * b // w

    @classmethod
    def retirement(cls, generation: int, step: int) -> Assignment:
        """A RETIRE answer at the boundary before global iteration ``step``."""
        return cls(generation, 0, 0, step, 0, 1, 0, 0, retire=True)


@dataclass(frozen=True)
class Contribution:
    """One learner's part of one iteration, handed to :meth:`SyncBackend.sync`.

    ``grads[j]`` is the mean gradient over this learner's share for parameter ``j`` (spec
    order), or None where the parameter got no gradient (frozen, or unused by this share); it
    is usually the model's own ``.grad`` tensor, so a backend must not keep it past ``sync``.
    ``n_samples`` is the share's size (0 for an empty share, whose grads are all None).
    ``loss_sum`` is the sum of the per-sample losses over the share. ``buffers`` are the
    model's buffers after this iteration's forward passes.
    """

    grads: Sequence[torch.Tensor | None]
    n_samples: int
    loss_sum: float
    buffers: Sequence[torch.Tensor]


@dataclass(frozen=True)
class SyncResult:
    """The outcome of a completed iteration: the new parameters and buffers (spec order) for
    every member, its global ``step``, and the iteration's global mean training loss
    (``sum loss_sum / sum n_samples``) or None when this learner cannot know it yet (the
    coordinator learns the members' loss sums at the next boundary). A backend may reuse these
    tensors on its next call: the trainer copies them into the model at once.

    ``grad_norm`` is the 2-norm of the global (reduced) gradient before clipping, when the
    backend computed it (it does with ``TrainingSetup.clip_grad_norm`` or ``skip_nonfinite``);
    ``skipped`` is true when the optimizer step was skipped because that gradient was not
    finite (only with ``skip_nonfinite``: float16 loss scaling)."""

    params: Sequence[torch.Tensor]
    buffers: Sequence[torch.Tensor]
    step: int
    loss: float | None = None
    grad_norm: float | None = None
    skipped: bool = False


@dataclass(frozen=True)
class EpochReport:
    """End-of-epoch evaluation on the test set, reported by the learner of rank 0 of the
    epoch's last iteration: mean test ``loss`` and the metrics hook's values."""

    epoch: int
    step: int
    loss: float
    metrics: Mapping[str, float]
    num_samples: int


class IterationAborted(RuntimeError):
    """Raised by :meth:`SyncBackend.sync` when the coordinator aborted the iteration (a member
    died mid-iteration): nothing was applied, and the learner asks for its next assignment,
    which re-issues the same iteration to the survivors with new ranks."""


# --------------------------------------------------------------------------------------------
# The weighting rule
# --------------------------------------------------------------------------------------------


def reduce_contributions(contributions: Sequence[Contribution]) -> Contribution:
    """Combine the contributions of one iteration's members as the protocol requires.

    * gradient: ``sum_i n_i * g_i / sum_i n_i`` (a None gradient counts as zero; a parameter
      with no gradient from anyone stays None, so the optimizer skips it, as torch does);
    * floating-point buffers: averaged with the same weights, over members with ``n_i > 0``;
    * integer buffers (BatchNorm's ``num_batches_tracked``): the maximum over those members;
    * ``n_samples`` and ``loss_sum`` are summed (the global mean loss is their ratio).

    With one member this returns its gradients and buffers unchanged. The result equals the
    gradient of the mean loss over the union of the shares, up to float summation order.
    """
    if not contributions:
        raise ValueError("contributions (empty) must hold at least one contribution")
    n_params = len(contributions[0].grads)
    n_buffers = len(contributions[0].buffers)
    for c in contributions:
        if len(c.grads) != n_params or len(c.buffers) != n_buffers:
            raise ValueError(
                f"contributions disagree on tensor counts: grads {len(c.grads)} vs {n_params}, "
                f"buffers {len(c.buffers)} vs {n_buffers}"
            )
    active = [c for c in contributions if c.n_samples > 0]
    total = sum(c.n_samples for c in active)
    loss_sum = float(sum(c.loss_sum for c in contributions))
    if not active:
        return Contribution([None] * n_params, 0, loss_sum, list(contributions[0].buffers))
    if len(active) == 1:
        only = active[0]
        return Contribution(list(only.grads), total, loss_sum, list(only.buffers))
    grads: list[torch.Tensor | None] = []
    for j in range(n_params):
        acc: torch.Tensor | None = None
        for c in active:
            g = c.grads[j]
            if g is None:
                continue
            if acc is None:
                acc = g.detach() * c.n_samples
            else:
                acc.add_(g, alpha=c.n_samples)
        grads.append(None if acc is None else acc.div_(total))
    buffers: list[torch.Tensor] = []
    for j in range(n_buffers):
        first = active[0].buffers[j]
        if first.is_floating_point() or first.is_complex():
            acc_b = first.detach() * active[0].n_samples
            for c in active[1:]:
                acc_b.add_(c.buffers[j], alpha=c.n_samples)
            buffers.append(acc_b.div_(total))
        else:
            buffers.append(torch.stack([c.buffers[j].detach() for c in active]).amax(dim=0))
    return Contribution(grads, total, loss_sum, buffers)


@torch.no_grad()
def global_grad_norm(grads: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """The 2-norm of all of ``grads`` together (None entries skipped), computed as
    ``torch.nn.utils.clip_grad_norm_`` does: the norm of the per-tensor norms."""
    present = [g for g in grads if g is not None]
    if not present:
        return torch.zeros((), dtype=torch.float32)
    norms = [torch.linalg.vector_norm(g.detach(), 2.0) for g in present]
    device = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), 2.0)


@torch.no_grad()
def apply_gradient_policy(
    grads: Sequence[torch.Tensor | None], setup: TrainingSetup
) -> tuple[float | None, bool]:
    """Apply ``setup``'s clipping to the *global* (already reduced) gradient ``grads`` in
    place, as ``torch.nn.utils.clip_grad_norm_(params, max_norm)`` would on one process:
    multiply every gradient by ``min(1, max_norm / (norm + 1e-6))``.

    Returns ``(norm before clipping, skip)``: ``skip`` is true when ``setup.skip_nonfinite``
    and the norm is not finite (an inf/NaN anywhere), in which case the caller must not step
    the optimizer, as ``torch.amp.GradScaler.step`` skips it. Without clipping or skipping the
    gradient is left alone and the norm is not computed (``(None, False)``)."""
    if setup.clip_grad_norm is None and not setup.skip_nonfinite:
        return None, False
    norm = global_grad_norm(grads)
    value = float(norm)
    if setup.skip_nonfinite and not math.isfinite(value):
        return value, True
    if setup.clip_grad_norm is not None:
        coef = torch.clamp(float(setup.clip_grad_norm) / (norm + 1e-6), max=1.0)
        for g in grads:
            if g is not None:
                g.mul_(coef.to(g.device, g.dtype))
    return value, False


# --------------------------------------------------------------------------------------------
# The interface
# --------------------------------------------------------------------------------------------


class SyncBackend(ABC):
    """What synchronizes a learner with the rest of its job.

    Implementations: :class:`LocalBackend` (``"local"``, standalone); the parameter-server
    client (``"parameter_server"``) and collective modes are registered by their own modules.
    A backend is used by one trainer, from one thread, in the order shown in the module
    docstring; all tensors are lists in the order of the specs given at :meth:`initialize`.
    """

    @abstractmethod
    def initialize(self, setup: TrainingSetup) -> InitialState:
        """Join the job. The first learner's ``setup.params``/``buffers`` initialize it (and
        its plan and optimizer become the job's); a later learner gets the current state,
        here or (returning None params) through ``pull_parameters`` at its first assignment.
        A learner whose plan or specs disagree with the job's is refused with ``ValueError``.
        A backend that stores checkpoints resumes from the latest one here. Called once."""

    @abstractmethod
    def next_assignment(self) -> Assignment | None:
        """Block at the iteration boundary until the coordinator decides the next iteration,
        and return this learner's assignment (possibly ``retire``), or None when the job has
        completed all its iterations. After an :class:`IterationAborted` the next call
        re-issues the aborted iteration."""

    @abstractmethod
    def sync(
        self, assignment: Assignment, contribution: Contribution, *, lr: float | None = None
    ) -> SyncResult:
        """Contribute this learner's part of ``assignment``'s iteration and wait for the
        update: the backend combines all members' contributions by
        :func:`reduce_contributions`, applies the setup's clipping to the combined gradient
        (:func:`apply_gradient_policy`), sets ``lr`` (when not None) on every parameter group,
        runs the optimizer once (not at all when the policy says skip), and returns the new
        parameters and buffers. Raises
        :class:`IterationAborted` when the iteration was aborted. The backend also writes
        checkpoints when the completed step calls for one (``TrainingPlan.is_checkpoint_step``)
        and the final model at the end of the job."""

    def pull_parameters(self) -> ModelState:
        """The job's current parameters and buffers, fetched when an assignment says
        ``pull_parameters`` (and before the first iteration when :meth:`initialize` returned
        none). Backends that never defer the state need not implement it."""
        raise NotImplementedError(f"{type(self).__name__} cannot pull parameters")

    def report_epoch(self, report: EpochReport) -> None:  # noqa: B027 - optional hook
        """Record an end-of-epoch evaluation (metrics storage, the job's status)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and resources; called once, also after an error."""

    def __enter__(self) -> SyncBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------

#: A backend factory builds a backend from the learner's environment contract.
BackendFactory: TypeAlias = Callable[[LearnerEnv], SyncBackend]

#: Installed distributions may provide backends through this entry-point group; each entry
#: point's name is the backend name and it loads a :data:`BackendFactory`.
ENTRY_POINT_GROUP = "shoal.learner.backends"

_registry: dict[str, BackendFactory] = {}


def register_backend(name: str, factory: BackendFactory, *, replace: bool = False) -> None:
    """Register ``factory`` under ``name``. Registering a taken name raises ``ValueError``
    unless ``replace`` is true."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"backend name ({name!r}) must be a non-empty str")
    if not callable(factory):
        raise ValueError(f"backend factory ({factory!r}) for {name!r} must be callable")
    if name in _registry and not replace:
        raise ValueError(f"backend name ({name!r}) is already registered")
    _registry[name] = factory


def _entry_point_factory(name: str) -> BackendFactory | None:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            factory = ep.load()
            _registry.setdefault(name, factory)
            return _registry[name]
    return None


def registered_backends() -> list[str]:
    """Names of the registered backends, including entry-point ones, sorted."""
    names = set(_registry)
    names.update(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
    return sorted(names)


def get_backend(name: str) -> BackendFactory:
    """The factory registered under ``name`` (looked up in the registry, then in the
    ``shoal.learner.backends`` entry points). Unknown names raise ``ValueError``."""
    factory = _registry.get(name) or _entry_point_factory(name)
    if factory is None:
        raise ValueError(
            f"sync backend ({name!r}) is not registered; known: {registered_backends()}"
        )
    return factory


def create_backend(name: str | None = None, env: LearnerEnv | None = None) -> SyncBackend:
    """Build a backend: ``name`` defaults to the environment's SHOAL_SYNC_BACKEND."""
    env = LearnerEnv.from_environ() if env is None else env
    return get_backend(name or env.sync_backend)(env)


# --------------------------------------------------------------------------------------------
# Checkpoints (fsspec + safetensors)
# --------------------------------------------------------------------------------------------

_CHECKPOINT_FORMAT = 1


def _join(root: str, *parts: str) -> str:
    return "/".join([root.rstrip("/"), *parts])


def _flatten_optimizer_state(
    state_dict: Mapping[str, Any],
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors: dict[str, torch.Tensor] = {}
    plain_state: dict[str, dict[str, Any]] = {}
    for index, entry in state_dict["state"].items():
        plain: dict[str, Any] = {}
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state/{index}/{key}"] = value.detach().cpu().contiguous()
            else:
                plain[key] = value
        plain_state[str(index)] = plain
    meta = {"state": plain_state, "param_groups": state_dict["param_groups"]}
    return tensors, meta


def _unflatten_optimizer_state(
    tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]
) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {int(i): dict(entry) for i, entry in meta["state"].items()}
    for key, value in tensors.items():
        _, index, name = key.split("/", 2)
        state.setdefault(int(index), {})[name] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def save_checkpoint(
    uri: str,
    *,
    completed: int,
    plan: TrainingPlan,
    optimizer_spec: OptimizerSpec,
    param_specs: Sequence[TensorSpec],
    buffer_specs: Sequence[TensorSpec],
    params: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    optimizer: torch.optim.Optimizer,
) -> str:
    """Write the state after ``completed`` iterations under ``uri``/checkpoints/step-NNNNNNNNNN/:
    ``model.safetensors`` (``param/<name>``, ``buffer/<name>``), ``optimizer.safetensors``
    (``state/<index>/<key>``) and, last, ``manifest.json``; then point ``latest`` at it, so
    that ``latest`` never names a partial checkpoint. Returns the checkpoint's path."""
    fs, root = fsspec.core.url_to_fs(uri)
    name = f"step-{completed:010d}"
    directory = _join(root, "checkpoints", name)
    fs.makedirs(directory, exist_ok=True)
    model = {
        f"param/{s.name}": t.detach().cpu().contiguous()
        for s, t in zip(param_specs, params, strict=True)
    }
    model.update(
        {
            f"buffer/{s.name}": t.detach().cpu().contiguous()
            for s, t in zip(buffer_specs, buffers, strict=True)
        }
    )
    opt_tensors, opt_meta = _flatten_optimizer_state(optimizer.state_dict())
    with fs.open(_join(directory, "model.safetensors"), "wb") as f:
        f.write(safetensors.torch.save(model))
    with fs.open(_join(directory, "optimizer.safetensors"), "wb") as f:
        f.write(safetensors.torch.save(opt_tensors))
    manifest = {
        "format": _CHECKPOINT_FORMAT,
        "completed": completed,
        "plan": plan.to_dict(),
        "optimizer": optimizer_spec.to_dict(),
        "params": [s.to_dict() for s in param_specs],
        "buffers": [s.to_dict() for s in buffer_specs],
        "optimizer_state": opt_meta,
    }
    with fs.open(_join(directory, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    latest, tmp = _join(root, "checkpoints", "latest"), _join(root, "checkpoints", "latest.tmp")
    with fs.open(tmp, "w") as f:
        f.write(name)
    fs.mv(tmp, latest)
    return directory


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A checkpoint read back by :func:`load_latest_checkpoint` (tensors on the CPU);
    ``completed`` is the number of iterations whose updates it holds."""

    completed: int
    plan: TrainingPlan
    optimizer_spec: OptimizerSpec
    param_specs: tuple[TensorSpec, ...]
    buffer_specs: tuple[TensorSpec, ...]
    params: list[torch.Tensor]
    buffers: list[torch.Tensor]
    optimizer_state: dict[str, Any]


def load_latest_checkpoint(uri: str) -> LoadedCheckpoint | None:
    """Read the checkpoint ``latest`` points at under ``uri``, or None when there is none."""
    fs, root = fsspec.core.url_to_fs(uri)
    latest = _join(root, "checkpoints", "latest")
    if not fs.exists(latest):
        return None
    with fs.open(latest, "r") as f:
        directory = _join(root, "checkpoints", f.read().strip())
    with fs.open(_join(directory, "manifest.json"), "r") as f:
        manifest = json.load(f)
    if manifest.get("format") != _CHECKPOINT_FORMAT:
        raise ValueError(f"checkpoint format ({manifest.get('format')!r}) is not supported")
    with fs.open(_join(directory, "model.safetensors"), "rb") as f:
        model = safetensors.torch.load(f.read())
    with fs.open(_join(directory, "optimizer.safetensors"), "rb") as f:
        opt_tensors = safetensors.torch.load(f.read())
    param_specs = tuple(TensorSpec.from_dict(d) for d in manifest["params"])
    buffer_specs = tuple(TensorSpec.from_dict(d) for d in manifest["buffers"])
    return LoadedCheckpoint(
        completed=int(manifest["completed"]),
        plan=TrainingPlan.from_dict(manifest["plan"]),
        optimizer_spec=OptimizerSpec.from_dict(manifest["optimizer"]),
        param_specs=param_specs,
        buffer_specs=buffer_specs,
        params=[model[f"param/{s.name}"] for s in param_specs],
        buffers=[model[f"buffer/{s.name}"] for s in buffer_specs],
        optimizer_state=_unflatten_optimizer_state(opt_tensors, manifest["optimizer_state"]),
    )


# --------------------------------------------------------------------------------------------
# The local backend
# --------------------------------------------------------------------------------------------


class LocalBackend(SyncBackend):
    """Standalone mode: a world of one, the optimizer stepping in this process.

    It keeps master copies of the parameters (the state a parameter-sync shard would hold),
    so the learner is exercised exactly as on the cluster: gradients out, parameters in.
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
        self._params = [p.detach().clone().requires_grad_(p.requires_grad) for p in setup.params]
        self._buffers = [b.detach().clone() for b in setup.buffers]
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
        self._step = checkpoint.completed
        fs, root = fsspec.core.url_to_fs(self._storage_uri)
        reports = _join(root, "metrics", "epochs.json")
        if fs.exists(reports):
            with fs.open(reports, "r") as f:
                self._reports = [r for r in json.load(f) if r["step"] < self._step]

    def next_assignment(self) -> Assignment | None:
        plan = self._require_plan()
        if self._step >= plan.total_steps:
            return None
        return plan.assignment(self._step)

    def sync(
        self, assignment: Assignment, contribution: Contribution, *, lr: float | None = None
    ) -> SyncResult:
        plan = self._require_plan()
        optimizer = self._optimizer
        assert optimizer is not None
        if assignment.step != self._step or assignment.world_size != 1:
            raise RuntimeError(
                f"assignment (step {assignment.step}, world {assignment.world_size}) does not "
                f"match the local backend (step {self._step}, world 1)"
            )
        if len(contribution.grads) != len(self._params):
            raise ValueError(
                f"contribution has {len(contribution.grads)} gradients, "
                f"expected {len(self._params)}"
            )
        if lr is not None:
            set_learning_rate(optimizer, lr)
        setup = self._setup
        assert setup is not None
        grads = list(contribution.grads)
        grad_norm, skipped = apply_gradient_policy(grads, setup)
        for p, g in zip(self._params, grads, strict=True):
            p.grad = g
        if not skipped:
            optimizer.step()
        for p in self._params:
            p.grad = None
        with torch.no_grad():
            for dst, src in zip(self._buffers, contribution.buffers, strict=True):
                if dst is not src:
                    dst.copy_(src)
        n = contribution.n_samples
        loss = contribution.loss_sum / n if n else math.nan
        step = self._step
        self._step += 1
        if self._storage_uri is not None and plan.is_checkpoint_step(step):
            self._checkpoint(self._step)
        return SyncResult(self._params, self._buffers, step, loss, grad_norm, skipped)

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
            fs.makedirs(_join(root, "final"), exist_ok=True)
            tensors = {
                s.name: t.detach().cpu().contiguous()
                for s, t in zip(
                    (*setup.param_specs, *setup.buffer_specs),
                    (*self._params, *self._buffers),
                    strict=True,
                )
            }
            with fs.open(_join(root, "final", "model.safetensors"), "wb") as f:
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
            fs.makedirs(_join(root, "metrics"), exist_ok=True)
            with fs.open(_join(root, "metrics", "epochs.json"), "w") as f:
                json.dump(self._reports, f, indent=1)

    def _require_plan(self) -> TrainingPlan:
        if self._plan is None:
            raise RuntimeError("initialize() must be called first")
        return self._plan


register_backend(LOCAL_BACKEND, LocalBackend.from_env)
