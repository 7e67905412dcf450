"""The weighting rule every sync backend implements, and the gradient policy (clipping, the
non-finite guard) applied before a contribution leaves the learner.

:func:`reduce_contributions` is the reference the parameter-sync shards are tested against;
it lives apart from the backends so each of them, and the tests, share the one definition.
Split out of ``backend.py``, which re-exports every public name here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from shoal.learner.sync_types import Contribution, TrainingSetup

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


def has_gradient_policy(setup: TrainingSetup) -> bool:
    """Whether :func:`apply_gradient_policy` has anything to do for ``setup``: clipping,
    skipping a non-finite gradient, or measuring the norm."""
    return setup.clip_grad_norm is not None or setup.skip_nonfinite or setup.measure_grad_norm


def apply_gradient_policy(
    grads: Sequence[torch.Tensor | None], setup: TrainingSetup
) -> tuple[float | None, bool]:
    """Apply ``setup``'s clipping to the *global* (already reduced) gradient ``grads`` in
    place, as ``torch.nn.utils.clip_grad_norm_(params, max_norm)`` would on one process:
    multiply every gradient by ``min(1, max_norm / (norm + 1e-6))``.

    Returns ``(norm before clipping, skip)``: ``skip`` is true when ``setup.skip_nonfinite``
    and the norm is not finite (an inf/NaN anywhere), in which case the caller must not step
    the optimizer, as ``torch.amp.GradScaler.step`` skips it. Without clipping or skipping the
    gradient is left alone and the norm is not computed (``(None, False)``) unless
    ``setup.measure_grad_norm``."""
    if not has_gradient_policy(setup):
        return None, False  # (before entering no_grad: this is every iteration's common case)
    return _clip_or_skip(grads, setup)


@torch.no_grad()
def _clip_or_skip(grads: Sequence[torch.Tensor | None], setup: TrainingSetup) -> tuple[float, bool]:
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
