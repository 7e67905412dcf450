"""ListJobs pagination, pure: page sizes, opaque page tokens bound to their states filter, and
one page of jobs, newest first.

Part of the job core: :mod:`shoal.scheduler.jobs` re-exports every name here.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence

from shoal.contract.errors import (
    InvalidField,
)
from shoal.v1 import job_pb2

S = job_pb2  # short alias for the enum values below

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000


def validate_page_size(page_size: int) -> int:
    if page_size == 0:
        return DEFAULT_PAGE_SIZE
    if not 1 <= page_size <= MAX_PAGE_SIZE:
        raise InvalidField("page_size", page_size, f"must be in 1..{MAX_PAGE_SIZE} (0: 100)")
    return page_size


def _filter_key(states: Iterable[int]) -> str:
    text = ",".join(str(s) for s in sorted(set(states)))
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def encode_page_token(submit_seq: int, job_id: str, states: Iterable[int]) -> str:
    """An opaque token: where the next page starts (after this job) and the filter it is for."""
    doc = json.dumps([submit_seq, job_id, _filter_key(states)], separators=(",", ":"))
    return base64.urlsafe_b64encode(doc.encode()).decode().rstrip("=")


def decode_page_token(token: str, states: Iterable[int]) -> tuple[int, str]:
    try:
        padded = token + "=" * (-len(token) % 4)
        seq, job_id, key = json.loads(base64.urlsafe_b64decode(padded.encode()))
        if not isinstance(seq, int) or not isinstance(job_id, str) or not isinstance(key, str):
            raise ValueError("bad token fields")
    except (ValueError, TypeError, binascii.Error, UnicodeDecodeError):
        raise InvalidField("page_token", token, "is not a token this API returned") from None
    if key != _filter_key(states):
        raise InvalidField("page_token", token, "was issued for a different states filter")
    return seq, job_id


def page_jobs(
    jobs: Sequence[job_pb2.Job],
    seqs: Mapping[str, int],
    *,
    states: Sequence[int],
    page_size: int,
    page_token: str,
) -> tuple[list[job_pb2.Job], str]:
    """One page of ``jobs`` (already filtered by visibility), newest first.

    ``seqs`` gives each job's submit sequence (the order). The token names the last job of the
    page, so pages stay consistent while jobs are submitted: new jobs appear only on a fresh
    first page, and none is skipped or repeated.
    """
    size = validate_page_size(page_size)
    for s in states:
        if s not in job_pb2.JobState.values() or s == S.JOB_STATE_UNSPECIFIED:
            raise InvalidField("states", s, "must name job states (QUEUED, RUNNING, ...)")
    wanted = frozenset(states)
    ordered = sorted(
        (j for j in jobs if not wanted or j.state in wanted),
        key=lambda j: (seqs[j.job_id], j.job_id),
        reverse=True,
    )
    if page_token:
        after = decode_page_token(page_token, states)
        ordered = [j for j in ordered if (seqs[j.job_id], j.job_id) < after]
    page = ordered[:size]
    token = ""
    if len(ordered) > size:
        last = page[-1]
        token = encode_page_token(seqs[last.job_id], last.job_id, states)
    return page, token
