"""The optimizer of a parameter-server slice: built from the job's ``OptimizerConfig`` (a
``torch.optim`` class by name, its arguments, the parameter groups by name)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

from shoal.param_sync.coordinator import OptimizerConfig
from shoal.runtime.errors import InvalidField

__all__ = ["FOREACH_SAME", "PER_PARAMETER_OPTIMIZERS", "build_optimizer", "param_groups", "warm_up"]


def _plain(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_plain(v) for v in value)
    return value


# The torch.optim classes whose step updates each parameter from its own gradient and its own
# state only (a step of some parameters then the rest equals one step of all): the commit may
# step them group by group. Any other class (LBFGS's closure, SparseAdam's sparse gradients, a
# class added later) steps the whole slice at once.
PER_PARAMETER_OPTIMIZERS: frozenset[type[torch.optim.Optimizer]] = frozenset(
    {
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adamax,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.Adagrad,
        torch.optim.Adadelta,
        torch.optim.RMSprop,
        torch.optim.Rprop,
        torch.optim.ASGD,
    }
)


# Those of them whose foreach kernels (one kernel per operation over all the tensors) leave
# the bytes of torch's single-tensor step, the CPU's default: the shard steps them with
# foreach unless the job says otherwise. NAdam, RAdam and ASGD's differ in the last bits on
# torch 2.13 (tests/unit/test_shard_grouped_step.py checks both sets).
FOREACH_SAME: frozenset[type[torch.optim.Optimizer]] = PER_PARAMETER_OPTIMIZERS - {
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.ASGD,
}


def param_groups(config: OptimizerConfig) -> list[tuple[list[str], dict[str, Any]]]:
    """The job's parameter groups (``config.param_groups_json``): ``[(names, overrides)]``;
    empty: one group. Anything malformed raises :class:`InvalidField`."""
    text = config.param_groups_json
    if not text:
        return []
    field_name = "optimizer.param_groups_json"
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise InvalidField(field_name, text, f"is not JSON: {exc}") from None
    if not isinstance(data, list):
        raise InvalidField(field_name, text, "must be a list of [names, overrides] pairs")
    groups: list[tuple[list[str], dict[str, Any]]] = []
    seen: set[str] = set()
    for i, group in enumerate(data):
        ok = isinstance(group, list) and len(group) == 2
        names, overrides = group if ok else (None, None)
        if not (
            isinstance(names, list)
            and all(isinstance(n, str) for n in names)
            and isinstance(overrides, dict)
            and "params" not in overrides
        ):
            raise InvalidField(
                field_name, text, f"group {i} must be [parameter names, overrides without params]"
            )
        twice = seen.intersection(names)
        if twice or len(set(names)) != len(names):
            raise InvalidField(field_name, text, f"names a parameter in two groups: {twice}")
        seen.update(names)
        groups.append((names, {k: _plain(v) for k, v in overrides.items()}))
    return groups


def build_optimizer(
    config: OptimizerConfig,
    params: Sequence[torch.Tensor],
    names: Sequence[str] | None = None,
) -> torch.optim.Optimizer:
    """``getattr(torch.optim, name)(params, **json.loads(hyperparameters_json))``; anything
    wrong raises :class:`InvalidField` naming the optimizer and the arguments.

    With parameter groups (``config.param_groups_json``) the optimizer has every group of the
    job, in the job's order, each holding those of ``params`` (named ``names``) it lists (a
    group may be empty on a slice), and a last group with the rest; each group records
    ``lr_scale``, its ``lr`` over the optimizer's, so that a schedule's learning rate keeps
    the groups' ratios (as on the learner, ``OptimizerSpec.create``)."""
    groups = param_groups(config)
    klass = getattr(torch.optim, config.name, None) if config.name else None
    if not (isinstance(klass, type) and issubclass(klass, torch.optim.Optimizer)):
        raise InvalidField(
            "optimizer.name", config.name, "is not an optimizer class in torch.optim"
        )
    try:
        kwargs = json.loads(config.hyperparameters_json or "{}")
    except ValueError as exc:
        raise InvalidField(
            "optimizer.hyperparameters_json", config.hyperparameters_json, f"is not JSON: {exc}"
        ) from None
    if not isinstance(kwargs, dict):
        raise InvalidField(
            "optimizer.hyperparameters_json", config.hyperparameters_json, "must be an object"
        )
    kwargs = {k: _plain(v) for k, v in kwargs.items()}
    if klass in FOREACH_SAME and "foreach" not in kwargs and not kwargs.get("fused"):
        # One kernel per operation over the slice's tensors instead of one per tensor (on the
        # CPU torch's default is the single-tensor loop): the same bytes. A job's own choice
        # stands.
        kwargs["foreach"] = True
    if not params:
        params = [torch.zeros(1, requires_grad=True)]
        names = ["(none)"]
    target: list[Any] = list(params)
    if groups:
        if names is None or len(names) != len(params):
            raise ValueError("an optimizer with param groups needs every parameter's name")
        by_name = dict(zip(names, params, strict=True))
        listed = {n for group_names, _ in groups for n in group_names}
        target = [
            {"params": [by_name[n] for n in group_names if n in by_name], **overrides}
            for group_names, overrides in groups
        ]
        target.append({"params": [p for n, p in by_name.items() if n not in listed]})
    try:
        optimizer = klass(target, **kwargs)
    except (TypeError, ValueError, KeyError) as exc:
        raise InvalidField(
            "optimizer.hyperparameters_json",
            config.hyperparameters_json,
            f"is rejected by torch.optim.{config.name}"
            f"{' with groups ' + config.param_groups_json if groups else ''}: {exc}",
        ) from None
    if groups:
        base = optimizer.defaults.get("lr")
        for group in optimizer.param_groups:
            lr = group.get("lr")
            ok = isinstance(base, (int, float)) and base > 0 and isinstance(lr, (int, float))
            group["lr_scale"] = float(lr) / float(base) if ok else 1.0
    return optimizer


def warm_up() -> None:
    """Build and step an optimizer once: the first one in a process imports torch's compiler
    stack (about 2 s), which must not land on a learner's first Join."""
    param = torch.zeros(1, requires_grad=True)
    param.grad = torch.ones(1)
    build_optimizer(OptimizerConfig("SGD", '{"lr": 0.1, "momentum": 0.9}'), [param]).step()
