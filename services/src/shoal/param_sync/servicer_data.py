# mypy: disable-error-code="misc"
# (the parts annotate self as the assembled ParameterSyncServicer, a subclass of each part)
"""The tensor streams of a shard's own slice: SyncStep (sum, ShardReady, the new parameters
back) and PullParameters. Part of the ParameterSyncService servicer (``service.py``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from shoal.contract import faults
from shoal.contract.wire import MAX_INLINE_BYTES, Frame, encode_header
from shoal.param_sync.authz import authorize
from shoal.param_sync.servicer_common import (
    _aborted,
    _collect,
    _draining,
    _first_header,
    _ShardSlice,
    _silence,
)
from shoal.param_sync.shard import Contribution, ShardJob
from shoal.runtime.auth import current_principal
from shoal.runtime.errors import (
    Aborted,
    FailedPrecondition,
    InvalidField,
    NotFound,
    StaleGeneration,
)
from shoal.v1 import parameter_sync_service_pb2 as ps_pb2

if TYPE_CHECKING:
    from shoal.param_sync.service import ParameterSyncServicer as _S

log = logging.getLogger("shoal.param_sync.service")


class DataHandlers:
    """Part of :class:`~shoal.param_sync.service.ParameterSyncServicer` (see there)."""

    # -- SyncStep / PullParameters ------------------------------------------------------------

    async def SyncStep(
        self: _S, request_iterator: AsyncIterator[Frame], context: Any
    ) -> AsyncIterator[bytes]:
        seen: list[ps_pb2.TensorBundleHeader] = []
        try:
            async for message in self._sync_step(request_iterator, seen):
                yield message
        except (StaleGeneration, Aborted, FailedPrecondition, NotFound) as exc:
            if seen:
                self._log_refusal(seen[0], exc)
            raise

    def _log_refusal(self: _S, header: ps_pb2.TensorBundleHeader, exc: Exception) -> None:
        """Say why this shard refused or aborted a learner's SyncStep (at most one line a
        second per job, with the count of the others): a learner only sees the answer."""
        now = time.monotonic()
        job = header.job_id
        last, hidden = self._refusals.get(job, (-1e18, 0))
        if now - last < 1.0:
            self._refusals[job] = (last, hidden + 1)
            return
        self._refusals[job] = (now, 0)
        log.warning(
            "job %s: SyncStep of learner %s for iteration %d (generation %d) refused: %s: %s%s",
            job,
            header.sender_id,
            header.iteration,
            header.generation,
            type(exc).__name__,
            exc,
            f" ({hidden} more refused in the last second)" if hidden else "",
        )

    async def _sync_step(
        self: _S, request_iterator: AsyncIterator[Frame], seen: list[ps_pb2.TensorBundleHeader]
    ) -> AsyncIterator[bytes]:
        frames = aiter(request_iterator)
        async with _draining(frames):
            header = await _first_header(frames)
            seen.append(header)
            authorize(
                current_principal(), "SyncStep", job_id=header.job_id, learner_id=header.sender_id
            )
            part = self._slice(header.job_id)
            sj = part.job
            matched = sj.check_stream(
                header, everything=False, max_bytes=self.options.max_bundle_bytes
            )
            g, k, learner = header.generation, header.iteration, header.sender_id
            if header.num_samples < 0:
                raise InvalidField("header.num_samples", header.num_samples, "must be >= 0")
            if header.inline_answer_max_bytes < 0:
                raise InvalidField(
                    "header.inline_answer_max_bytes",
                    header.inline_answer_max_bytes,
                    "must be >= 0 (0: the answer in chunks)",
                )
            if k == sj.completed and faults.fire_once(faults.RAISE_FLOOR, k):
                await self._raise_floor_for_test(part, g, k)
            sj.check_iteration(g, k)
            self.metrics.round_started(header.job_id, g, k)
            members = await self._members(part, g)
            if learner not in members:
                raise StaleGeneration(
                    f"learner {learner!r} is not a member of generation {g} of job "
                    f"{header.job_id!r}"
                )
            contribution = Contribution(
                learner=learner,
                generation=g,
                iteration=k,
                num_samples=header.num_samples,
                loss_sum=header.loss_sum,
                learning_rate=header.learning_rate,
                metas=matched,
                total_bytes=header.total_bytes,
            )
            lane = None
            if header.shared_memory:  # the bytes are in the learner's same-host lane
                lane = await self._lane_collect(frames, header, sj, contribution)
            else:
                await _collect(frames, sj, contribution, header, trailer=True)
        future = part.futures.get((g, k))
        if future is None:
            future = asyncio.get_running_loop().create_future()
            future.add_done_callback(_silence)
            part.futures[(g, k)] = future
        written: asyncio.Future[None] | None = None
        if lane is not None:
            # The replicas kept here step this iteration only once this answer is written
            # (ResolveIteration): on one compute thread, it would wait behind them.
            written = asyncio.get_running_loop().create_future()
            self._lane_answers.setdefault((header.job_id, g, k), []).append(written)
        try:
            ready = await self._compute_small(sj.total_bytes, sj.accumulate, contribution, members)
            self._fail_superseded(part)
            if ready:
                notify = asyncio.create_task(self._shard_ready(sj, g, k))
                self._background.add(notify)
                notify.add_done_callback(self._background.discard)
            # Resolved when the commit starts (the header is final then), before the slice
            # is stepped: each chunk leaves once its bytes are (Encoded.ready).
            encoded = await asyncio.shield(future)
            if lane is not None:
                message = await self._lane_answer(lane, sj, encoded, (id(sj), g, k))
        finally:
            if written is not None and not written.done():
                written.set_result(None)
        if lane is not None:
            yield message
            return
        if _answers_inline(encoded.total_bytes, header.inline_answer_max_bytes):
            # One message: the header with the bytes (the learner said it reads it).
            await encoded.whole()
            yield encoded.inline_message(ps_pb2.SyncStepResponse)
            return
        yield encode_header(ps_pb2.SyncStepResponse, encoded.header)
        for i in range(encoded.count):
            await encoded.ready(i)
            yield encoded.chunk(i)

    async def _raise_floor_for_test(self: _S, part: _ShardSlice, generation: int, k: int) -> None:
        """The test fault ``raise-floor`` (``faults.py``): drop iteration k's sums and raise the
        floor above the running generation, telling no one (a drift the guard must undo)."""
        sj = part.job
        await self._compute(sj.abort, generation, k)
        self._fail_superseded(part)
        log.warning(
            "test fault raise-floor: shard %d's generation floor raised to %d (iteration %d runs "
            "in generation %d)",
            sj.shard_index,
            sj.min_generation,
            k,
            generation,
        )

    async def _members(self: _S, part: _ShardSlice, generation: int) -> frozenset[str]:
        """The members of ``generation`` (asked from the coordinator once: a generation's
        member list never changes; a superseded generation is refused there)."""
        members = part.memberships.get(generation)
        if members is None:
            sj = part.job
            request = ps_pb2.GetMembershipRequest(job_id=sj.job_id, generation=generation)
            if sj.job_id in self._coordinated:
                reply = await self.GetMembership(request, None)
            else:
                reply = await self._peer_call(
                    sj.coordinator_address, "GetMembership", request, 30.0
                )
            members = frozenset(reply.member_learner_ids)
            part.memberships = {
                gen: value for gen, value in part.memberships.items() if gen >= generation
            }
            part.memberships[generation] = members
            self._prune_lanes(sj.job_id, generation, members)
        return members

    async def _shard_ready(self: _S, sj: ShardJob, generation: int, iteration: int) -> None:
        clips = sj.optimizer_config.needs_norm
        request = ps_pb2.ShardReadyRequest(
            job_id=sj.job_id,
            shard_index=sj.shard_index,
            generation=generation,
            iteration=iteration,
            grad_sq_norm=await self._compute(sj.grad_sq_norm) if clips else 0.0,
        )
        part = self._slices.get(sj.job_id)
        if part is not None and part.backup_address:
            # The backup holds the very sums before the coordinator may commit them.
            try:
                await self._send_slice(
                    sj, part.backup_address, replica=True, kind="sums", at=(generation, iteration)
                )
            except Exception as exc:
                log.error(
                    "job %s: sums of iteration %d not replicated to %s: %s",
                    sj.job_id,
                    iteration,
                    part.backup_address,
                    exc,
                )
        try:
            if sj.job_id in self._coordinated:
                await self._local_ShardReady(request)
            else:
                await self._peer_call(sj.coordinator_address, "ShardReady", request, 30.0)
        except StaleGeneration as exc:
            log.info("shard ready for a superseded iteration: %s", exc)
        except Exception as exc:
            log.error("ShardReady for job %s failed: %s", sj.job_id, exc)

    def _fail_superseded(self: _S, part: _ShardSlice) -> None:
        floor = part.job.min_generation
        for key in [key for key in part.futures if key[0] < floor]:
            future = part.futures.pop(key)
            if not future.done():
                future.set_exception(_aborted(part.job.job_id, *key))

    def _fail_waiters(self: _S, part: _ShardSlice, exc: Exception) -> None:
        for future in part.futures.values():
            if not future.done():
                future.set_exception(exc)
        part.futures.clear()

    async def PullParameters(
        self: _S, request: ps_pb2.PullParametersRequest, context: Any
    ) -> AsyncIterator[bytes]:
        authorize(
            current_principal(),
            "PullParameters",
            job_id=request.job_id,
            learner_id=request.learner_id or None,
        )
        part = self._slice(request.job_id)
        sj = part.job
        if not sj.initialized:
            raise FailedPrecondition(
                f"shard {sj.shard_index} of job {request.job_id!r} has no parameters yet"
            )
        if request.generation > 0:
            members = await self._members(part, request.generation)
            if request.learner_id not in members:
                raise StaleGeneration(
                    f"learner {request.learner_id!r} is not a member of generation "
                    f"{request.generation} of job {request.job_id!r}"
                )
        if request.inline_answer_max_bytes < 0:
            raise InvalidField(
                "inline_answer_max_bytes",
                request.inline_answer_max_bytes,
                "must be >= 0 (0: the answer in chunks)",
            )
        if _answers_inline(sj.total_bytes, request.inline_answer_max_bytes):
            encoded = await self._compute(sj.current, ps_pb2.PullParametersResponse)
            yield encoded.inline_message(ps_pb2.PullParametersResponse)
            return
        encoded = await self._compute(sj.current)
        yield encode_header(ps_pb2.PullParametersResponse, encoded.header)
        for chunk in encoded.chunks:
            yield chunk


def _answers_inline(total_bytes: int, asked: int) -> bool:
    """Whether a bundle of ``total_bytes`` is answered as one message: it has bytes and is at
    most what the learner said it reads inline (``inline_answer_max_bytes``; capped at
    :data:`~shoal.contract.wire.MAX_INLINE_BYTES`)."""
    return 0 < total_bytes <= min(asked, MAX_INLINE_BYTES)
