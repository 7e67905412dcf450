"""The I/O of one job's worker: exits, losses, retires, stops, growth (open, acquire, start).

These are methods of :class:`~shoal.scheduler.reconcile.loop.Reconciler` (a mixin: the state
lives there); the cycle hands each job's :class:`JobWork` to :meth:`JobWorkers._run_worker`,
at most one per job at a time."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Sequence

import grpc
from google.protobuf.duration_pb2 import Duration
from opentelemetry import trace

from shoal.contract.data_plane import CoordinatorRecord
from shoal.contract.errors import NotLeader, ShoalError, Unavailable
from shoal.runtime.election import LeadershipLost
from shoal.scheduler.health import lost_reason
from shoal.scheduler.jobs import (
    HOLDING,
    LEAVING,
    STARTED_STATES,
    JobRecord,
    LearnerPhase,
    LearnerRecord,
    state_name,
)
from shoal.scheduler.reconcile.peers import (
    TRANSIENT_CODES,
    UNREACHABLE,
    FencedOutByPeer,
    PermanentFailure,
    check_fenced,
    describe,
)
from shoal.scheduler.reconcile.rules import coordinator_index, learner_env, resolve_sync_mode
from shoal.scheduler.reconcile.work import Backoff, JobWork
from shoal.scheduler.store import StoreConflict
from shoal.scheduler.tracing import job_context
from shoal.v1 import (
    host_agent_service_pb2 as ha_pb2,
    job_pb2,
    parameter_sync_service_pb2 as ps_pb2,
    resource_manager_service_pb2 as rm_pb2,
    resources_pb2,
)

log = logging.getLogger(__name__)
_tracer = trace.get_tracer(__name__)

S = job_pb2


class JobWorkers:
    """The worker of one job (part of :class:`Reconciler`)."""

    # -- the worker of one job --------------------------------------------------------------------

    async def _run_worker(self, record: JobRecord, work: JobWork, causes: list[str]) -> None:
        job_id = record.job_id
        before = record.workers()
        try:
            self._check_leader()
            # In the job's trace (its submit), linked to the cycle that dispatched it: it
            # reaches the peers through the gRPC interceptors and the learners through
            # TRACEPARENT.
            cycle = trace.get_current_span().get_span_context()
            with _tracer.start_as_current_span(
                "reconcile job",
                context=job_context(record),
                attributes={"shoal.job_id": job_id},
                links=[trace.Link(cycle)] if cycle.is_valid else None,
            ):
                await self._work(record, work, causes)
            self._backoff.pop(job_id, None)
        except (LeadershipLost, NotLeader, FencedOutByPeer) as exc:
            self._depose(f"job {job_id}: {exc}")
        except StoreConflict as exc:
            log.error("job %s: %s; reloading it from the store", job_id, exc)
            with contextlib.suppress(ShoalError):
                await self.table.reload(job_id)
            self._note_backoff(job_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            transient = isinstance(exc, Unavailable | TimeoutError) or (
                isinstance(exc, grpc.aio.AioRpcError) and exc.code() in TRANSIENT_CODES
            )
            if not transient:
                log.exception("job %s: reconcile failed", job_id)
            else:
                log.info("job %s: transient failure, backing off: %s", job_id, describe(exc))
            self._note_backoff(job_id)
        finally:
            self._busy.pop(job_id, None)
            self.table.mark(job_id)  # observe it again: the worker changed its record
            with contextlib.suppress(Exception):
                await self._note_allocation(record, before, work, causes)
            self.trigger()

    def _note_backoff(self, job_id: str) -> None:
        prev = self._backoff.get(job_id)
        delay = (
            self.config.backoff_initial_s
            if prev is None
            else min(prev.delay * 2, self.config.backoff_max_s)
        )
        self._backoff[job_id] = Backoff(self.clock() + delay, delay)
        self._wake_at(self.clock() + delay)

    async def _note_allocation(
        self, record: JobRecord, before: int, work: JobWork, causes: list[str]
    ) -> None:
        """Record an allocation event when the job's worker count changed."""
        if not self.table.leading or self.table.records.get(record.job_id) is not record:
            return
        history = self.table.histories.get(record.job_id)
        last = history[-1].workers if history else 0
        workers = record.workers()
        if workers == last:
            return
        parts = []
        if workers > before:
            parts.append(f"{workers - before} learner(s) started")
        if work.retires:
            parts.append(f"{len(work.retires)} learner(s) retiring")
        if work.lost:
            parts.append(f"{len(work.lost)} learner(s) lost ({work.lost[0][1]})")
        if work.exits:
            parts.append(f"{len(work.exits)} learner(s) exited")
        if work.stops:
            parts.append(f"{len(work.stops)} learner(s) stopped")
        if not record.active:
            parts.append(f"job {state_name(record.state)}")
        reason = "; ".join(parts) or "allocation changed"
        if causes:
            reason += f" (after: {', '.join(causes)})"
        await self.table.add_allocation_event(record, workers, record.job.target_workers, reason)
        record.sync_counts()
        if record.state == S.JOB_STATE_RUNNING and record.job.state_reason.startswith("running on"):
            # The reason tells how many learners run now, not how many ran when it started.
            record.job.state_reason = f"running on {workers} learner(s)"
            self.table.publish(record, S.JOB_EVENT_KIND_STATE)

    async def _work(self, record: JobRecord, work: JobWork, causes: list[str]) -> None:
        if work.retry:
            await self._retry(record, work.retry)
            return
        dirty = work.save
        if work.drop_pending:
            for lid in work.drop_pending:
                record.learners.pop(lid, None)
            dirty = True
        if work.exits:
            await self._process_exits(record, work.exits)
            dirty = False
        if work.lost:
            await self._process_lost(record, work.lost)
            dirty = False
        if work.retires and record.active:
            with self.rescales.phase(record.job_id, "drain", work.retires):
                await self._retire(record, work.retires)
            dirty = False
        if work.stops:
            await self._stop(record, work.stops)
            dirty = False
        if self._held(record.job_id) and (work.starts or work.restarts):
            # Its coordinator turned out unreachable while this work ran (an evict above):
            # learners started now could not sync. They start once it answers again.
            for lr in work.starts:
                if record.learners.get(lr.learner_id) is lr and lr.phase is LearnerPhase.PENDING:
                    del record.learners[lr.learner_id]
            work.starts, work.restarts = [], []
            dirty = True
        if work.restarts and record.active:
            with self.rescales.phase(record.job_id, "start", work.restarts):
                await self._start_learners(
                    record,
                    [record.learners[lid] for lid in work.restarts if lid in record.learners],
                )
        if work.starts:
            with self.rescales.phase(record.job_id, "start", [lr.learner_id for lr in work.starts]):
                await self._grow(record, work.starts)
            dirty = False
        if work.finish:
            await self._finish(record)
            dirty = False
        if work.requeue and record.state in STARTED_STATES and not record.learners:
            await self._transition(
                record,
                S.JOB_STATE_QUEUED,
                "all its learners were preempted or lost; waiting "
                "for devices (it resumes from its latest state)",
            )
            dirty = False
        if dirty:
            await self.table.save(record)

    # -- exits, losses --------------------------------------------------------------------------

    async def _release(self, allocation_ids: Sequence[str]) -> None:
        ids = [a for a in allocation_ids if a]
        if not ids:
            return
        request = rm_pb2.ReleaseDevicesRequest(fencing_token=self._token, allocation_ids=ids)
        try:
            await self.peers.rm_call("ReleaseDevices", request, self.config.call_timeout_s)
        except grpc.aio.AioRpcError as exc:
            check_fenced(exc)
            raise
        self.inventory.released(ids)

    async def _evict(self, record: JobRecord, learner_id: str, reason: str) -> None:
        if not record.opened or not record.coordinator_address:
            return
        request = ps_pb2.EvictLearnerRequest(
            job_id=record.job_id, learner_id=learner_id, reason=reason, fencing_token=self._token
        )
        try:
            await self.peers.shard(record.coordinator_address).EvictLearner(
                request, timeout=self.config.call_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            check_fenced(exc)
            if exc.code() in UNREACHABLE:
                # The coordinator is down: its membership is gone with it (a re-open starts
                # afresh). Waiting for it here would keep every exit unprocessed, and the job
                # reported with learners that no longer run.
                log.info("job %s: evict %s: %s", record.job_id, learner_id, describe(exc))
                self._unreachable(record, exc)
                return
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise

    async def _process_exits(
        self, record: JobRecord, exits: Sequence[resources_pb2.Learner]
    ) -> None:
        """Exits the agents reported: evict a learner that died while its job runs (its
        iteration must be re-run), release its device (only now), forget it. A clean exit of
        a learner that was not leaving means the job may be done; a failure of one counts
        (once per batch: a whole generation dying at once is one failure)."""
        now = self.clock()
        check_done = False
        failures: list[str] = []
        for learner in exits:
            lr = record.learners.get(learner.learner_id)
            if lr is None:
                self.exits.pop(learner.learner_id, None)
                continue
            leaving = lr.phase in LEAVING or not record.active
            why = learner.exit_reason or f"exit code {learner.exit_code}"
            ended = learner.end_time.seconds + learner.end_time.nanos / 1e9
            self.rescales.exited(record.job_id, lr.learner_id, ended or None)
            # A learner its agent reports FAILED with code 0 ended without training.
            failed = learner.exit_code != 0 or learner.state == resources_pb2.LEARNER_STATE_FAILED
            if failed and record.active:
                await self._evict(record, lr.learner_id, f"exited: {why}")
            if not leaving:
                if not failed:
                    check_done = True
                else:
                    failures.append(f"learner {lr.learner_id} on host {lr.host_id} failed: {why}")
            with self.rescales.phase(record.job_id, "device free", [lr.learner_id]):
                await self._release([lr.allocation_id])
            record.forget_learner(lr.learner_id, exit_code=learner.exit_code, reason=why, now=now)
            self.exits.pop(learner.learner_id, None)
        if failures:
            record.failures += 1
            record.last_failure = failures[-1]
            if len(failures) > 1:
                record.last_failure += f" (and {len(failures) - 1} more)"
        recovering = (
            record.state == S.JOB_STATE_RUNNING
            and self._held(record.job_id)
            and not record.workers()
        )
        if recovering:
            # Its learners died and its coordinator does not answer: its data plane is down.
            # Said at once (not after the grace): never RUNNING with no learner.
            health = self._health(record)
            health.entered_recovery()
            reason = lost_reason(health, self._shard_name(record))
            log.warning("job %s recovering: %s", record.job_id, reason)
            record.transition(S.JOB_STATE_RECOVERING, reason, now)
        await self.table.save(record)
        if recovering:
            self.table.publish(record, S.JOB_EVENT_KIND_STATE)
        if check_done and record.state in STARTED_STATES:
            await self._poll_progress(record)
        if (
            record.active
            and record.failures >= self.config.max_learner_failures
            and record.state != S.JOB_STATE_COMPLETED
        ):
            await self._fail(
                record,
                f"{record.failures} learner failures without progress; last: {record.last_failure}",
            )

    async def _process_lost(self, record: JobRecord, lost: Sequence[tuple[str, str]]) -> None:
        now = self.clock()
        for learner_id, why in lost:
            lr = record.learners.get(learner_id)
            if lr is None:
                continue
            if record.active and lr.phase is not LearnerPhase.PENDING:
                await self._evict(record, learner_id, why)
            self.rescales.lost(record.job_id, learner_id)
            with self.rescales.phase(record.job_id, "device free", [learner_id]):
                await self._release([lr.allocation_id])
            record.forget_learner(learner_id, exit_code=None, reason=why, now=now)
            self.exits.pop(learner_id, None)
        await self.table.save(record)

    # -- retire, stop -----------------------------------------------------------------------------

    async def _retire(self, record: JobRecord, learner_ids: Sequence[str]) -> None:
        ids = [lid for lid in learner_ids if lid in record.learners]
        if not ids:
            return
        now = self.clock()
        if not record.opened:
            await self._stop(record, ids)
            return
        request = ps_pb2.RetireLearnersRequest(
            job_id=record.job_id, learner_ids=ids, fencing_token=self._token
        )
        try:
            await self.peers.shard(record.coordinator_address).RetireLearners(
                request, timeout=self.config.call_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            check_fenced(exc)
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise
            # Not members (yet): no iteration of theirs can be lost; stop them directly.
            await self._stop(record, ids)
            return
        shrunk = False
        for lid in ids:
            lr = record.learners.get(lid)
            if lr is not None and lr.phase in HOLDING:
                lr.set_phase(LearnerPhase.RETIRING, now)
                shrunk = True
        if shrunk:  # (not a retire told again to a coordinator that moved)
            record.last_shrunk_at = now
        await self.table.save(record)

    async def _stop(self, record: JobRecord, learner_ids: Sequence[str]) -> None:
        now = self.clock()
        grace = Duration()
        grace.FromMilliseconds(int(self.config.stop_grace_s * 1000))
        targets = [record.learners[lid] for lid in learner_ids if lid in record.learners]
        for lr in targets:
            if record.active and lr.phase in HOLDING:
                record.last_shrunk_at = now
            lr.set_phase(LearnerPhase.STOPPING, now)
        await self.table.save(record)

        async def stop(lr: LearnerRecord) -> resources_pb2.Learner | None:
            request = ha_pb2.StopLearnerRequest(learner_id=lr.learner_id, grace=grace)
            try:
                response = await self.peers.agent(lr.agent_address).StopLearner(
                    request, timeout=self.config.stop_grace_s + self.config.call_timeout_s
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    # The agent never started it (or forgot it): it runs nowhere.
                    return resources_pb2.Learner(
                        learner_id=lr.learner_id,
                        state=resources_pb2.LEARNER_STATE_FAILED,
                        exit_code=-1,
                        exit_reason="not running on its agent",
                    )
                log.info("StopLearner %s: %s", lr.learner_id, describe(exc))
                return None
            learner = response.learner
            if learner.state in (
                resources_pb2.LEARNER_STATE_SUCCEEDED,
                resources_pb2.LEARNER_STATE_FAILED,
            ):
                return learner
            return None

        results = await asyncio.gather(*(stop(lr) for lr in targets))
        exited = [r for r in results if r is not None]
        for learner in exited:
            self.exits.setdefault(learner.learner_id, learner)
        if exited:
            await self._process_exits(record, exited)

    # -- grow ---------------------------------------------------------------------------------

    async def _ensure_open(self, record: JobRecord, placed: Sequence[LearnerRecord]) -> None:
        shards = self.shards()
        if not shards:
            raise Unavailable("no parameter-sync shard is known yet (registry incomplete)")
        if record.coordinator_index < 0 or not record.coordinator_address:
            moved = self.moves.get(record.job_id)
            if moved is not None:
                record.coordinator_index = moved.index
                record.coordinator_address = moved.address
            else:
                record.coordinator_index = coordinator_index(record.job_id, len(shards))
                record.coordinator_address = shards[record.coordinator_index]
        if record.job.effective_sync_mode == job_pb2.SYNC_MODE_UNSPECIFIED:
            record.job.effective_sync_mode = resolve_sync_mode(  # type: ignore[assignment]
                record.job.spec.sync_mode, [(lr.host_id, lr.simulated) for lr in placed]
            )
        if record.opened:
            return
        # A job whose coordinator role moved before (a takeover) is opened above that epoch, so
        # the shards that still fence the job at it take the new coordinator's calls.
        known = self.moves.get(record.job_id)
        request = ps_pb2.OpenJobRequest(
            job_id=record.job_id,
            spec=record.job.spec,
            storage_uri=self.storage.uri,  # the root: shards write jobs/<job_id>/ under it
            shard_addresses=list(shards),
            fencing_token=self._token,
            owner=record.owner,
            coordinator_epoch=known.epoch + 1 if known is not None else 0,
        )
        try:
            response = await self.peers.shard(record.coordinator_address).OpenJob(
                request, timeout=self.config.call_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            check_fenced(exc)
            if exc.code() in UNREACHABLE and record.state in STARTED_STATES:
                self._health(
                    record
                ).last_error = f"OpenJob: {self._shard_name(record)} unreachable: {exc.code().name}"
            if exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED):
                raise PermanentFailure(
                    f"OpenJob on {record.coordinator_address} failed: {describe(exc)}"
                ) from exc
            raise
        record.opened = True
        record.closed = False
        if response.coordinator_epoch > (known.epoch if known is not None else 0):
            await self._publish_move(
                record,
                CoordinatorRecord(
                    address=record.coordinator_address,
                    index=record.coordinator_index,
                    epoch=response.coordinator_epoch,
                ),
            )
        if response.HasField("progress"):
            record.job.progress.CopyFrom(response.progress)
        health = self.health.get(record.job_id)
        if health is not None:
            health.reopened(response.progress.completed_iterations)
        if record.state == S.JOB_STATE_RECOVERING:
            await self._recovering(
                record,
                f"data plane re-opened on coordinator {self._shard_name(record)}, resumed at "
                f"iteration {response.progress.completed_iterations}"
                + (" (from the latest checkpoint)" if response.resumed else " (from the start)")
                + "; waiting for the first committed iteration",
            )

    async def _grow(self, record: JobRecord, pending: list[LearnerRecord]) -> None:
        job_id = record.job_id

        def drop_pending() -> None:
            for lr in pending:
                if record.learners.get(lr.learner_id) is lr and lr.phase is LearnerPhase.PENDING:
                    del record.learners[lr.learner_id]

        try:
            await self._ensure_open(record, pending)
            await self.table.save(record)  # the PENDING learners, before acquiring
            claims = [
                rm_pb2.DeviceClaim(
                    job_id=job_id,
                    learner_id=lr.learner_id,
                    host_id=lr.host_id,
                    device_id=lr.device_id,
                )
                for lr in pending
            ]
            request_id = hashlib.sha256(
                ",".join(lr.learner_id for lr in pending).encode()
            ).hexdigest()[:32]
            request = rm_pb2.AcquireDevicesRequest(
                fencing_token=self._token, claims=claims, request_id=request_id
            )
            try:
                response = await self.peers.rm_call(
                    "AcquireDevices", request, self.config.call_timeout_s
                )
            except grpc.aio.AioRpcError as exc:
                check_fenced(exc)
                raise
        except PermanentFailure as exc:
            drop_pending()
            await self._fail(record, str(exc))
            return
        except BaseException:
            drop_pending()
            with contextlib.suppress(Exception):
                await self.table.save(record)
            raise
        now = self.clock()
        self.inventory.allocated(response.allocations)
        by_learner = {a.learner_id: a for a in response.allocations}
        for lr in pending:
            allocation = by_learner.get(lr.learner_id)
            if allocation is None:
                continue
            lr.allocation_id = allocation.allocation_id
            if allocation.host_incarnation:
                lr.host_incarnation = allocation.host_incarnation
            if lr.phase is LearnerPhase.PENDING:
                lr.set_phase(LearnerPhase.STARTING, now)
        drop_pending()  # any claim the response did not answer
        await self.table.save(record)
        if record.active:
            await self._start_learners(
                record, [lr for lr in pending if lr.phase is LearnerPhase.STARTING]
            )

    async def _start_learners(self, record: JobRecord, learners: Sequence[LearnerRecord]) -> None:
        if not learners:
            return
        if not record.opened:
            await self._ensure_open(record, learners)
        spec = record.job.spec
        storage_uri = self.storage.uri
        mint = self.config.learner_credentials

        async def start(lr: LearnerRecord) -> BaseException | None:
            request = ha_pb2.StartLearnerRequest(
                learner_id=lr.learner_id,
                job_id=record.job_id,
                device_id=lr.device_id,
                artifact_id=spec.artifact_id,
                entry_point=spec.entry_point,
                args=list(spec.args),
                env=learner_env(
                    record,
                    lr.learner_id,
                    shards=self.shards(),
                    storage_uri=storage_uri,
                    token=mint(record.job_id, lr.learner_id, lr.allocation_id) if mint else None,
                    trace_every=self.config.trace_every,
                    collective_timeout_s=self.config.collective_timeout_s,
                ),
                allocation_id=lr.allocation_id,
                fencing_token=self._token,
            )
            try:
                await self.peers.agent(lr.agent_address).StartLearner(
                    request, timeout=self.config.start_timeout_s
                )
            except grpc.aio.AioRpcError as exc:
                check_fenced(exc)
                return exc
            if lr.phase is LearnerPhase.STARTING:
                lr.set_phase(LearnerPhase.RUNNING, self.clock())
            return None

        results = await asyncio.gather(*(start(lr) for lr in learners))
        started = sum(1 for r in results if r is None)
        if started and record.state == S.JOB_STATE_QUEUED:
            self.health.pop(record.job_id, None)  # a fresh stall timeout from now
            record.transition(
                S.JOB_STATE_RUNNING, f"running on {record.workers()} learner(s)", self.clock()
            )
            await self.table.save(record)
            self.table.publish(record, S.JOB_EVENT_KIND_STATE)
        else:
            await self.table.save(record)
        for lr, result in zip(learners, results, strict=True):
            if isinstance(result, grpc.aio.AioRpcError) and result.code() in (
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.NOT_FOUND,
                grpc.StatusCode.PERMISSION_DENIED,
            ):
                await self._fail(
                    record,
                    f"StartLearner {lr.learner_id} on host {lr.host_id} failed: {describe(result)}",
                )
                return
        errors = [r for r in results if r is not None]
        if errors:
            raise errors[0]
