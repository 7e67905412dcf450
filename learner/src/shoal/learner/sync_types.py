"""The values a learner and its sync backend exchange: tensor and optimizer specs, the
training plan, assignments, contributions and results.

They are plain frozen dataclasses with no behaviour beyond validation and (de)serialization,
so every backend (``local``, ``grpc``, ``collective``), the trainer and the checkpoint code
share one definition of what crosses the boundary. Split out of ``backend.py``, which
re-exports every public name here.
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypeAlias

import torch

from shoal.learner import partition
from shoal.learner.frozen_init import fast_frozen_init

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

    @functools.cached_property
    def iterations_per_epoch(self) -> int:
        # (cached: read several times per iteration; the fields are frozen)
        return partition.iterations_per_epoch(self.num_samples, self.batch_size)

    @property
    def total_steps(self) -> int:
        """Iterations of the whole job."""
        return self.epochs * self.iterations_per_epoch

    def check_assignment(self, a: Assignment, *, adaptive: bool = False) -> None:
        """Refuse (RuntimeError) an assignment that does not fit this plan: another batch for a
        job without an adaptive batch, a batch outside the epoch, an epoch past the last."""
        if a.global_batch and a.global_batch != self.batch_size and not adaptive:
            raise RuntimeError(
                f"assignment's global batch ({a.global_batch}) differs from the job's fixed "
                f"batch ({self.batch_size}) but the job has no adaptive batch"
            )
        if adaptive:
            # Positions are kept in samples (shoal.contract.batch_schedule): a batch of at
            # most B inside the epoch, short only at the epoch's end.
            b = a.global_batch or self.batch_size
            ok = a.batch_stop <= self.num_samples and (
                a.batch_size == b or (a.batch_size < b and a.batch_stop == self.num_samples)
            )
            expected = (a.batch_start, a.batch_start + b)
        else:
            expected = self.batch_range(a.iteration)
            ok = (a.batch_start, a.batch_stop) == expected
        if not ok or a.epoch >= self.epochs:
            raise RuntimeError(
                f"assignment (epoch {a.epoch}, iteration {a.iteration}, batch "
                f"[{a.batch_start}, {a.batch_stop})) does not match the plan "
                f"(epochs {self.epochs}, batch {list(expected)})"
            )

    def batch_range(self, iteration: int) -> tuple[int, int]:
        """:func:`partition.batch_range` of this plan: the positions ``[start, stop)`` of
        iteration ``iteration`` (within its epoch). A valid iteration is computed at once (the
        plan's fields were checked when it was built: this runs every iteration); anything
        else goes to ``partition.batch_range``, which raises naming the value."""
        if type(iteration) is int and 0 <= iteration < self.iterations_per_epoch:
            start = iteration * self.batch_size
            return start, min(start + self.batch_size, self.num_samples)
        return partition.batch_range(iteration, self.batch_size, self.num_samples)

    def position(self, step: int) -> tuple[int, int]:
        """``(epoch, iteration within the epoch)`` of global iteration ``step``."""
        return divmod(step, self.iterations_per_epoch)

    def assignment(
        self, step: int, *, rank: int = 0, world_size: int = 1, generation: int = 0
    ) -> Assignment:
        """The assignment of ``rank`` of ``world_size`` for global iteration ``step``."""
        epoch, iteration = divmod(step, self.iterations_per_epoch)
        start, stop = self.batch_range(iteration)
        # (positional: this runs every iteration of the local backend)
        return Assignment(generation, epoch, iteration, step, rank, world_size, start, stop)

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
    #: Compute the global gradient's norm every iteration even without clipping or skipping
    #: (``SyncResult.grad_norm``): an adaptive-batch job measures its gradient noise scale.
    measure_grad_norm: bool = False

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


@fast_frozen_init  # (built every iteration)
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
    is the wire's ``batch_start`` (``iteration * B`` from a coordinator that does not send
    ``global_batch``) and ``batch_stop`` is ``batch_start + batch_samples``; :attr:`share` is
    ``[sample_start, sample_end)``.
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
    #: The global batch B of the iteration (0: the plan's fixed batch). It differs from the
    #: plan's only for a job with an adaptive batch (``shoal.contract.batch_schedule``).
    global_batch: int = 0
    #: The job's measured gradient noise scale frozen for this iteration (0: not measured);
    #: the ADASCALE rule's gain comes from it, the same for every member.
    gradient_noise_scale: float = 0.0

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
        start, w, r = self.batch_start, self.world_size, self.rank
        b = self.batch_stop - start  # (batch_size, without a second property call)
        return start + r * b // w, start + (r + 1) * b // w

    @classmethod
    def retirement(cls, generation: int, step: int) -> Assignment:
        """A RETIRE answer at the boundary before global iteration ``step``."""
        return cls(generation, 0, 0, step, 0, 1, 0, 0, retire=True)


@fast_frozen_init  # (built every iteration)
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


@fast_frozen_init  # (built every iteration)
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
    finite (only with ``skip_nonfinite``: float16 loss scaling).

    ``in_place``: the tensors are the model's own (nothing to copy back). ``arriving``
    (parameter-server mode with ``SHOAL_PS_EARLY_FORWARD=on``): the answers are
    still arriving into ``params`` and ``buffers``; an
    :class:`~shoal.learner.early_forward.ArrivingTensors` says which tensors are complete
    (the trainer loads them as they are: ``early_forward.py``). None: they are complete."""

    params: Sequence[torch.Tensor]
    buffers: Sequence[torch.Tensor]
    step: int
    loss: float | None = None
    grad_norm: float | None = None
    skipped: bool = False
    arriving: Any = None
    #: ``params`` and ``buffers`` are the model's own tensors, stepped in place (the local
    #: backend): there is nothing to load.
    in_place: bool = False


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
    which re-issues the same iteration to the survivors with new ranks.

    ``ahead``: the iteration ran on an assignment given ahead of the answer to the last vote
    (:meth:`SyncBackend.vote_ahead`), and that answer said otherwise; the backend put the
    model's buffers in the state the next assignment runs on. ``taken_back``: that answer
    did not commit iteration ``taken_back`` either, whose update the backend had applied
    ahead and took back (the trainer forgets that it completed it)."""

    def __init__(self, *args: object, ahead: bool = False, taken_back: int | None = None):
        super().__init__(*args)
        self.ahead = ahead
        self.taken_back = taken_back
