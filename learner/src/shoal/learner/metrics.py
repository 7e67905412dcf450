"""Evaluation metrics hooks.

A metrics hook is called once per evaluation with the model's outputs for the whole test set
and the targets (both concatenated, on the CPU) and returns named floats. The mean test loss
is always computed by the trainer; the hook adds the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeAlias

import torch

__all__ = ["MetricsFn", "accuracy", "classification_metrics"]

#: ``(outputs, targets) -> {"name": value}``, called once per evaluation.
MetricsFn: TypeAlias = Callable[[torch.Tensor, torch.Tensor], Mapping[str, float]]


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Fraction of samples whose arg-max logit is the target class."""
    if outputs.dim() != 2 or targets.dim() != 1 or outputs.shape[0] != targets.shape[0]:
        raise ValueError(
            f"accuracy needs outputs (N, C) and targets (N,), got {tuple(outputs.shape)} "
            f"and {tuple(targets.shape)}"
        )
    if targets.numel() == 0:
        return float("nan")
    return (outputs.argmax(dim=1) == targets).double().mean().item()


def classification_metrics(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """The default hook: accuracy when the outputs look like class logits (N, C) and the
    targets like class indices (N,) of an integer dtype; nothing otherwise."""
    if (
        outputs.dim() == 2
        and targets.dim() == 1
        and not targets.is_floating_point()
        and outputs.shape[0] == targets.shape[0]
    ):
        return {"accuracy": accuracy(outputs, targets)}
    return {}
