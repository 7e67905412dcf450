"""The storage fence: which coordinator may write a job's files (docs/data-plane.md, "The
storage fence").

The shards fence a deposed coordinator by epoch (SetCoordinator), but storage cannot: a
coordinator paused (SIGSTOP, a long GC, a partition) through a takeover wakes with records
and checkpoints it still means to write, and the successor, which read storage when it took
the role, may have written the same iteration already. So a coordinator marks the job as its
own when it takes the role (OpenJob, TakeOverJob), in ``jobs/<job_id>/coordinator.json``,
before it reads any of the job's state; and before every write of the job's files (iteration
and epoch records, the batch schedule, a checkpoint's manifest and ``latest``, the final
model, a truncation after a rewind) it checks, in the same thread and just before the write,
that the mark still names it. A coordinator that finds another's mark was superseded: it writes
nothing more and steps down, as if SetCoordinator had told it.

Last taker wins, with no epoch to compare: the scheduler gives the role to a new coordinator
only once it judged the old one lost, and a scheduler that lost its state (epochs start at 0
again) must still be able to open the job. The check leaves a window of microseconds (a
coordinator stopped after its check and before its write). For the appended records on local
storage it is closed: an append checks once its file is open, and a new coordinator renews
those files (:func:`renew_records`) right after its mark, so a stopped writer's line goes to a
file no one reads. On an object store each append is an object of its own
(``shoal.contract.records``): a stopped writer's late line is added, never put over the
successor's. For the single writes it stays open; the mark closes the one of seconds that a
pause through a takeover opens.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TypeVar

from shoal.contract import records
from shoal.param_sync import checkpoint as ckpt

__all__ = [
    "HOLDER",
    "RECORDS",
    "Superseded",
    "as_holder",
    "check_holder",
    "mark_holder",
    "renew_records",
]

HOLDER = "coordinator.json"

T = TypeVar("T")


class Superseded(Exception):
    """Another coordinator took the job over: its storage names another holder (``shard`` and
    ``epoch``: those of its mark, None when the mark does not say them as integers)."""

    def __init__(self, message: str, *, shard: int | None = None, epoch: int | None = None):
        super().__init__(message)
        self.shard, self.epoch = shard, epoch


def mark_holder(storage_uri: str, job_id: str, holder: str, *, shard: int, epoch: int) -> None:
    """Make ``holder`` (a coordinator's own token) the job's writer from now on."""
    mark = {"holder": holder, "shard": shard, "epoch": epoch, "time": time.time()}
    ckpt.atomic_write(ckpt.job_uri(storage_uri, job_id, HOLDER), json.dumps(mark).encode())


def check_holder(storage_uri: str, job_id: str, holder: str) -> None:
    """Raise :class:`Superseded` when the job's mark names another coordinator than
    ``holder``. No mark (a job's files from before the fence): nothing to check. A mark that
    is not JSON is a StorageError naming the file (the write it guards does not happen)."""
    uri = ckpt.job_uri(storage_uri, job_id, HOLDER)
    data = ckpt.read_bytes(uri)
    if data is None:
        return
    try:
        mark = json.loads(data)
        named = mark["holder"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ckpt.StorageError(f"{uri} is not a coordinator mark: {exc!r}") from exc
    if named != holder:
        shard, epoch = mark.get("shard"), mark.get("epoch")
        raise Superseded(
            f"its files name the coordinator on shard {shard} (epoch {epoch}) now",
            shard=shard if type(shard) is int else None,
            epoch=epoch if type(epoch) is int else None,
        )


def as_holder(
    storage_uri: str, job_id: str, holder: str, write: Callable[..., T], *args: object
) -> T:
    """``write(*args)`` if ``holder`` still holds the job (checked just before it). An append
    (``ckpt.append_line``: the iteration and epoch records) checks once its file is open: a
    coordinator stopped between the check and the write then writes into the file it opened,
    which the successor's takeover replaced (:func:`renew_records`), not into the successor's
    records (where the same iteration would be recorded twice)."""
    if write is ckpt.append_line:
        uri, line = args
        return ckpt.append_line(  # type: ignore[return-value]
            str(uri), str(line), before_write=lambda: check_holder(storage_uri, job_id, holder)
        )
    check_holder(storage_uri, job_id, holder)
    return write(*args)


#: The job's files a coordinator appends to (``ckpt.append_line`` through :func:`as_holder`).
RECORDS = (("metrics", "iterations.jsonl"), ("metrics", "epochs.jsonl"))


def renew_records(storage_uri: str, job_id: str, holder: str) -> None:
    """After :func:`mark_holder` (a takeover, an OpenJob): each appended file of the job
    replaced by a copy of itself (``ckpt.renew_local``), before the new coordinator reads what
    is recorded. A paused predecessor past its check writes into the old file, which no one
    reads: its line is either in the copy (written before it) or nowhere, and the successor,
    which reads the copy, records that iteration itself. On an object store each append is
    an object of its own (``shoal.contract.records``): the successor's appends go after
    everything there when it took over, and a predecessor's late append adds its line without
    replacing any; the window between a check and a put remains there.

    Each copy replaces its file only if ``holder`` still holds the job (checked just before:
    a renewal paused through another takeover must not put back an older copy over the
    successor's records; :class:`Superseded` then); the copies a renewal that died midway
    left are removed."""

    def still_held() -> None:
        check_holder(storage_uri, job_id, holder)

    for parts in RECORDS:
        uri = ckpt.job_uri(storage_uri, job_id, *parts)
        ckpt.renew_local(uri, before_replace=still_held)
        records.forget(uri)  # an object store's: the next append lists what is there first
