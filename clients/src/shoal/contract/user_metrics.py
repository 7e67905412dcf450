"""The rule for metric names a training script logs (``trainer.log``), shared by the learner
that checks them before sending and the coordinator that checks what it receives.

This module imports neither grpc nor torch.
"""

from __future__ import annotations

import re

__all__ = ["MAX_NAMES", "NAME_PATTERN", "NAME_RULE"]

#: At most this many names per learner per iteration.
MAX_NAMES = 32
#: A name: 1-64 characters of ``[A-Za-z0-9_./-]``.
NAME_PATTERN = re.compile(r"[A-Za-z0-9_./-]{1,64}")
NAME_RULE = "1-64 characters of [A-Za-z0-9_./-]"
