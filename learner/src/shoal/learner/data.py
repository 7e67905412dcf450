"""Datasets addressed by URI: ``file://``, ``s3://``, ``gs://`` and anything else fsspec knows.

A job's ``shoal submit --dataset URI`` (repeatable) reaches every learner as
SHOAL_DATASET_URIS; the trainer hands the list to ``get_datasets`` when that function takes an
argument, so one script reads the job's data wherever it lives::

    from shoal.learner import ElasticTrainer, data

    def get_datasets(uris):
        train = data.tensor_dataset(uris[0])          # a safetensors file with "x" and "y"
        return train, data.tensor_dataset(uris[1]) if len(uris) > 1 else None

Object stores need their fsspec package (``pip install shoal-learner[s3]`` installs s3fs,
``[gcs]`` gcsfs); credentials and endpoints come from the store's usual configuration (for S3:
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL`` for an S3-compatible
server such as MinIO), so nothing secret passes through shoal.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import fsspec
import safetensors.torch
from torch.utils.data import TensorDataset

__all__ = ["open_uri", "read_bytes", "storage_options", "tensor_dataset"]


def storage_options(uri: str) -> dict[str, Any]:
    """fsspec options for ``uri``: for ``s3://``, the S3 endpoint of ``AWS_ENDPOINT_URL_S3``
    or ``AWS_ENDPOINT_URL`` when set (S3-compatible servers); none otherwise."""
    if uri.startswith(("s3://", "s3a://")):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            return {"client_kwargs": {"endpoint_url": endpoint}}
    return {}


def _check(uri: str) -> str:
    if not isinstance(uri, str) or not uri or (not uri.startswith("/") and "://" not in uri):
        raise ValueError(f"dataset URI ({uri!r}) must name a scheme or be an absolute path")
    return uri


def open_uri(uri: str, mode: str = "rb") -> Any:
    """Open ``uri`` with fsspec (a context manager giving a file object). A scheme whose
    package is not installed raises ``ValueError`` naming the package to install."""
    try:
        return fsspec.open(_check(uri), mode, **storage_options(uri))
    except ImportError as exc:
        raise ValueError(
            f"dataset URI ({uri!r}) needs a filesystem package that is not installed: {exc} "
            "(pip install 'shoal-learner[s3]' or '[gcs]')"
        ) from exc


def read_bytes(uri: str) -> bytes:
    """The whole content of ``uri``."""
    with open_uri(uri, "rb") as f:
        return f.read()


def tensor_dataset(uri: str, keys: Sequence[str] = ("x", "y")) -> TensorDataset:
    """A ``TensorDataset`` of the tensors ``keys`` of the safetensors file at ``uri`` (read
    once, into memory; the fastest kind of dataset for the trainer)."""
    tensors = safetensors.torch.load(read_bytes(uri))
    missing = [k for k in keys if k not in tensors]
    if missing:
        raise ValueError(f"{uri} holds no tensor {missing!r} (it has {sorted(tensors)})")
    lengths = {len(tensors[k]) for k in keys}
    if len(lengths) != 1:
        raise ValueError(f"{uri}: tensors {list(keys)} differ in length ({sorted(lengths)})")
    return TensorDataset(*(tensors[k] for k in keys))
