"""Writing a file at a storage URI so that a reader never sees a part of it.

A checkpoint's files are written by the shards (``shoal.param_sync.checkpoint``) and, in
collective mode, by a learner (``shoal.learner.collective_checkpoint``); the coordinator's
manifest, written last, commits them. Both sides write through :func:`atomic_write`: a local
file goes under a temporary name in the same directory, is flushed and fsynced, then renamed
over the target (``os.replace`` is atomic on POSIX); an object store's single put is whole by
itself (fsspec ``pipe_file``). A failed write removes its temporary file (a full disk is not
filled further by each retry) and raises the storage's ``OSError``: what a refusal means is the
caller's to say.

This module imports neither grpc nor torch (fsspec only).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable

import fsspec
from fsspec.implementations.local import LocalFileSystem

__all__ = ["atomic_write"]


def atomic_write(
    uri: str, data: bytes, *, before_rename: Callable[[str], None] | None = None
) -> None:
    """Write ``data`` at ``uri`` (any fsspec URI or local path), creating its directory, so
    that readers see the old file or the new one, never a partial one. ``before_rename(path)``
    runs between the local write and its rename (a test fault point). Raises ``OSError``."""
    fs, path = fsspec.core.url_to_fs(uri)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    if not isinstance(fs, LocalFileSystem):
        fs.pipe_file(path, data)
        return
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if before_rename is not None:
            before_rename(path)
        os.replace(tmp, path)
        tmp = ""
    finally:
        if tmp:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
