"""shoal.learner: elastic PyTorch training, standalone or on a shoal cluster.

A script written for one machine changes in a few lines::

    from shoal.learner import ElasticTrainer

    trainer = ElasticTrainer(model, get_datasets, nn.CrossEntropyLoss(),
                             ("SGD", {"lr": 0.1, "momentum": 0.9}))
    result = trainer.train(epochs=10, batch_size=256)

Run as ``python train.py`` it trains in-process (the ``local`` backend); started by a shoal
host-agent it joins its job and synchronizes through the backend the environment names.
"""

from shoal.learner import data, env, partition
from shoal.learner.backend import (
    Assignment,
    BackendFactory,
    Contribution,
    EpochReport,
    InitialState,
    IterationAborted,
    LocalBackend,
    ModelState,
    OptimizerSpec,
    SyncBackend,
    SyncResult,
    TensorSpec,
    TrainingPlan,
    TrainingSetup,
    create_backend,
    get_backend,
    reduce_contributions,
    register_backend,
    registered_backends,
)
from shoal.learner.callbacks import Callback, LoggingCallback
from shoal.learner.env import LearnerEnv
from shoal.learner.metrics import accuracy, classification_metrics
from shoal.learner.trainer import (
    ElasticTrainer,
    EpochResult,
    IterationRecord,
    MixedPrecision,
    TrainResult,
    compute_contribution,
    configure_default_logging,
    evaluate,
)

__all__ = [
    "Assignment",
    "BackendFactory",
    "Callback",
    "Contribution",
    "ElasticTrainer",
    "EpochReport",
    "EpochResult",
    "InitialState",
    "IterationAborted",
    "IterationRecord",
    "LearnerEnv",
    "LocalBackend",
    "LoggingCallback",
    "MixedPrecision",
    "ModelState",
    "OptimizerSpec",
    "SyncBackend",
    "SyncResult",
    "TensorSpec",
    "TrainResult",
    "TrainingPlan",
    "TrainingSetup",
    "accuracy",
    "classification_metrics",
    "compute_contribution",
    "configure_default_logging",
    "create_backend",
    "data",
    "env",
    "evaluate",
    "get_backend",
    "partition",
    "reduce_contributions",
    "register_backend",
    "registered_backends",
]
