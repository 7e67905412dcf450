# mypy: disable-error-code="misc"
# (the methods annotate self as ShardJob, the class they are part of)
"""A slice's checkpoint file (part of :class:`~shoal.param_sync.shard.ShardJob`): its whole
state as one safetensors blob, written into a checkpoint directory or handed to a replica, and
the restores from a checkpoint (of any number of shards), from the slices a promotion merges,
or from a replica's blob; and the whole model read back from a checkpoint's shard files."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import safetensors.torch
import torch

from shoal.param_sync.checkpoint import (
    StorageError,
    atomic_write,
    join_uri,
    read_bytes,
    read_manifest,
    sha256_hex,
)
from shoal.runtime.errors import FailedPrecondition, InvalidField, NotFound

if TYPE_CHECKING:
    from shoal.contract.wire import TensorMeta
    from shoal.param_sync.shard import ShardJob

__all__ = ["ShardCheckpoints", "model_from_shard_files", "shard_file_name"]


def shard_file_name(shard_index: int) -> str:
    return f"shard-{shard_index}.safetensors"


class ShardCheckpoints:
    """Part of :class:`~shoal.param_sync.shard.ShardJob` (see there)."""

    # -- checkpoints --------------------------------------------------------------------------

    def save(self: ShardJob, directory: str, global_iteration: int) -> tuple[str, int, str]:
        """Write ``shard-<i>.safetensors`` into ``directory``: ``param/<name>``,
        ``buffer/<name>``, ``optim/<name>/<key>`` tensors; non-tensor optimizer state and the
        param groups as JSON metadata. Returns (uri, size, sha256)."""
        data = self.state_bytes(global_iteration)
        uri = join_uri(directory, shard_file_name(self.shard_index))
        atomic_write(uri, data)
        return uri, len(data), sha256_hex(data)

    def state_bytes(self: ShardJob, global_iteration: int) -> bytes:
        """The slice's whole state as one safetensors blob (the checkpoint file's format):
        ``param/<name>``, ``buffer/<name>``, ``optim/<name>/<key>``, JSON metadata."""
        tensors, metadata = self.state_parts(global_iteration)
        copies = {name: t.detach().clone().contiguous() for name, t in tensors.items()}
        return safetensors.torch.save(copies, metadata=metadata)

    def state_parts(
        self: ShardJob, global_iteration: int
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """The tensors of :meth:`state_bytes` (the slice's own, not copies) and its metadata;
        a replica steps the sums it deferred first."""
        if not self.initialized:
            raise FailedPrecondition(
                f"shard {self.shard_index} of job {self.job_id!r} has no parameters yet"
            )
        if global_iteration != self.completed:
            raise FailedPrecondition(
                f"global_iteration ({global_iteration}) is not shard {self.shard_index}'s "
                f"({self.completed}) for job {self.job_id!r}"
            )
        self.flush()
        tensors: dict[str, torch.Tensor] = {}
        for m, t in zip(self.metas, self.tensors, strict=True):
            tensors[_state_key(m)] = t
        state = self.optimizer.state_dict()
        plain: dict[str, dict[str, Any]] = {}
        for index, entry in state["state"].items():
            name = self.metas[self.param_indices[self._optimizer_order[int(index)]]].name
            for key, value in entry.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"optim/{name}/{key}"] = value
                else:
                    plain.setdefault(name, {})[key] = value
        groups = [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]
        metadata = {
            "format": "1",
            "job_id": self.job_id,
            "shard_index": str(self.shard_index),
            "global_iteration": str(self.completed),
            "optimizer": json.dumps(
                {
                    "name": self.optimizer_config.name,
                    "hyperparameters_json": self.optimizer_config.hyperparameters_json,
                    "param_groups_json": self.optimizer_config.param_groups_json,
                }
            ),
            "param_groups": json.dumps(groups),
            "optimizer_plain_state": json.dumps(plain),
        }
        return tensors, metadata

    def load(self: ShardJob, directory: str) -> int:
        """Restore this shard's tensors and optimizer state from the checkpoint in
        ``directory`` (its manifest says which files hold which tensors, so a checkpoint
        written with another number of shards loads too). Returns the iteration."""
        manifest = read_manifest(directory)
        if manifest is None:
            raise NotFound("checkpoint", directory)
        wanted = set(self.index)
        loaded: dict[str, torch.Tensor] = {}
        groups: list[dict[str, Any]] | None = None
        plain: dict[str, dict[str, Any]] = {}
        for entry in manifest.get("shards", []):
            if not wanted & set(entry.get("tensors", [])):
                continue
            uri = join_uri(directory, entry["file"])
            data = read_bytes(uri)
            if data is None:
                raise StorageError(f"{uri} is missing from checkpoint {directory}")
            if len(data) != entry["size"] or sha256_hex(data) != entry["sha256"]:
                raise StorageError(f"{uri} does not match its manifest (size or sha256)")
            tensors = safetensors.torch.load(data)
            meta = _safetensors_metadata(data)
            if int(meta.get("global_iteration", -1)) != int(manifest["iteration"]):
                raise StorageError(f"{uri} holds another iteration than the manifest")
            loaded.update(tensors)
            if groups is None:
                groups = json.loads(meta.get("param_groups", "[]"))
            plain.update(json.loads(meta.get("optimizer_plain_state", "{}")))
        return self._restore(loaded, groups, plain, int(manifest["iteration"]), directory)

    def absorb(self: ShardJob, blobs: Sequence[bytes]) -> int:
        """A promotion: restore this (new, larger) slice from the :meth:`state_bytes` blobs of
        the slices it is made of (this shard's own and the replicas it kept), all at the same
        iteration. Returns the iteration."""
        loaded: dict[str, torch.Tensor] = {}
        plain: dict[str, dict[str, Any]] = {}
        groups: list[dict[str, Any]] | None = None
        iterations = set()
        for data in blobs:
            try:
                loaded.update(safetensors.torch.load(data))
                meta = _safetensors_metadata(data)
                iterations.add(int(meta["global_iteration"]))
                if groups is None:
                    groups = json.loads(meta.get("param_groups", "[]"))
                plain.update(json.loads(meta.get("optimizer_plain_state", "{}")))
            except Exception as exc:
                raise InvalidField("slices", len(blobs), f"holds no slice: {exc}") from None
        if len(iterations) != 1:
            raise FailedPrecondition(f"slices to merge are at iterations {sorted(iterations)}")
        return self._restore(loaded, groups, plain, iterations.pop(), "the merged slices")

    def load_state_bytes(self: ShardJob, data: bytes) -> int:
        """Restore the whole slice from a :meth:`state_bytes` blob (a replica, or a shard being
        restored from one). Returns the iteration."""
        try:
            loaded = safetensors.torch.load(data)
            meta = _safetensors_metadata(data)
            iteration = int(meta["global_iteration"])
            groups = json.loads(meta.get("param_groups", "[]"))
            plain = json.loads(meta.get("optimizer_plain_state", "{}"))
        except Exception as exc:
            raise InvalidField("chunk", f"{len(data)} bytes", f"is not a slice: {exc}") from None
        return self._restore(loaded, groups, plain, iteration, "the replicated slice")

    def check_loaded(self: ShardJob, loaded: dict[str, torch.Tensor], directory: str) -> None:
        """:class:`InvalidField` (naming ``directory``, where ``loaded`` came from) unless
        ``loaded`` holds every parameter and buffer of the slice with its shape and dtype:
        checked before anything is restored, so a wrong state changes nothing."""
        missing = []
        for m in self.metas:
            key = _state_key(m)
            src = loaded.get(key)
            if src is None:
                missing.append(m.name)
            elif tuple(src.shape) != m.shape or src.dtype != m.torch_dtype:
                raise InvalidField(
                    "directory", directory, f"holds {key} as {src.dtype} {list(src.shape)}"
                )
        if missing:
            raise InvalidField("directory", directory, f"lacks tensors {missing[:5]}")

    def _restore(
        self: ShardJob,
        loaded: dict[str, torch.Tensor],
        groups: list[dict[str, Any]] | None,
        plain: dict[str, dict[str, Any]],
        iteration: int,
        directory: str,
    ) -> int:
        self.check_loaded(loaded, directory)
        with torch.no_grad():
            for m, t in zip(self.metas, self.tensors, strict=True):
                t.copy_(loaded[_state_key(m)])
        state: dict[int, dict[str, Any]] = {}
        for index, local in enumerate(self._optimizer_order):
            name = self.metas[self.param_indices[local]].name
            entry = dict(plain.get(name, {}))
            prefix = f"optim/{name}/"
            for key, value in loaded.items():
                if key.startswith(prefix):
                    entry[key[len(prefix) :]] = value
            if entry:
                state[index] = entry
        if self.params and self.optimizer_config.param_groups_json:
            # The groups' hyper-parameters are the job's (the learning rate is set at every
            # commit): kept as built, whatever slices the state came from.
            new_groups, start = [], 0
            for g in self.optimizer.param_groups:
                count = len(g["params"])
                kept = {k: v for k, v in g.items() if k != "params"}
                new_groups.append({**kept, "params": list(range(start, start + count))})
                start += count
            self.optimizer.load_state_dict({"state": state, "param_groups": new_groups})
        elif self.params:
            saved = (groups or [{}])[0]
            group = {**saved, "params": list(range(len(self.params)))}
            self.optimizer.load_state_dict({"state": state, "param_groups": [group]})
        self.completed = iteration
        self.initialized = True
        self.pending = None
        self.drop_deferred()
        self.restores += 1
        self._encode(iteration=self.completed)
        return self.completed


def _state_key(m: TensorMeta) -> str:
    """A parameter's or buffer's name in a state blob (``param/<name>``, ``buffer/<name>``)."""
    return f"{'buffer' if m.buffer else 'param'}/{m.name}"


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    return dict(header.get("__metadata__", {}))


def model_from_shard_files(directory: str, manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The whole model (parameters and buffers by name) from a checkpoint's shard files."""
    model: dict[str, torch.Tensor] = {}
    for entry in manifest.get("shards", []):
        data = read_bytes(join_uri(directory, entry["file"]))
        if data is None:
            raise StorageError(f"{entry['file']} is missing from {directory}")
        for key, value in safetensors.torch.load(data).items():
            kind, _, name = key.partition("/")
            if kind in ("param", "buffer"):
                model[name] = value
    order = [m["name"] for m in manifest.get("layout", [])]
    return {name: model[name] for name in order if name in model}
