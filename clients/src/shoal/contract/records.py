"""A job's record files on any storage: lines appended by the job's coordinator, read whole.

``metrics/iterations.jsonl`` and ``metrics/epochs.jsonl`` (one JSON object per line) grow by a
line or a few at every commit, and are read whole by the coordinator (after a takeover) and by
the scheduler (``GetJobMetrics``). On the local filesystem a record file is one file, appended
in place (``shoal.param_sync.checkpoint.append_line``). An object store cannot append: putting
the object again for each append moves the whole file at every commit (against a local S3
server 23-66 ms per append at 0.2-5.8 MB, growing with the job; an object per append: 9-14 ms
whatever the size, bench/RESULTS-records.md), and two writers that overlap (a coordinator
paused through a takeover, and its successor) each replace the other's lines. There each
append is an object of its own, never overwritten, in ``<file>.parts/``::

    <key>.jsonl        the lines of one append
    <key>~seg.jsonl    the appends after the segment or whole before it, up to <key> included
    <key>~all.jsonl    the whole file up to <key> included (a compaction, or a rewrite)

``<key>`` is ``<time in ns, 20 digits>-<8 hex digits>``. A writer's keys increase, and its
first is above every key in storage then (one listing), so a successor whose clock is behind
its predecessor's still writes after it. The file reads as the ``~all`` of the greatest key
(else ``<file>`` itself: records written before parts existed), then the segments with greater
keys, then the appends with keys greater than those, each in key order. Compaction, by the
writer after its append: every :data:`SEGMENT_AFTER` appends become a segment, every
:data:`WHOLE_AFTER` segments a whole; it writes its object before it deletes what the object
covers, so a crash between leaves storage that reads the same, nothing read twice.

Reads cost one listing and one GET per object (fetched concurrently where the store can), at
most 1 + WHOLE_AFTER + SEGMENT_AFTER objects; an append costs one PUT, and every
SEGMENT_AFTER-th a listing, the segment's PUT and the deletes.

This module imports neither grpc nor torch (fsspec only).
"""

from __future__ import annotations

import contextlib
import logging
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

__all__ = [
    "SEGMENT_AFTER",
    "WHOLE_AFTER",
    "append",
    "forget",
    "parts_uri",
    "read",
    "rewrite",
]

SEGMENT_AFTER = 32
WHOLE_AFTER = 32

_NAME = re.compile(r"(?P<key>[0-9]{20}-[0-9a-f]{8})(?P<kind>~seg|~all)?\.jsonl")
_KIND_ORDER = {"": 0, "~seg": 1, "~all": 2}  # an object covering <key> sorts after <key>

log = logging.getLogger(__name__)

_lock = threading.Lock()
_last_key: dict[str, str] = {}  # file URI -> the last key this process wrote
_appends: dict[str, int] = {}  # file URI -> appends since this process last compacted


@dataclass(frozen=True)
class _Part:
    key: str
    kind: str  # "" (an append), "~seg" or "~all"
    path: str


@dataclass
class _View:
    """The objects a record file reads as, in order, and those they make obsolete."""

    whole: str | None  # the ~all's path, or the file written before parts (None: neither)
    segments: list[_Part]
    appends: list[_Part]
    covered: list[str]  # paths no read uses any more
    last_key: str  # the greatest key in storage ("" when none)

    def paths(self) -> list[str]:
        head = [self.whole] if self.whole is not None else []
        return head + [p.path for p in self.segments] + [p.path for p in self.appends]


def parts_uri(uri: str) -> str:
    """Where the appends of the record file ``uri`` go on an object store."""
    return uri.rstrip("/") + ".parts"


def _listing(fs: Any, parts: str) -> list[_Part]:
    fs.invalidate_cache(parts)  # (a store's listing cache would hide the last appends)
    try:
        names = fs.ls(parts, detail=False)
    except FileNotFoundError:
        return []
    out = []
    for path in names:
        found = _NAME.fullmatch(str(path).rstrip("/").rsplit("/", 1)[-1])
        if found is not None:
            out.append(_Part(found["key"], found["kind"] or "", str(path).rstrip("/")))
    return sorted(out, key=lambda p: (p.key, _KIND_ORDER[p.kind]))


def _view(fs: Any, path: str) -> _View:
    listed = _listing(fs, path + ".parts")
    wholes = [p for p in listed if p.kind == "~all"]
    floor = wholes[-1].key if wholes else ""
    covered = [p.path for p in listed if p.key < floor or (p.key == floor and p.kind != "~all")]
    if wholes:
        whole: str | None = wholes[-1].path
        if fs.exists(path):
            covered.append(path)
    else:
        whole = path if fs.exists(path) else None
    segments = []
    for p in listed:
        if p.kind == "~seg" and p.key > floor:
            segments.append(p)
    top = segments[-1].key if segments else floor
    for p in listed:
        if p.kind == "" and floor < p.key <= top:
            covered.append(p.path)
    appends = [p for p in listed if p.kind == "" and p.key > top]
    return _View(whole, segments, appends, covered, listed[-1].key if listed else "")


