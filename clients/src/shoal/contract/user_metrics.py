"""The rule for metric names a training script logs (``trainer.log``), shared by the learner
that checks them before sending and the coordinator that checks what it receives.

This module imports neither grpc nor torch.
"""

from __future__ import annotations

import re

__all__ = [
    "COMPUTE_SECONDS",
    "GNS_GRAD_SQ",
    "GNS_TRACE",
    "MAX_NAMES",
    "NAME_PATTERN",
    "NAME_RULE",
    "RESERVED_PREFIX",
    "SYNC_SECONDS",
]

#: At most this many names per learner per iteration.
MAX_NAMES = 32
#: A name: 1-64 characters of ``[A-Za-z0-9_./-]``.
NAME_PATTERN = re.compile(r"[A-Za-z0-9_./-]{1,64}")
NAME_RULE = "1-64 characters of [A-Za-z0-9_./-]"
#: Names with this prefix are shoal's own (a script's ``trainer.log`` may not use them).
RESERVED_PREFIX = "shoal."
#: A learner's seconds computing its share of an iteration (data, forward, backward).
COMPUTE_SECONDS = "shoal.compute_s"
#: A learner's seconds in the gradient sync of its previous iteration in the generation.
SYNC_SECONDS = "shoal.sync_s"
#: An adaptive-batch learner's one-iteration unbiased estimate of the true gradient's squared
#: norm |G|^2 (of its previous iteration; ``shoal.contract.noise_scale``).
GNS_GRAD_SQ = "shoal.gns_grad_sq"
#: The same iteration's unbiased estimate of the per-sample gradient covariance's trace.
GNS_TRACE = "shoal.gns_trace"
