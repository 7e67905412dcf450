"""A job's progress, data-plane health, completion, failure and finish, as the workers and the
progress loop see them.

Methods of :class:`~shoal.scheduler.reconcile.loop.Reconciler` (a mixin: the state lives
there): polling GetJobProgress, the verdicts of ``shoal.scheduler.health`` (RECOVERING, a
coordinator takeover, a retry from the checkpoint, FAILED), and closing a job everywhere."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re

import grpc

from shoal.contract.data_plane import (
    CoordinatorRecord,
    coordinator_key,
    encode_coordinator,
)
from shoal.contract.errors import NotLeader, StoreError, Unavailable
from shoal.runtime.election import LeadershipLost
from shoal.scheduler.health import JobHealth, VerdictKind, assess
from shoal.scheduler.jobs import (
    HOLDING,
    STARTED_STATES,
    STATE_HISTORY_LIMIT,
    JobRecord,
    LearnerPhase,
    StateChange,
    state_name,
)
from shoal.scheduler.reconcile.peers import (
    UNREACHABLE,
    FencedOutByPeer,
    check_fenced,
    describe,
)
from shoal.scheduler.reconcile.registry import migrate_legacy_moves
from shoal.scheduler.reconcile.work import JobWork
from shoal.scheduler.store import StoreConflict
from shoal.v1 import (
    job_pb2,
    parameter_sync_service_pb2 as ps_pb2,
)

log = logging.getLogger(__name__)

# The coordinator's words for a checkpoint the storage refused (servicer_tasks).
CHECKPOINT_FAILED = re.compile(r"checkpoint after (\d+) iterations failed: ")

S = job_pb2


class JobLifecycle:
    """Progress, health and the end of a job (part of :class:`Reconciler`)."""

    # -- completion, failure, finish ------------------------------------------------------------

    async def _transition(self, record: JobRecord, target: int, reason: str) -> None:
        record.transition(target, reason, self.clock())
        await self.table.save(record)
        self.table.publish(record, S.JOB_EVENT_KIND_STATE)
        self.trigger(f"job {record.job_id} {state_name(target)}")
        if record.final:
            await self._forget_coordinator_move(record.job_id)

    async def _publish_move(self, record: JobRecord, moved: CoordinatorRecord) -> None:
        """Publish where a job's coordinator is and at which epoch (a takeover, or a re-open
        that had to take a higher epoch) in etcd, fenced by this scheduler's leadership, and
        follow it here at once (the watch brings it to the other replicas)."""
        job_id = record.job_id
        value = encode_coordinator(moved)
        try:
            await self.table.store.put(coordinator_key(job_id), value, fence=self.table.fence)
        except StoreError as exc:  # this leader follows it anyway; the next finds the shard
            log.warning("job %s: coordinator move not published: %s", job_id, exc)
        self.moves.apply(coordinator_key(job_id), value)
        if record.final:  # it ended while the move was being made: nothing reads it
            await self._forget_coordinator_move(job_id)

    async def _migrate_coordinator_moves(self) -> None:
        """Rewrite the coordinator records an earlier release wrote in JSON as protobuf (once a
        term; one not rewritten stays readable and the next leader tries again)."""
        try:
            await migrate_legacy_moves(self.table.store, self.table.fence)
        except StoreError as exc:
            log.warning("coordinator records not migrated yet: %s", exc)

    async def _forget_coordinator_move(self, job_id: str) -> None:
        """A job ended (COMPLETED, FAILED, CANCELLED): delete where its coordinator moved
        (``/shoal/v1/parameter-sync/coordinators/<job_id>``), which nothing reads any more (the
        record keeps the address its CloseJob goes to). Fenced like every scheduler write; a
        failed delete is retried when a leader lists the moves again (``_coordinator_moved``)."""
        self._takeover_tried.pop(job_id, None)
        if self.moves.records.pop(job_id, None) is None:
            with contextlib.suppress(StoreError):
                if await self.table.store.get(coordinator_key(job_id)) is None:
                    return
        try:
            await self.table.store.delete(coordinator_key(job_id), fence=self.table.fence)
        except StoreError as exc:
            log.warning("job %s: coordinator record not deleted: %s", job_id, exc)
            return
        log.info("job %s: coordinator record deleted (the job ended)", job_id)

    async def _poll_progress(self, record: JobRecord) -> ps_pb2.GetJobProgressResponse | None:
        if not record.opened or not record.coordinator_address:
            return None
        try:
            response = await self.peers.shard(record.coordinator_address).GetJobProgress(
                ps_pb2.GetJobProgressRequest(job_id=record.job_id),
                timeout=self.config.call_timeout_s,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in UNREACHABLE and record.state in STARTED_STATES:
                self._unreachable(record, exc)
                return None
            if exc.code() == grpc.StatusCode.NOT_FOUND and record.active:
                # The coordinator lost the job (a restarted shard): open it again, which
                # resumes it from its latest checkpoint, before the next learner starts.
                log.warning("job %s: unknown to its coordinator; re-opening it", record.job_id)
                health = self._health(record)
                lost_at = health.lost_at if health.down else health.iterations
                health.reopened(health.iterations)
                health.entered_recovery()
                record.opened = False
                if record.state in STARTED_STATES:
                    await self._recovering(
                        record,
                        f"coordinator {self._shard_name(record)} lost the job's state (it "
                        f"restarted) after iteration {lost_at}; re-opening the job from its "
                        "latest checkpoint",
                    )
                else:
                    await self.table.save(record)
                self.trigger(f"job {record.job_id} data plane lost")
                return None
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise
        if record.state in STARTED_STATES:
            # A coordinator that recovers the job itself (a shard lost) says so and why
            # (fields of GetJobProgressResponse a coordinator without them leaves unset).
            recovering = bool(getattr(response, "recovering", False))
            why = str(getattr(response, "recovery_reason", "") or "a shard was lost")
            self._health(record).polled(
                response.progress.completed_iterations,
                self.clock(),
                why if recovering else None,
            )
        if record.state == S.JOB_STATE_RUNNING:
            await self._checkpoint_news(
                record,
                str(getattr(response, "checkpoint_error", "")),
                int(getattr(response, "latest_checkpoint", 0)),
            )
        self.members[record.job_id] = tuple(response.member_learner_ids)
        if self.metrics is not None and response.HasField("progress"):
            self.metrics.world_size(record.job_id, response.progress.world_size, self.clock())
        self.rescales.observe(
            record, response.member_learner_ids, response.progress.completed_iterations
        )
        if response.HasField("progress"):
            self.goodput.observe_job(record.job, response.progress, self.clock())
            await self._save_throughput(record.job_id)
            if record.state == S.JOB_STATE_RUNNING and not response.done:
                await self._tell_batch(record, response.progress)
        if response.HasField("progress") and response.progress != record.job.progress:
            if response.progress.completed_iterations > record.job.progress.completed_iterations:
                record.failures = 0
            record.job.progress.CopyFrom(response.progress)
            self.table.publish(record, S.JOB_EVENT_KIND_PROGRESS)
            now = self.clock()
            if now - self._progress_saved.get(record.job_id, 0.0) >= (
                self.config.progress_persist_s
            ):
                self._progress_saved[record.job_id] = now
                await self.table.save(record)
        if response.done and record.state in STARTED_STATES:
            await self._complete(record)
        return response

    async def _tell_batch(self, record: JobRecord, progress: job_pb2.JobProgress) -> None:
        """A job with an adaptive batch: when the batch the goodput model picks
        (``Job.adaptive_batch_size``) differs from the one in use, tell the coordinator
        (SetGlobalBatch), which runs it from the next iteration boundary, the same for every
        learner. Told once per pick; a failed call is logged and told again at the next poll."""
        pick = record.job.adaptive_batch_size
        if not pick or not progress.global_batch or pick == progress.global_batch:
            self._batch_sent.pop(record.job_id, None)
            return
        if self._batch_sent.get(record.job_id) == pick:
            return
        request = ps_pb2.SetGlobalBatchRequest(
            job_id=record.job_id, global_batch=pick, fencing_token=self._token
        )
        try:
            await self.peers.shard(record.coordinator_address).SetGlobalBatch(
                request, timeout=self.config.call_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            check_fenced(exc)
            log.warning("job %s: global batch %d not set: %s", record.job_id, pick, exc.details())
            return
        self._batch_sent[record.job_id] = pick
        log.info(
            "job %s: global batch %d -> %d at %d learners (adaptive batch, goodput)",
            record.job_id,
            progress.global_batch,
            pick,
            progress.world_size,
        )

    async def _save_throughput(self, job_id: str) -> None:
        """Store the job's throughput model in etcd, at most every ``progress_persist_s``
        (a new leader goes on from it). A failed write is logged and tried at the next poll
        after that; losing leadership goes up as for any write."""
        now = self.clock()
        if now - self._throughput_saved.get(job_id, -math.inf) < self.config.progress_persist_s:
            return
        state = self.goodput.state(job_id)
        if state is None:
            return
        self._throughput_saved[job_id] = now
        try:
            await self.table.save_throughput(job_id, state)
        except Unavailable as exc:
            log.warning("job %s: throughput model not stored: %s", job_id, exc)

    async def _forget_throughput(self, job_id: str) -> None:
        """The job ended: delete its stored throughput model (fenced; a failure is logged and
        the next leader deletes it when it finds the state of an ended job)."""
        self._batch_sent.pop(job_id, None)
        try:
            await self.table.delete_throughput(job_id)
        except (Unavailable, NotLeader) as exc:
            log.warning("job %s: throughput model not deleted: %s", job_id, exc)

    async def _checkpoint_news(self, record: JobRecord, error: str, latest: int) -> None:
        """A RUNNING job whose checkpoints fail (GetJobProgress.checkpoint_error: a full disk)
        says so in its state reason (a STATE event and a history entry; the state stays
        RUNNING: training goes on), and says so again once a later checkpoint committed
        (``latest``: the coordinator's latest committed one; an empty error alone is not that:
        a coordinator that took the job over, or a new scheduler leader, starts without it)."""
        health = self._health(record)
        if error:
            health.checkpoint_error = error
            await self._say(record, error)
            return
        earlier = health.checkpoint_error
        if not earlier and CHECKPOINT_FAILED.match(record.job.state_reason):
            earlier = record.job.state_reason  # said by an earlier leader
        if not earlier:
            return
        failed = CHECKPOINT_FAILED.match(earlier)
        if failed is not None and latest <= int(failed.group(1)):
            return  # nothing committed since: the reason stays
        health.checkpoint_error = ""
        await self._say(record, f"checkpoints commit again (earlier: {earlier})")

    async def _say(self, record: JobRecord, reason: str, *, level: int = logging.WARNING) -> None:
        """A new reason for the job in its current state (a STATE event and a history entry;
        the state does not change)."""
        if record.job.state_reason == reason:
            return
        log.log(level, "job %s: %s", record.job_id, reason)
        record.job.state_reason = reason
        record.history.append(StateChange(self.clock(), record.state, record.state, reason))
        del record.history[:-STATE_HISTORY_LIMIT]
        await self.table.save(record)
        self.table.publish(record, S.JOB_EVENT_KIND_STATE)

    # -- data-plane health (shoal.scheduler.health) ---------------------------------------------

    def _health(self, record: JobRecord) -> JobHealth:
        health = self.health.get(record.job_id)
        if health is None:
            health = self.health[record.job_id] = JobHealth(
                iterations=record.job.progress.completed_iterations, progress_at=self.clock()
            )
        return health

    def _shard_name(self, record: JobRecord) -> str:
        if record.coordinator_index >= 0:
            return f"shard {record.coordinator_index} ({record.coordinator_address})"
        return record.coordinator_address or "(none yet)"

    def _unreachable(self, record: JobRecord, exc: grpc.aio.AioRpcError) -> None:
        if record.state in STARTED_STATES:
            detail = (exc.details() or "").splitlines()[0][:200] if exc.details() else ""
            why = f"{self._shard_name(record)} unreachable: {exc.code().name}"
            self._health(record).unreachable(why + (f" ({detail})" if detail else ""), self.clock())

    async def _recovering(self, record: JobRecord, reason: str) -> None:
        """Say that the job is RECOVERING and why (a transition from RUNNING; a new reason in
        RECOVERING, recorded in the history too)."""
        if record.state == S.JOB_STATE_RUNNING:
            log.warning("job %s recovering: %s", record.job_id, reason)
            self._health(record).entered_recovery()
            await self._transition(record, S.JOB_STATE_RECOVERING, reason)
        elif record.state == S.JOB_STATE_RECOVERING:
            await self._say(record, reason, level=logging.INFO)

    async def _assess(self, record: JobRecord) -> None:
        """Act on the job's data-plane health (one verdict per poll; none while a worker
        holds the job: the next poll looks again)."""
        if record.state not in STARTED_STATES:
            self.health.pop(record.job_id, None)
            return
        if record.job_id in self._busy:
            return
        health = self._health(record)
        if (
            health.unreachable_since is not None
            and self.clock() - health.unreachable_since >= self.config.health.unreachable_grace_s
            and await self._take_over(record)
        ):
            return
        verdict = assess(
            record.state,
            health,
            now=self.clock(),
            config=self.config.health,
            recoveries=record.recoveries,
            coordinator=self._shard_name(record),
        )
        if verdict is None:
            return
        if verdict.kind is VerdictKind.RECOVERING:
            await self._recovering(record, verdict.reason)
            self.trigger(f"job {record.job_id} data plane down")
        elif verdict.kind is VerdictKind.RECOVERED:
            log.info("job %s: %s", record.job_id, verdict.reason)
            health.running()
            await self._transition(
                record,
                S.JOB_STATE_RUNNING,
                f"{verdict.reason}; running on {record.workers()} learner(s)",
            )
        elif verdict.kind is VerdictKind.FAIL:
            await self._fail(record, verdict.reason)
        elif verdict.kind is VerdictKind.STALLED:
            health.stalled_since = health.progress_at
            await self._say(record, verdict.reason)
        elif verdict.kind is VerdictKind.RESUMED:
            health.stalled_since = None
            await self._say(record, f"{verdict.reason}; running on {record.workers()} learner(s)")
        else:
            self._busy[record.job_id] = self._spawn(
                self._run_worker(record, JobWork(retry=verdict.reason), []),
                f"scheduler-job-{record.job_id}",
            )

    async def _take_over(self, record: JobRecord) -> bool:
        """Coordinator failover: the job's coordinator shard has been unreachable for the
        grace. Make the next shard after it that answers the job's coordinator (TakeOverJob,
        coordinator epoch + 1, the job's sync mode): it fences the shards left, rebuilds the
        coordinator's state and promotes the lost slice's replica (collective mode: takes the
        state from the re-joining learners and hosts the rendezvous), with no rewind. Then
        publish the move in etcd (``shoal.contract.data_plane``, fenced by this scheduler's
        leadership); the watch re-points the job. False (the checkpoint path goes on) with
        failover off, when no shard could take over (their states differ, all unreachable),
        or when tried less than a grace ago."""
        job_id = record.job_id
        if (
            not self.config.health.coordinator_failover
            or not record.opened
            or record.coordinator_index < 0
            or record.job.effective_sync_mode
            not in (job_pb2.SYNC_MODE_PARAMETER_SERVER, job_pb2.SYNC_MODE_COLLECTIVE)
        ):
            return False
        now = self.clock()
        if now - self._takeover_tried.get(job_id, -1e18) < max(
            2.0, self.config.health.unreachable_grace_s
        ):
            return False
        self._takeover_tried[job_id] = now
        shards = self.shards()
        lost = record.coordinator_index
        if len(shards) < 2 or lost >= len(shards):
            return False
        known = self.moves.get(job_id)
        published = known.epoch if known is not None else 0
        # What the shards say first: a leader that died between a TakeOverJob (or an OpenJob
        # that took a higher epoch) and its publish in etcd left a coordinator this leader
        # does not know of. If it answers, follow it; otherwise take an epoch above it, never
        # the same one (two coordinators at one epoch could not be told apart by the fence).
        claimed, seen = await self._coordinator_claims(job_id, shards, lost)
        if claimed is not None and claimed.epoch > published:
            log.warning(
                "job %s: shard %d coordinates it already (epoch %d, never published: a leader "
                "died before it could); following it",
                job_id,
                claimed.index,
                claimed.epoch,
            )
            await self._publish_move(record, claimed)
            return True
        epoch = max(published, seen) + 1
        request = ps_pb2.TakeOverJobRequest(
            job_id=job_id,
            spec=record.job.spec,
            storage_uri=self.storage.uri,
            shard_addresses=list(shards),
            fencing_token=self._token,
            owner=record.owner,
            lost_shard_index=lost,
            coordinator_epoch=epoch,
            sync_mode=record.job.effective_sync_mode,
        )
        for step in range(1, len(shards)):
            index = (lost + step) % len(shards)
            try:
                await self.peers.shard(shards[index]).TakeOverJob(
                    request, timeout=self.config.call_timeout_s
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() in UNREACHABLE:
                    continue
                log.warning(
                    "job %s: shard %d cannot take the coordinator role over: %s",
                    job_id,
                    index,
                    describe(exc),
                )
                return False
            log.warning(
                "job %s: coordinator shard %d lost; shard %d took the role over (epoch %d)",
                job_id,
                lost,
                index,
                epoch,
            )
            await self._publish_move(
                record, CoordinatorRecord(address=shards[index], index=index, epoch=epoch)
            )
            return True
        return False

    async def _coordinator_claims(
        self, job_id: str, shards: list[str], lost: int
    ) -> tuple[CoordinatorRecord | None, int]:
        """FindCoordinator on every shard but the lost one: the shard that answers it is the
        job's coordinator itself, with the highest such epoch (None: none does), and the highest
        epoch any shard knows for the job (0: none). Shards that do not answer are skipped."""
        request = ps_pb2.FindCoordinatorRequest(job_id=job_id)

        async def ask(address: str) -> ps_pb2.FindCoordinatorResponse | None:
            try:
                return await self.peers.shard(address).FindCoordinator(
                    request, timeout=min(self.config.call_timeout_s, 5.0)
                )
            except grpc.aio.AioRpcError:
                return None

        others = [i for i in range(len(shards)) if i != lost]
        replies = await asyncio.gather(*(ask(shards[i]) for i in others))
        claimed: CoordinatorRecord | None = None
        seen = 0
        for i, reply in zip(others, replies, strict=True):
            if reply is None:
                continue
            seen = max(seen, int(reply.coordinator_epoch))
            if reply.coordinator_address == shards[i] and reply.coordinator_epoch > 0:
                if claimed is None or reply.coordinator_epoch > claimed.epoch:
                    claimed = CoordinatorRecord(
                        address=shards[i], index=i, epoch=int(reply.coordinator_epoch)
                    )
        return claimed, seen

    async def _retry(self, record: JobRecord, reason: str) -> None:
        """A stalled job starts over from its latest checkpoint: stop its learners, close its
        data plane on every shard (whatever answers), and let the next cycle open it again
        (OpenJob resumes from the checkpoint) and start learners."""
        if record.state not in STARTED_STATES:
            return
        log.warning("job %s: %s", record.job_id, reason)
        record.recoveries += 1
        health = self._health(record)
        health.restarted(self.clock())
        await self._recovering(record, reason)
        live = [lid for lid, lr in record.learners.items() if lr.phase is not LearnerPhase.PENDING]
        if live:
            await self._stop(record, live)
        if record.opened:
            await self._close_everywhere(record)
        record.opened = False
        record.closed = False
        # The coordinator may answer again (a fresh shard): the next open finds out.
        health.unreachable_since = None
        await self.table.save(record)

    async def _close_everywhere(self, record: JobRecord) -> None:
        """CloseJob on every shard that answers (a dead coordinator cannot tell its peers)."""
        request = ps_pb2.CloseJobRequest(job_id=record.job_id, fencing_token=self._token)

        async def close(address: str) -> None:
            try:
                await self.peers.shard(address).CloseJob(
                    request, timeout=min(5.0, self.config.call_timeout_s)
                )
            except grpc.aio.AioRpcError as exc:
                check_fenced(exc)
                log.debug("CloseJob %s on %s: %s", record.job_id, address, describe(exc))

        addresses = dict.fromkeys([record.coordinator_address, *self.shards()])
        await asyncio.gather(*(close(a) for a in addresses if a))

    async def _complete(self, record: JobRecord) -> None:
        now = self.clock()
        for lr in record.learners.values():
            if lr.phase in HOLDING:
                lr.set_phase(LearnerPhase.RETIRING, now)  # they get DONE at their boundary
        await self._transition(record, S.JOB_STATE_COMPLETED, "all epochs ran")

    async def _fail(self, record: JobRecord, reason: str) -> None:
        if record.active:
            log.warning("job %s failed: %s", record.job_id, reason)
            await self._transition(record, S.JOB_STATE_FAILED, reason)

    async def _finish(self, record: JobRecord) -> None:
        if record.learners:
            return
        if record.opened and not record.closed:
            try:
                await self.peers.shard(record.coordinator_address).CloseJob(
                    ps_pb2.CloseJobRequest(job_id=record.job_id, fencing_token=self._token),
                    timeout=self.config.call_timeout_s,
                )
            except grpc.aio.AioRpcError as exc:
                check_fenced(exc)
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise
            record.closed = True
            await self.table.save(record)
        if record.state == S.JOB_STATE_CANCELLING:
            await self._transition(record, S.JOB_STATE_CANCELLED, "cancelled")

    # -- progress -------------------------------------------------------------------------------

    async def _progress_loop(self) -> None:
        """Poll the coordinators of running jobs every resync interval (PROGRESS events;
        completion)."""
        limit = asyncio.Semaphore(32)

        async def poll(record: JobRecord) -> None:
            async with limit:
                try:
                    if record.opened:
                        await self._poll_progress(record)
                    await self._assess(record)
                except (grpc.aio.AioRpcError, Unavailable, TimeoutError, StoreConflict) as exc:
                    log.debug("progress of %s: %s", record.job_id, describe(exc))
                except (NotLeader, FencedOutByPeer, LeadershipLost) as exc:
                    self._depose(str(exc))

        while True:
            started = [r for r in self.table.records.values() if r.state in STARTED_STATES]
            for job_id in [j for j in self.health if j not in self.table.records]:
                del self.health[job_id]
            if started:
                await asyncio.gather(*(poll(r) for r in started))
            await asyncio.sleep(self.config.resync_interval_s)

    async def _watch_rescales(self) -> None:
        """While a rescale waits on a coordinator (a drain, a join, a first step), ask it for
        the job's membership every ``rescale_poll_s``: the phases end within that of the
        event. For the traces only: nothing here changes a job (``_poll_progress`` does)."""

        async def poll(record: JobRecord) -> None:
            try:
                response = await self.peers.shard(record.coordinator_address).GetJobProgress(
                    ps_pb2.GetJobProgressRequest(job_id=record.job_id),
                    timeout=self.config.call_timeout_s,
                )
            except grpc.aio.AioRpcError as exc:
                log.debug("membership of %s: %s", record.job_id, describe(exc))
                return
            self.rescales.observe(
                record, response.member_learner_ids, response.progress.completed_iterations
            )

        while True:
            await asyncio.sleep(self.config.rescale_poll_s)
            waiting = [self.table.records.get(job_id) for job_id in self.rescales.awaiting()]
            records = [r for r in waiting if r is not None and r.opened and r.coordinator_address]
            if records:
                await asyncio.gather(*(poll(r) for r in records))