def _local(uri: str) -> tuple[Any, str, bool]:
    fs, path = fsspec.core.url_to_fs(uri)
    return fs, str(path).rstrip("/"), isinstance(fs, LocalFileSystem)


def _cat(fs: Any, paths: list[str]) -> bytes:
    if not paths:
        return b""
    got = fs.cat(paths, on_error="raise")
    return b"".join(bytes(got[p]) if isinstance(got, dict) else bytes(got) for p in paths)


def read(uri: str) -> bytes | None:
    """The record file's bytes (its parts joined on an object store); None when there is
    none. Raises ``OSError`` when storage cannot be read."""
    fs, path, local = _local(uri)
    if local:
        try:
            with open(path, "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None
    view = _view(fs, path)
    paths = view.paths()
    if not paths:
        return None
    try:
        return _cat(fs, paths)
    except FileNotFoundError:  # compacted between the listing and the read: read it again
        return _cat(fs, _view(fs, path).paths())


def _next_key(fs: Any, uri: str, path: str, listed: str | None = None) -> str:
    """A key greater than this process's last one for ``uri`` and than every key in storage
    (``listed``: the greatest a listing just found; else listed here when this process has
    written none)."""
    with _lock:
        last = _last_key.get(uri)
    if listed is None and last is None:
        parts = _listing(fs, path + ".parts")
        listed = parts[-1].key if parts else ""
    last = max(last or "", listed or "")
    now = time.time_ns()
    stamp = max(now, int(last[:20]) + 1) if last else now
    key = f"{stamp:020d}-{secrets.token_hex(4)}"
    with _lock:
        _last_key[uri] = key
    return key


def append(uri: str, data: bytes, *, before_write: Callable[[], None] | None = None) -> None:
    """Append ``data`` (whole lines) to the record file ``uri`` on an object store: one new
    object; then, every :data:`SEGMENT_AFTER` appends, a compaction. ``before_write`` (the
    storage fence's check) runs just before each put. Raises ``OSError`` (or what
    ``before_write`` raises) when the line was not written; once it is, a compaction that
    fails is logged and left to a later append (the caller must not write the line again)."""
    fs, path, local = _local(uri)
    if local:
        raise ValueError(f"{uri} is on the local filesystem: append to the file itself")
    key = _next_key(fs, uri, path)
    if before_write is not None:
        before_write()
    fs.pipe_file(f"{path}.parts/{key}.jsonl", data)
    with _lock:
        count = _appends[uri] = _appends.get(uri, 0) + 1
    if count >= SEGMENT_AFTER:
        try:
            _compact(fs, uri, path, before_write)
        except Exception as exc:  # the line is written: a compaction is for later appends
            # (a store's error, or the fence's check refusing it: the next append's check
            # raises that to its caller)
            log.warning("%s: compaction left for a later append: %s", uri, exc)


def _compact(fs: Any, uri: str, path: str, before_write: Callable[[], None] | None) -> None:
    """The appends after the last segment into one (every :data:`WHOLE_AFTER`-th time,
    everything into a whole), written before what it covers is deleted."""
    view = _view(fs, path)
    with _lock:
        _appends[uri] = 0
    if len(view.segments) + 1 >= WHOLE_AFTER:
        key, kind, body = view.last_key, "~all", _cat(fs, view.paths())
        gone = view.covered + view.paths()
    elif view.appends:
        key, kind = view.appends[-1].key, "~seg"
        body = _cat(fs, [p.path for p in view.appends])
        gone = view.covered + [p.path for p in view.appends]
    else:
        return
    if not key:
        return
    if before_write is not None:
        before_write()
    target = f"{path}.parts/{key}{kind}.jsonl"
    fs.pipe_file(target, body)
    _remove(fs, [p for p in gone if p != target])


def forget(uri: str) -> None:
    """Forget this process's last key for ``uri``: its next append lists storage first (a
    coordinator taking a job over, which another process may have written since)."""
    with _lock:
        _last_key.pop(uri, None)
        _appends.pop(uri, None)


def _remove(fs: Any, paths: list[str]) -> None:
    """Delete objects a newer one covers (a failure leaves them: readers skip them)."""
    if paths:
        with contextlib.suppress(OSError):
            fs.rm(paths)


def rewrite(uri: str, data: bytes, *, before_write: Callable[[], None] | None = None) -> None:
    """Make ``data`` the whole record file ``uri`` on an object store (a truncation after a
    resume): a ``~all`` object above every key in storage, then what it covers deleted.
    Raises ``OSError``."""
    fs, path, local = _local(uri)
    if local:
        raise ValueError(f"{uri} is on the local filesystem: replace the file itself")
    view = _view(fs, path)
    key = _next_key(fs, uri, path, view.last_key)
    if before_write is not None:
        before_write()
    target = f"{path}.parts/{key}~all.jsonl"
    fs.pipe_file(target, data)
    with _lock:
        _appends[uri] = 0
    _remove(fs, view.covered + view.paths())
