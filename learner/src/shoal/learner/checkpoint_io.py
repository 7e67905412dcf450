"""Checkpoint I/O: writing and reading a job's checkpoints with fsspec and safetensors.

A checkpoint is a directory of safetensors files (parameters, buffers, optimizer tensors) and
a JSON manifest (plan, specs, optimizer state), published by rewriting ``latest`` last, so a
reader sees either the previous checkpoint or the complete new one. The local backend uses it
to save and resume; it is kept apart so the storage format sits in one place. Split out of
``backend.py``, which re-exports every public name here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
import safetensors.torch
import torch

from shoal.learner.sync_types import OptimizerSpec, TensorSpec, TrainingPlan

# --------------------------------------------------------------------------------------------
# Checkpoints (fsspec + safetensors)
# --------------------------------------------------------------------------------------------

_CHECKPOINT_FORMAT = 1


def join_path(root: str, *parts: str) -> str:
    return "/".join([root.rstrip("/"), *parts])


def _flatten_optimizer_state(
    state_dict: Mapping[str, Any],
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors: dict[str, torch.Tensor] = {}
    plain_state: dict[str, dict[str, Any]] = {}
    for index, entry in state_dict["state"].items():
        plain: dict[str, Any] = {}
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state/{index}/{key}"] = value.detach().cpu().contiguous()
            else:
                plain[key] = value
        plain_state[str(index)] = plain
    meta = {"state": plain_state, "param_groups": state_dict["param_groups"]}
    return tensors, meta


def _unflatten_optimizer_state(
    tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]
) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {int(i): dict(entry) for i, entry in meta["state"].items()}
    for key, value in tensors.items():
        _, index, name = key.split("/", 2)
        state.setdefault(int(index), {})[name] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def save_checkpoint(
    uri: str,
    *,
    completed: int,
    plan: TrainingPlan,
    optimizer_spec: OptimizerSpec,
    param_specs: Sequence[TensorSpec],
    buffer_specs: Sequence[TensorSpec],
    params: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    optimizer: torch.optim.Optimizer,
) -> str:
    """Write the state after ``completed`` iterations under ``uri``/checkpoints/step-NNNNNNNNNN/:
    ``model.safetensors`` (``param/<name>``, ``buffer/<name>``), ``optimizer.safetensors``
    (``state/<index>/<key>``) and, last, ``manifest.json``; then point ``latest`` at it, so
    that ``latest`` never names a partial checkpoint. Returns the checkpoint's path."""
    fs, root = fsspec.core.url_to_fs(uri)
    name = f"step-{completed:010d}"
    directory = join_path(root, "checkpoints", name)
    fs.makedirs(directory, exist_ok=True)
    model = {
        f"param/{s.name}": t.detach().cpu().contiguous()
        for s, t in zip(param_specs, params, strict=True)
    }
    model.update(
        {
            f"buffer/{s.name}": t.detach().cpu().contiguous()
            for s, t in zip(buffer_specs, buffers, strict=True)
        }
    )
    opt_tensors, opt_meta = _flatten_optimizer_state(optimizer.state_dict())
    with fs.open(join_path(directory, "model.safetensors"), "wb") as f:
        f.write(safetensors.torch.save(model))
    with fs.open(join_path(directory, "optimizer.safetensors"), "wb") as f:
        f.write(safetensors.torch.save(opt_tensors))
    manifest = {
        "format": _CHECKPOINT_FORMAT,
        "completed": completed,
        "plan": plan.to_dict(),
        "optimizer": optimizer_spec.to_dict(),
        "params": [s.to_dict() for s in param_specs],
        "buffers": [s.to_dict() for s in buffer_specs],
        "optimizer_state": opt_meta,
    }
    with fs.open(join_path(directory, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    latest, tmp = (
        join_path(root, "checkpoints", "latest"),
        join_path(root, "checkpoints", "latest.tmp"),
    )
    with fs.open(tmp, "w") as f:
        f.write(name)
    fs.mv(tmp, latest)
    return directory


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A checkpoint read back by :func:`load_latest_checkpoint` (tensors on the CPU);
    ``completed`` is the number of iterations whose updates it holds."""

    completed: int
    plan: TrainingPlan
    optimizer_spec: OptimizerSpec
    param_specs: tuple[TensorSpec, ...]
    buffer_specs: tuple[TensorSpec, ...]
    params: list[torch.Tensor]
    buffers: list[torch.Tensor]
    optimizer_state: dict[str, Any]


def load_latest_checkpoint(uri: str) -> LoadedCheckpoint | None:
    """Read the checkpoint ``latest`` points at under ``uri``, or None when there is none."""
    fs, root = fsspec.core.url_to_fs(uri)
    latest = join_path(root, "checkpoints", "latest")
    if not fs.exists(latest):
        return None
    with fs.open(latest, "r") as f:
        directory = join_path(root, "checkpoints", f.read().strip())
    with fs.open(join_path(directory, "manifest.json"), "r") as f:
        manifest = json.load(f)
    if manifest.get("format") != _CHECKPOINT_FORMAT:
        raise ValueError(f"checkpoint format ({manifest.get('format')!r}) is not supported")
    with fs.open(join_path(directory, "model.safetensors"), "rb") as f:
        model = safetensors.torch.load(f.read())
    with fs.open(join_path(directory, "optimizer.safetensors"), "rb") as f:
        opt_tensors = safetensors.torch.load(f.read())
    param_specs = tuple(TensorSpec.from_dict(d) for d in manifest["params"])
    buffer_specs = tuple(TensorSpec.from_dict(d) for d in manifest["buffers"])
    return LoadedCheckpoint(
        completed=int(manifest["completed"]),
        plan=TrainingPlan.from_dict(manifest["plan"]),
        optimizer_spec=OptimizerSpec.from_dict(manifest["optimizer"]),
        param_specs=param_specs,
        buffer_specs=buffer_specs,
        params=[model[f"param/{s.name}"] for s in param_specs],
        buffers=[model[f"buffer/{s.name}"] for s in buffer_specs],
        optimizer_state=_unflatten_optimizer_state(opt_tensors, manifest["optimizer_state"]),
    )
