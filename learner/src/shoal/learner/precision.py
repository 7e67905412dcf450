"""Mixed precision for the trainer: :class:`MixedPrecision` (the autocast dtype and the loss
scaling settings) and the learner's dynamic loss scale (``GradScaler``'s rule, on the host).

Kept apart from the loop as a self-contained setting with its own validation; ``trainer.py``
re-exports :class:`MixedPrecision`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_AMP_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class MixedPrecision:
    """Mixed precision: the forward pass and the loss under ``torch.autocast(dtype)``.

    With ``float16`` the loss is scaled dynamically as ``torch.amp.GradScaler`` does, with the
    same defaults and update rule: gradients are unscaled on each learner before they are
    synchronized (the shards or the all-reduce see true gradients), an iteration whose global
    gradient holds an inf/NaN is skipped by every learner alike, and the scale then shrinks
    by ``backoff_factor``; after ``growth_interval`` good iterations it grows by
    ``growth_factor``. ``bfloat16`` has float32's range and needs no scaling.
    """

    dtype: str = "bfloat16"
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        if self.dtype not in _AMP_DTYPES:
            raise ValueError(f"amp dtype ({self.dtype!r}) must be one of {sorted(_AMP_DTYPES)}")
        for name in ("init_scale", "growth_factor"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"amp {name} ({value!r}) must be a finite number > 0")
        if not isinstance(self.backoff_factor, (int, float)) or not 0 < self.backoff_factor < 1:
            raise ValueError(f"amp backoff_factor ({self.backoff_factor!r}) must be in (0, 1)")
        if (
            isinstance(self.growth_interval, bool)
            or not isinstance(self.growth_interval, int)
            or self.growth_interval < 1
        ):
            raise ValueError(f"amp growth_interval ({self.growth_interval!r}) must be an int >= 1")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _AMP_DTYPES[self.dtype]

    @property
    def scaling(self) -> bool:
        """Whether the loss is scaled (float16)."""
        return self.dtype == "float16"

    @classmethod
    def parse(cls, amp: MixedPrecision | str | torch.dtype | None) -> MixedPrecision | None:
        """``None``, ``"bfloat16"``/``"float16"``, ``torch.bfloat16``/``torch.float16``, or a
        :class:`MixedPrecision`."""
        if amp is None or isinstance(amp, MixedPrecision):
            return amp
        if isinstance(amp, torch.dtype):
            name = str(amp).removeprefix("torch.")
            if name not in _AMP_DTYPES:
                raise ValueError(f"amp ({amp!r}) must be torch.bfloat16 or torch.float16")
            return cls(name)
        if isinstance(amp, str):
            return cls(amp)
        raise ValueError(
            f"amp ({amp!r}) must be None, 'bfloat16', 'float16', a torch dtype or MixedPrecision"
        )


class LossScaler:
    """The dynamic loss scale of one learner (``GradScaler``'s update rule, on the host)."""

    def __init__(self, amp: MixedPrecision) -> None:
        self.amp = amp
        self.scale = float(amp.init_scale)
        self.growth_tracker = 0

    def update(self, skipped: bool) -> None:
        if skipped:
            self.scale *= self.amp.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.amp.growth_interval:
            self.scale *= self.amp.growth_factor
            self.growth_tracker = 0
