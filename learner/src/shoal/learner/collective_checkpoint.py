"""The checkpoint file of a collective-mode learner: its whole state (parameters, buffers,
optimizer state) as the parameter-sync shard file of index 0, in the parameter-server
checkpoint format, so that checkpoints of either mode restore in either mode; and the restore
of such a checkpoint (of either mode: its manifest lists the files) into a learner's tensors.

Pure functions of the tensors and the optimizer they are given (no process group, no RPC);
:class:`shoal.learner.collective.CollectiveBackend` calls them.
"""

from __future__ import annotations

import errno
import hashlib
import json
from collections.abc import Sequence
from typing import Any

import fsspec
import safetensors.torch
import torch

from shoal.contract import faults
from shoal.contract.files import atomic_write
from shoal.learner.backend import TrainingSetup
from shoal.v1 import parameter_sync_service_pb2 as ps_pb2

__all__ = [
    "CHECKPOINT_FILE",
    "encode_checkpoint",
    "load_checkpoint",
    "state_order",
    "write_checkpoint_file",
]

CHECKPOINT_FILE = "shard-0.safetensors"  # the parameter-sync shard file name of index 0


def state_order(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> list[int]:
    """For each index of ``optimizer.state_dict()`` (parameters numbered group after group),
    the spec index of that parameter (the identity without param groups)."""
    position = {id(p): j for j, p in enumerate(params)}
    return [position[id(p)] for g in optimizer.param_groups for p in g["params"]]


def encode_checkpoint(
    setup: TrainingSetup,
    params: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    *,
    job_id: str,
    iteration: int,
) -> bytes:
    """The safetensors bytes of the state after ``iteration`` iterations (every tensor, the
    optimizer's groups and plain state in the metadata)."""
    tensors: dict[str, torch.Tensor] = {}
    for spec, t in zip(setup.param_specs, params, strict=True):
        tensors[f"param/{spec.name}"] = t.detach().cpu().clone().contiguous()
    for spec, t in zip(setup.buffer_specs, buffers, strict=True):
        tensors[f"buffer/{spec.name}"] = t.detach().cpu().clone().contiguous()
    state = optimizer.state_dict()
    order = state_order(optimizer, params)
    plain: dict[str, dict[str, Any]] = {}
    for index, entry in state["state"].items():
        name = setup.param_specs[order[int(index)]].name
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim/{name}/{key}"] = value.detach().cpu().clone().contiguous()
            else:
                plain.setdefault(name, {})[key] = value
    groups = [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]
    metadata = {
        "format": "1",
        "job_id": job_id,
        "shard_index": "0",
        "global_iteration": str(iteration),
        "optimizer": json.dumps(
            {
                "name": setup.optimizer.name,
                "hyperparameters_json": json.dumps(dict(setup.optimizer.kwargs), sort_keys=True),
            }
        ),
        "param_groups": json.dumps(groups),
        "optimizer_plain_state": json.dumps(plain),
    }
    return safetensors.torch.save(tensors, metadata=metadata)


def write_checkpoint_file(directory: str, data: bytes, iteration: int) -> ps_pb2.CheckpointFile:
    """Write ``data`` as the shard file of index 0 in ``directory`` (the manifest, written by
    the coordinator after, is the commit point) and describe it for the coordinator.

    The file is written with ``shoal.contract.files.atomic_write`` (a local file under a
    temporary name, fsynced and renamed; an object store's put is whole), so a reader never
    sees a part of it. A write the storage refuses (a full disk, a
    quota, a read-only mount) leaves nothing behind and comes back as the description's
    ``error``: the learner goes on training and the coordinator decides what becomes of that
    checkpoint."""
    try:
        atomic_write(
            directory.rstrip("/") + "/" + CHECKPOINT_FILE,
            data,
            before_rename=faults.stop_before_rename,  # a test fault point (SHOAL_TEST_FAULT)
        )
    except OSError as exc:
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
        return ps_pb2.CheckpointFile(
            directory=directory,
            file=CHECKPOINT_FILE,
            global_iteration=iteration,
            error=str(exc),
            storage_full=full,
        )
    return ps_pb2.CheckpointFile(
        directory=directory,
        file=CHECKPOINT_FILE,
        size_bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        global_iteration=iteration,
    )


def load_checkpoint(
    directory: str,
    step: int,
    setup: TrainingSetup,
    params: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    optimizer: torch.optim.Optimizer,
) -> None:
    """Copy the state of the checkpoint in ``directory`` (which must hold ``step`` iterations)
    into ``params``, ``buffers`` and ``optimizer``; a file that does not match its manifest or
    a missing tensor raises RuntimeError."""
    fs, root = fsspec.core.url_to_fs(directory)
    manifest = json.loads(fs.cat_file(root.rstrip("/") + "/manifest.json"))
    if int(manifest["iteration"]) != step:
        raise RuntimeError(
            f"checkpoint {directory} holds {manifest['iteration']} iterations, not {step}"
        )
    loaded: dict[str, torch.Tensor] = {}
    groups: list[dict[str, Any]] = []
    plain: dict[str, dict[str, Any]] = {}
    for entry in manifest.get("shards", []):
        data = fs.cat_file(root.rstrip("/") + "/" + entry["file"])
        if len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise RuntimeError(f"{entry['file']} in {directory} does not match its manifest")
        loaded.update(safetensors.torch.load(data))
        meta = _safetensors_metadata(data)
        groups = groups or json.loads(meta.get("param_groups", "[]"))
        plain.update(json.loads(meta.get("optimizer_plain_state", "{}")))
    for kind, specs, dsts in (
        ("param", setup.param_specs, params),
        ("buffer", setup.buffer_specs, buffers),
    ):
        for spec, dst in zip(specs, dsts, strict=True):
            src = loaded.get(f"{kind}/{spec.name}")
            if src is None or tuple(src.shape) != tuple(dst.shape):
                raise RuntimeError(f"checkpoint {directory} lacks {kind} {spec.name!r}")
            dst.copy_(src)
    state: dict[int, dict[str, Any]] = {}
    for i, j in enumerate(state_order(optimizer, params)):
        spec = setup.param_specs[j]
        entry = dict(plain.get(spec.name, {}))
        prefix = f"optim/{spec.name}/"
        entry.update({k[len(prefix) :]: v for k, v in loaded.items() if k.startswith(prefix)})
        if entry:
            state[i] = entry
    # state_dict() numbers the parameters group after group: rebuild that numbering.
    new_groups, start = [], 0
    for g, current in enumerate(optimizer.param_groups):
        saved = groups[g] if g < len(groups) else {}
        count = len(current["params"])
        new_groups.append({**saved, "params": list(range(start, start + count))})
        start += count
    optimizer.load_state_dict({"state": state, "param_groups": new_groups})


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    size = int.from_bytes(data[:8], "little")
    return dict(json.loads(data[8 : 8 + size]).get("__metadata__", {}))
