"""The :class:`SyncBackend` interface and the registry that picks a backend by name.

The interface is the contract between the trainer and whatever synchronizes it (the order of
calls is shown in ``backend.py``'s docstring); the registry (:func:`register_backend`,
:func:`get_backend`, the ``shoal.learner.backends`` entry points) lets the trainer choose a
backend from ``SHOAL_SYNC_BACKEND`` without importing it. Split out of ``backend.py``, which
re-exports every public name here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, TypeAlias

from shoal.learner.env import LearnerEnv
from shoal.learner.sync_types import (
    Assignment,
    Contribution,
    EpochReport,
    InitialState,
    ModelState,
    SyncResult,
    TrainingSetup,
)

if TYPE_CHECKING:
    from shoal.learner.overlap import GradientHooks

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
        and the final model at the end of the job. A backend may return before the new
        tensors are all in, with ``SyncResult.arriving`` saying which are (the parameter-server
        backend with ``SHOAL_PS_EARLY_FORWARD=on``, ``early_forward.py``); it must then wait
        for them to have ended before its next ``sync`` or pull sends or receives anything."""

    def overlap_hooks(self, params: Sequence[Any]) -> GradientHooks | None:
        """Optional: hooks on the model's ``params`` (``nn.Parameter``, in spec order) that
        send gradients while backward runs; the trainer hands them to
        :func:`~shoal.learner.steps.compute_contribution` and calls their ``remove()`` at the
        end. None (the default): the gradients leave in :meth:`sync`. Called once, after
        :meth:`initialize`."""
        return None

    def vote_ahead(self, allowed: bool) -> None:  # noqa: B027 - optional hook
        """Whether :meth:`sync` may return before the coordinator answered the iteration,
        with its update applied ahead, and :meth:`next_assignment` give the next iteration
        before that answer (collective mode: docs/data-plane.md, "The vote ahead"). The
        trainer allows it when nothing but the next iteration's forward and backward reads
        the model or the result before the next :meth:`sync` (no callback's
        ``on_iteration_end``, no float16 loss scaling, no adaptive batch); a :meth:`sync`
        that finds the answer differs raises :class:`IterationAborted` with ``ahead``. Not
        allowed until called."""

    def pull_parameters(self) -> ModelState:
        """The job's current parameters and buffers, fetched when an assignment says
        ``pull_parameters`` (and before the first iteration when :meth:`initialize` returned
        none). Backends that never defer the state need not implement it."""
        raise NotImplementedError(f"{type(self).__name__} cannot pull parameters")

    def report_epoch(self, report: EpochReport) -> None:  # noqa: B027 - optional hook
        """Record an end-of-epoch evaluation (metrics storage, the job's status)."""

    def log_metrics(  # noqa: B027 - optional hook
        self, step: int, metrics: Mapping[str, tuple[float, int]]
    ) -> None:
        """The script's ``trainer.log`` values of ``step`` (name -> (sum of value x samples,
        samples)), called before :meth:`sync` of that step: sent with this learner's report of
        it. Backends without a coordinator keep nothing (the trainer's history has them)."""

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
