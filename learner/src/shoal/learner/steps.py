"""The building blocks of one learner iteration: fetching a batch, the mean gradient over a
share (micro-batched), evaluation, the model's persistent buffers and its optimizer groups.

Pure functions of a model and data, no backend and no loop: the trainer calls them, and tests
and backends that simulate learners use them directly. ``trainer.py`` re-exports the public
ones (:func:`fetch_batch`, :func:`compute_contribution`, :func:`evaluate`,
:func:`persistent_buffers`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias

import torch
from torch import nn
from torch.utils.data import Dataset, Subset, TensorDataset, default_collate

from shoal.learner import partition
from shoal.learner.backend import Contribution, OptimizerSpec
from shoal.learner.loader import BatchFetcher
from shoal.learner.metrics import MetricsFn, classification_metrics
from shoal.learner.overlap import GradientHooks
from shoal.learner.user_metrics import MetricLog

#: A mean-reduced loss: ``(output, target) -> scalar``.
LossFn: TypeAlias = Callable[[Any, Any], torch.Tensor]


def fetch_batch(dataset: Dataset[Any], indices: torch.Tensor, *, pin: bool = False) -> Any:
    """The samples ``indices`` of ``dataset`` as one collated batch. ``TensorDataset`` (and a
    ``Subset`` of one) is indexed in one vectorized operation; other datasets go through
    ``__getitems__`` when they have it, else item by item, then ``default_collate``.

    ``pin`` (a CUDA learner): a ``TensorDataset``'s host tensors are gathered straight into
    pinned memory (the same values), so that their copy to the device is asynchronous: a copy
    from pageable memory first waits for the work queued on the device (the last
    iteration's optimizer step)."""
    if isinstance(dataset, Subset) and isinstance(dataset.dataset, TensorDataset):
        mapped = torch.tensor([dataset.indices[i] for i in indices.tolist()], dtype=torch.int64)
        return tuple(t[mapped] for t in dataset.dataset.tensors)
    if isinstance(dataset, TensorDataset):
        if pin:
            return tuple([_gather_pinned(t, indices) for t in dataset.tensors])
        return tuple([t[indices] for t in dataset.tensors])
    positions = indices.tolist()
    getitems = getattr(dataset, "__getitems__", None)
    items = getitems(positions) if getitems is not None else [dataset[i] for i in positions]
    return default_collate(items)


def _gather_pinned(t: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``t[indices]`` (rows), in pinned memory when ``t`` is on the host."""
    if t.device.type != "cpu":
        return t[indices]
    out = torch.empty((indices.numel(), *t.shape[1:]), dtype=t.dtype, pin_memory=True)
    return torch.index_select(t, 0, indices, out=out)


def to_device(batch: Any, device: torch.device) -> Any:
    if type(batch) is tuple:  # the common case (a TensorDataset's batch already there): as it is
        for b in batch:
            if type(b) is not torch.Tensor or b.device != device:
                break
        else:
            return batch
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def split_batch(batch: Any) -> tuple[Any, Any]:
    if not isinstance(batch, (list, tuple)) or len(batch) != 2:
        raise ValueError("dataset items must be (input, target) pairs")
    return batch[0], batch[1]


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers that travel with the gradients: the persistent ones (those in the model's
    ``state_dict``, e.g. BatchNorm running statistics), in ``named_buffers`` order."""
    named = list(model.named_buffers())
    if not named:  # no buffer at all (e.g. an MLP): no state_dict to build, every iteration
        return []
    keys = set(model.state_dict(keep_vars=True))
    return [(name, b) for name, b in named if name in keys]


@dataclasses.dataclass(frozen=True)
class ModelTensors:
    """A model's parameters (``named_parameters`` order) and persistent buffers
    (:func:`persistent_buffers`), listed once: walking the module tree for them costs more
    than a small model's whole iteration. Valid while the model's modules and parameters are
    not replaced (the job's layout is fixed for a training run anyway)."""

    params: list[torch.Tensor]
    buffers: list[torch.Tensor]

    @classmethod
    def of(cls, model: nn.Module) -> ModelTensors:
        return cls(
            [p for _, p in model.named_parameters()], [b for _, b in persistent_buffers(model)]
        )

    def zero_grad(self) -> None:
        """What ``model.zero_grad(set_to_none=True)`` does."""
        for p in self.params:
            p.grad = None


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are views of the same memory (a backend may hand back the
    model's own tensors, as the collective one does)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def compute_contribution(
    model: nn.Module,
    loss_fn: LossFn,
    dataset: Dataset[Any],
    indices: torch.Tensor,
    *,
    max_per_device: int | None = None,
    device: torch.device | str | None = None,
    autocast_dtype: torch.dtype | None = None,
    loss_scale: float | None = None,
    fetcher: BatchFetcher | None = None,
    metrics: MetricLog | None = None,
    hooks: GradientHooks | None = None,
    tensors: ModelTensors | None = None,
    forward_check: Callable[[torch.Tensor], bool] | None = None,
) -> Contribution:
    """Run forward and backward over the share ``indices`` of ``dataset`` and return this
    learner's :class:`Contribution`: the mean gradient over the share, its size, the sum of
    the per-sample losses, and the buffers.

    ``loss_fn`` must return the mean over its batch (e.g. ``nn.CrossEntropyLoss()``). When the
    share exceeds ``max_per_device`` it is split by :func:`partition.micro_batches` and each
    micro-batch of ``m`` of the share's ``n`` samples backpropagates ``loss * m / n``, so the
    accumulated gradient is the mean over the whole share. (With BatchNorm, micro-batches see
    their own batch statistics, as on any device that cannot hold the whole share.)

    With ``autocast_dtype`` the forward pass and the loss run under ``torch.autocast`` of that
    dtype. With ``loss_scale`` (float16) the backward pass runs on ``loss * loss_scale`` and the
    gradients are unscaled before they are returned (multiplied by ``1 / loss_scale``, as
    ``GradScaler.unscale_`` does), so the backend always receives unscaled gradients; an
    overflow shows as inf/NaN in them. (The trainer passes the job's scale times the share's
    fraction of the global batch, so that each sample's term is scaled as on one process.)
    With ``fetcher`` the micro-batches are fetched by its worker processes (the same samples,
    prefetched). With ``metrics``, what the loss function or the model logs (``trainer.log``)
    during a micro-batch is weighted by that micro-batch's sample count. With ``hooks`` (a
    backend's :meth:`~shoal.learner.interface.SyncBackend.overlap_hooks`) the gradient leaves
    during the last micro-batch's backward: they are begun here, armed just before that
    backward (with ``n`` and the loss scale's inverse) and finished after it, before the
    gradients are unscaled. ``tensors``: the model's :class:`ModelTensors`, when the caller
    keeps them (else they are listed here). ``forward_check`` (early forward,
    ``early_forward.py``) is called with the first micro-batch's loss before its backward;
    when it returns True the model was reloaded and that forward runs again (what it logged is
    dropped), and the check is called once more with the new loss.
    """
    if tensors is None:
        tensors = ModelTensors.of(model)
    params = tensors.params
    if not isinstance(device, torch.device):  # (the trainer's already is one)
        device = torch.device(device) if device is not None else params[0].device
    tensors.zero_grad()
    n = int(indices.numel())
    if hooks is not None:
        hooks.begin()
    if n == 0:
        if hooks is not None:
            hooks.finish()  # an empty share still takes part in every collective (zeros)
        return Contribution([None] * len(params), 0, 0.0, list(tensors.buffers))
    inv_scale = (
        None
        if loss_scale is None
        else torch.tensor(1.0 / loss_scale, dtype=torch.float32, device=device)
    )
    # The sum of the per-sample losses in float64: a Python float on the CPU (no tensor op per
    # micro-batch; the same value), a device tensor elsewhere (no sync per micro-batch).
    on_cpu = device.type == "cpu"
    loss_sum: Any = 0.0 if on_cpu else torch.zeros((), dtype=torch.float64, device=device)
    chunks = partition.micro_batches(indices, max_per_device)
    fetched = None if fetcher is None else iter(fetcher.batches(chunks))
    last = len(chunks) - 1
    pin = device.type == "cuda"
    for index, chunk in enumerate(chunks):
        batch = fetch_batch(dataset, chunk, pin=pin) if fetched is None else next(fetched)
        inputs, targets = split_batch(to_device(batch, device))
        m = n if last == 0 else int(chunk.numel())
        if metrics is not None:
            metrics.chunk = m
        try:
            loss = (
                loss_fn(model(inputs), targets)
                if autocast_dtype is None
                else _forward(model, loss_fn, inputs, targets, device, autocast_dtype)
            )
            if index == 0 and forward_check is not None and forward_check(loss):
                if metrics is not None:
                    metrics.begin_step()  # the first micro-batch's logs: of the dropped forward
                loss = _forward(model, loss_fn, inputs, targets, device, autocast_dtype)
                forward_check(loss)  # on the complete model now (it only looks)
        finally:
            if metrics is not None:
                metrics.chunk = None
        scaled = loss if loss_scale is None else loss * loss_scale
        if hooks is not None and index == last:
            hooks.arm(n, inv_scale)  # the last backward: the gradient becomes final
        (scaled if m == n else scaled * (m / n)).backward()
        if on_cpu:
            loss_sum += loss.item() * m
        else:
            loss_sum += loss.detach().to(torch.float64) * m
    if hooks is not None:
        hooks.finish()
    grads = [p.grad for p in params]
    if inv_scale is not None:
        with torch.no_grad():
            for g in grads:
                if g is not None:
                    g.mul_(inv_scale.to(g.dtype))
    return Contribution(grads, n, float(loss_sum), list(tensors.buffers))


def _forward(
    model: nn.Module,
    loss_fn: LossFn,
    inputs: Any,
    targets: Any,
    device: torch.device,
    autocast_dtype: torch.dtype | None,
) -> torch.Tensor:
    if autocast_dtype is None:
        return loss_fn(model(inputs), targets)
    with torch.autocast(device.type, dtype=autocast_dtype):
        return loss_fn(model(inputs), targets)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loss_fn: LossFn,
    dataset: Dataset[Any],
    *,
    batch_size: int = 1024,
    device: torch.device | str | None = None,
    metrics: MetricsFn | None = classification_metrics,
) -> tuple[float, dict[str, float]]:
    """Mean loss and metrics of ``model`` (in eval mode) over the whole of ``dataset``."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    n = len(dataset)  # type: ignore[arg-type]
    was_training = model.training
    model.eval()
    try:
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        outputs: list[torch.Tensor] = []
        targets: list[torch.Tensor] = []
        for start in range(0, n, batch_size):
            idx = torch.arange(start, min(start + batch_size, n))
            inputs, target = split_batch(to_device(fetch_batch(dataset, idx), device))
            output = model(inputs)
            loss_sum += loss_fn(output, target).to(torch.float64) * idx.numel()
            if metrics is not None:
                outputs.append(output.detach().cpu())
                targets.append(target.detach().cpu())
    finally:
        model.train(was_training)
    loss = float(loss_sum) / n if n else math.nan
    values: dict[str, float] = {}
    if metrics is not None and outputs:
        values = {k: float(v) for k, v in metrics(torch.cat(outputs), torch.cat(targets)).items()}
    return loss, values


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def with_param_groups(
    spec: OptimizerSpec,
    model: nn.Module,
    param_groups: Callable[[nn.Module], Sequence[Mapping[str, Any]]],
) -> OptimizerSpec:
    """``spec`` with the groups ``param_groups(model)`` returns, by parameter name."""
    if not callable(param_groups):
        raise ValueError(f"param_groups ({param_groups!r}) must be a function of the model")
    names = {id(p): n for n, p in model.named_parameters()}
    known = set(names.values())
    groups = []
    for i, group in enumerate(param_groups(model)):
        if not isinstance(group, Mapping) or "params" not in group:
            raise ValueError(f"param group {i} ({group!r}) must be a dict with 'params'")
        params = group["params"]
        if isinstance(params, (torch.Tensor, str)):
            params = [params]
        group_names = []
        for p in params:
            name = p if isinstance(p, str) else names.get(id(p))
            if name is None or name not in known:
                shown = p if isinstance(p, str) else f"tensor of shape {tuple(p.shape)}"
                raise ValueError(f"param group {i} holds {shown!r}, not a parameter of the model")
            group_names.append(name)
        overrides = {k: v for k, v in group.items() if k != "params"}
        groups.append((tuple(group_names), overrides))
    spec = dataclasses.replace(spec, groups=tuple(groups))
    # Validate on stand-ins of the model's parameters (the real ones are not touched).
    named = list(model.named_parameters())
    spec.create([torch.zeros(1, requires_grad=True) for _ in named], [n for n, _ in named])
    return spec
