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

The package is split along these seams, and this module re-exports every public name so
``from shoal.learner.backend import ...`` keeps working:

- :mod:`shoal.learner.sync_types` — the values exchanged (specs, plan, assignments, results);
- :mod:`shoal.learner.gradients` — the weighting rule and the gradient policy;
- :mod:`shoal.learner.interface` — :class:`SyncBackend` and the backend registry;
- :mod:`shoal.learner.checkpoint_io` — checkpoint writing and reading (fsspec + safetensors);
- :mod:`shoal.learner.local_backend` — :class:`LocalBackend`, registered as ``"local"`` on
  import (which importing this module does).
"""

from __future__ import annotations

from shoal.learner.checkpoint_io import (
    LoadedCheckpoint as LoadedCheckpoint,
    load_latest_checkpoint,
    save_checkpoint,
)
from shoal.learner.gradients import (
    apply_gradient_policy,
    global_grad_norm,
    reduce_contributions,
)
from shoal.learner.interface import (
    ENTRY_POINT_GROUP,
    BackendFactory,
    SyncBackend,
    create_backend,
    get_backend,
    register_backend,
    registered_backends,
)
from shoal.learner.local_backend import LocalBackend
from shoal.learner.sync_types import (
    Assignment,
    Contribution,
    EpochReport,
    InitialState,
    IterationAborted,
    ModelState,
    OptimizerLike,
    OptimizerSpec,
    SyncResult,
    TensorSpec,
    TrainingPlan,
    TrainingSetup,
    set_learning_rate,
)

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
