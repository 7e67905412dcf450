"""The ``"grpc"`` sync backend: a learner of a job on shoal's parameter-sync shards.

Per learner (see docs/data-plane.md for the protocol):

* :meth:`GrpcBackend.initialize` joins the job at the coordinator with the model's tensor
  layout and the optimizer. The first learner of a new job uploads the initial parameters to
  every shard (``InitializeParameters``); any other learner defers its state to its first
  assignment, which says ``pull_parameters`` (:meth:`GrpcBackend.pull_parameters` streams the
  current values from every shard, ``PullParameters``).
* :meth:`GrpcBackend.next_assignment` is the ``Boundary`` call: it reports the loss of the
  iteration just completed and returns the next assignment (or retire, or None when done).
  After a sync it was sent already, beside the ``SyncStep`` (``ahead``, ``SHOAL_BOUNDARY_AHEAD``):
  the coordinator held it until the iteration committed; ``next_assignment`` reads its answer.
* :meth:`GrpcBackend.sync` opens one ``SyncStep`` stream per shard, concurrently: the header,
  then this learner's gradients and buffers for that shard's tensors as raw little-endian
  chunks; each shard answers with its new parameters once every member has contributed and
  every shard is ready. ABORTED (a member was evicted), a stale generation, or a shard that is
  down or restarted without the job (UNAVAILABLE, DEADLINE_EXCEEDED, NOT_FOUND on a tensor
  stream, pulls included) raise :class:`~shoal.learner.backend.IterationAborted`: the next
  boundary re-issues the iteration (after the coordinator recovered the shard's slice).

The connection (the asyncio loop on a background thread that gRPC runs on, the channels, the
routing, following the coordinator) is a :class:`~shoal.learner.shard_session.ShardSession`
the backend holds; the messages it exchanges with the coordinator are built by
``coordinator_messages.py``; the shards' answers are read by ``grpc_receive.py`` (part of the
backend). The environment contract (``shoal.learner.env``): SHOAL_JOB_ID,
SHOAL_LEARNER_ID, SHOAL_COORDINATOR (default: the first of SHOAL_SYNC_ENDPOINTS), SHOAL_TOKEN.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
from google.protobuf.message import DecodeError
from grpc import aio

from shoal.client.tls import TLSFiles
from shoal.contract import lane_control
from shoal.contract.shm import LaneError
from shoal.contract.wire import (
    DEFAULT_CHUNK_BYTES,
    MAX_INLINE_BYTES,
    TensorMeta,
    byte_view,
    decode_frame,
    encode_chunks,
    encode_header,
    header_of,
    inline_bytes,
    pack_layout,
)
from shoal.learner.backend import (
    Assignment,
    Contribution,
    EpochReport,
    InitialState,
    IterationAborted,
    ModelState,
    SyncBackend,
    SyncResult,
    TrainingPlan,
    TrainingSetup,
    register_backend,
    registered_backends,
)
from shoal.learner.coordinator_messages import (
    UserMetrics,
    adopted_plan,
    assignment_of,
    boundary_request,
    join_request,
    layout_of,
)
from shoal.learner.early_forward import ArrivingTensors, early_forward_enabled
from shoal.learner.env import LearnerEnv
from shoal.learner.grpc_calls import (
    _SHARD_LOST_PAUSE_S,
    LearnerEvicted,
    _bytes_of,
    _cpu,
    _refusal_of,
    _Shard,
    _shard_lost,
    _translate,
    _why,
    boundary_ahead_enabled,
    inline_bytes_from_env,
    optimizer_proto,
    stream_methods,
)
from shoal.learner.grpc_lane import (
    LaneControl,
    NoAnswer,
    lane_control_enabled,
    lane_refused,
    open_lane,
    shm_lane_enabled,
    traced,
    wait_any,
)
from shoal.learner.grpc_receive import AnswerReceiving, answer_of
from shoal.learner.liveness import CoordinatorMoved
from shoal.learner.ps_overlap import StreamedGradients, overlap_enabled
from shoal.learner.shard_session import ShardSession
from shoal.v1 import job_pb2, parameter_sync_service_pb2 as ps_pb2

__all__ = [
    "BACKEND_NAME",
    "GrpcBackend",
    "LearnerEvicted",
    "optimizer_proto",
    "session_options",
    "stream_methods",
]

log = logging.getLogger("shoal.learner.grpc")
T = TypeVar("T")

BACKEND_NAME = "grpc"


def session_options(env: LearnerEnv, what: str) -> dict[str, Any]:
    """The :class:`ShardSession` arguments of a learner from its environment contract."""
    if env.job_id is None or env.learner_id is None or env.coordinator is None:
        raise ValueError(
            f"the {what} needs SHOAL_JOB_ID, SHOAL_LEARNER_ID and SHOAL_COORDINATOR "
            f"(or SHOAL_SYNC_ENDPOINTS); got job {env.job_id!r}, learner "
            f"{env.learner_id!r}, coordinator {env.coordinator!r}"
        )
    return {
        "job_id": env.job_id,
        "learner_id": env.learner_id,
        "coordinator": env.coordinator,
        "token": env.token,
        "tls": TLSFiles(env.tls_ca, env.tls_cert, env.tls_key) if env.tls_ca else None,
        "sync_endpoints": env.sync_endpoints,
    }


class GrpcBackend(AnswerReceiving, SyncBackend):
    """The parameter-server client of one learner (see the module docstring).

    ``channel_options`` are extra gRPC channel options. ``retry_s`` bounds how long the
    control calls (Join, Boundary) retry while the coordinator is unreachable.
    """

    #: The mode this backend joins a job in (the first Join fixes the job's).
    SYNC_MODE: int = job_pb2.SYNC_MODE_PARAMETER_SERVER

    def __init__(
        self,
        *,
        job_id: str,
        learner_id: str,
        coordinator: str,
        token: str | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        retry_s: float = 30.0,
        channel_options: Sequence[tuple[str, Any]] = (),
        tls: TLSFiles | None = None,
        sync_endpoints: Sequence[str] = (),
        shm_lane: bool = True,
    ) -> None:
        self.session = ShardSession(
            job_id=job_id,
            learner_id=learner_id,
            coordinator=coordinator,
            token=token,
            retry_s=retry_s,
            channel_options=channel_options,
            tls=tls,
            sync_endpoints=sync_endpoints,
        )
        self.job_id = job_id
        self.learner_id = learner_id
        self._metadata = self.session.metadata
        # A shard refused this learner's SyncStep as stale and said its generation floor: the
        # next Boundary tells the coordinator (which re-issues the iteration above the floor if
        # it drifted above its generation; docs/data-plane.md, "Generation floor drift").
        self._stale_refusal: ps_pb2.StaleRefusal | None = None
        self._chunk_bytes = chunk_bytes
        self._setup: TrainingSetup | None = None
        self._plan: TrainingPlan | None = None
        self._layout: list[TensorMeta] = []
        self._recv: list[torch.Tensor] = []
        self._recv_bytes: list[np.ndarray] = []
        self._recv_source: list[tuple[bytes, int, int] | None] = []
        self._generation = 0  # of the last assignment (pulls are checked against it)
        self._report = (0, -1, 0.0, 0)  # generation, completed iteration, loss_sum, samples
        self._user: UserMetrics = (-1, {})  # trainer.log
        # Same-host shards: move SyncStep bytes through shared memory (grpc_lane.py), and
        # the headers through the lane's control connection (SHOAL_LANE_CONTROL).
        self._shm_lane = shm_lane
        self.lane_control = lane_control_enabled()
        # A bundle of at most this many bytes goes as one message each way (the bytes in the
        # header; SHOAL_INLINE_KB; 0: chunks only).
        self.inline_bytes = inline_bytes_from_env()
        #: Bundles sent as one message (gradients) and answers read as one (summed over the run).
        self.inline_bundles = [0, 0]
        # Gradients streamed while backward runs (ps_overlap.py; SHOAL_PS_OVERLAP).
        self.ps_overlap = overlap_enabled()
        self._streamed: StreamedGradients | None = None
        # sync returns once every answer's header arrived (early_forward.py;
        # SHOAL_PS_EARLY_FORWARD): the answers of the last sync, still arriving.
        self.early_forward = early_forward_enabled()
        self._arriving: ArrivingTensors | None = None
        self._arriving_next: ArrivingTensors | None = None  # of the sync under way
        self._rest: asyncio.Future[None] | None = None
        #: Tensors not complete when sync returned, still pending when the next forward
        #: started, and loaded by a module's forward pre-hook (summed over the run).
        self.early_tensors = [0, 0, 0]
        # The next Boundary goes beside each SyncStep (SHOAL_BOUNDARY_AHEAD): the call, sent
        # by the last successful sync, whose answer next_assignment reads (a lane's control
        # connection: sent on it by the trainer's thread, its answer read there too).
        self.boundary_ahead = boundary_ahead_enabled()
        self._ahead: asyncio.Future[ps_pb2.BoundaryResponse] | LaneControl | None = None
        #: Boundaries answered ahead / sent again after the ahead one failed (summed).
        self.ahead_boundaries = [0, 0]
        #: SyncSteps sent and answered on the trainer's thread (_sync_direct; summed).
        self.direct_syncs = 0
        # A SyncStep's layout, size and header's fixed part, by the tensors present (_bundle).
        self._bundles: dict[
            tuple[int, ...], tuple[list[TensorMeta], int, ps_pb2.TensorBundleHeader]
        ] = {}

    @classmethod
    def from_env(cls, env: LearnerEnv) -> GrpcBackend:
        return cls(
            **session_options(env, "grpc backend"),
            shm_lane=shm_lane_enabled(),
        )

    # -- the session's parts the tensor streams use -------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.session.run(coro)

    def _md(self) -> tuple[tuple[str, str], ...]:
        return self.session.md()

    def _watch(self, call: Awaitable[T]) -> Awaitable[T]:
        return self.session.watch(call)

    @property
    def _shards(self) -> list[_Shard]:
        return self.session.shards

    @property
    def _recheck_coordinator(self) -> bool:
        return self.session.recheck_coordinator

    @_recheck_coordinator.setter
    def _recheck_coordinator(self, value: bool) -> None:
        self.session.recheck_coordinator = value

    # -- initialize ---------------------------------------------------------------------------

    def initialize(self, setup: TrainingSetup) -> InitialState:
        if self._setup is not None:
            raise RuntimeError("initialize() was already called on this backend")
        self._setup = setup
        self._layout = layout_of(setup)
        self.session.rejoin = self._join
        self._recv = [torch.empty(m.shape, dtype=m.torch_dtype) for m in self._layout]
        self._recv_bytes = [_bytes_of(t) for t in self._recv]
        # Per receive tensor, the lane answer it views ((segment nonce, offset, size); None:
        # its own).
        self._recv_source = [None] * len(self._recv)
        md = self._md()
        reply = self._run(self._join(md))
        self._plan = adopted_plan(reply, setup.plan)
        if reply.initialize:
            log.info("initializing job %s", self.job_id)
            self._run(self._upload(setup, md))
            return InitialState(self._plan, setup.params, setup.buffers, 0)
        # The state comes with the first assignment (the job keeps training meanwhile).
        return InitialState(self._plan, None, None, self._run(self.session.completed(md)))

    async def _join(self, md: Any = None) -> ps_pb2.JoinResponse:
        assert self._setup is not None
        request = join_request(
            self.job_id, self.learner_id, self._layout, self._setup, self.SYNC_MODE
        )
        reply = await self.session.join(request, md)
        self.session.route(reply.shards, self._layout)
        return reply

    async def _upload(self, setup: TrainingSetup, md: Any = None) -> None:
        tensors = [*setup.params, *setup.buffers]

        async def one(shard: _Shard) -> None:
            assert shard.streams is not None
            sources = [_cpu(tensors[j]) for j in shard.tensors]
            metas, total = pack_layout([self._layout[j] for j in shard.tensors])
            header = header_of(
                job_id=self.job_id, sender_id=self.learner_id, metas=metas, total_bytes=total
            )

            async def messages() -> AsyncIterator[bytes]:
                yield encode_header(ps_pb2.InitializeParametersRequest, header)
                views = [byte_view(t) for t in sources]
                for chunk in encode_chunks(metas, views, total, self._chunk_bytes):
                    yield chunk

            try:
                await shard.streams["InitializeParameters"](
                    messages(), metadata=md or self._metadata
                )
            except aio.AioRpcError as exc:
                raise _translate(exc) from exc

        await asyncio.gather(*(one(s) for s in self._shards))

    # -- boundaries ---------------------------------------------------------------------------

    def log_metrics(self, step: int, metrics: Mapping[str, tuple[float, int]]) -> None:
        self._user = (step, dict(metrics))

    async def _boundary(
        self,
        md: Any = None,
        ahead: asyncio.Future[ps_pb2.BoundaryResponse] | None = None,
        answered: ps_pb2.BoundaryResponse | None = None,
    ) -> ps_pb2.BoundaryResponse:
        reply = answered  # (the answer to one sent ahead, read on the trainer's thread)
        if ahead is not None:
            try:
                reply = await ahead
                self.ahead_boundaries[0] += 1
            except Exception as exc:  # asked again below, as without ahead: the same report
                log.info("the Boundary sent ahead failed (%s); asking again", exc)
                self.ahead_boundaries[1] += 1
        if reply is None:
            request = boundary_request(self.job_id, self.learner_id, self._user, *self._report)
            refusal, self._stale_refusal = self._stale_refusal, None
            if refusal is not None:
                request.stale_refusal.CopyFrom(refusal)
            reply = await self.session.control("Boundary", request, md)
        if reply.routing_epoch > self.session.routing_epoch and reply.shards:
            # A lost shard's slice moved to its backup: send and pull there from now on.
            self.session.route(reply.shards, self._layout)
            self.session.routing_epoch = reply.routing_epoch
            log.warning("shards re-routed (routing epoch %d)", reply.routing_epoch)
        return reply

    def _answered_ahead(
        self, ahead: asyncio.Future[ps_pb2.BoundaryResponse] | None
    ) -> ps_pb2.BoundaryResponse | None:
        """The reply to the Boundary sent ahead when it has come already, read on this thread
        without a hop to the session's loop (~0.1 ms each way on the 2-core VMs); None when
        it has not, failed, or re-routes the shards (:meth:`_boundary` handles those on the
        loop). A done future's state and result no longer change, so reading them from this
        thread is safe."""
        if ahead is None or not ahead.done() or ahead.cancelled():
            return None
        if ahead.exception() is not None:
            return None
        reply = ahead.result()
        if reply.routing_epoch > self.session.routing_epoch and reply.shards:
            return None
        self.ahead_boundaries[0] += 1
        return reply

    def _direct_ahead(self, control: LaneControl) -> ps_pb2.BoundaryResponse | None:
        """The answer to the Boundary :meth:`_sync_direct` sent ahead on ``control``, read on
        this thread (past the watch's first wait, on the session's loop, watched for a
        coordinator that hangs); None when that failed: the caller asks again."""
        try:
            try:
                body = control.take(lane_control.BOUNDARY, self.session.watch_after_s)
            except NoAnswer:  # (a Boundary may wait long: the job rescaling)
                body = self._run(self._watched(control, lane_control.BOUNDARY))
            reply = ps_pb2.BoundaryResponse.FromString(body)
        except (LaneError, CoordinatorMoved, aio.AioRpcError, DecodeError) as exc:
            log.info("the Boundary sent ahead failed (%s); asking again", exc)
            self.ahead_boundaries[1] += 1
            return None
        if not self.session.accept(reply):  # a fenced coordinator's: asked again
            self.ahead_boundaries[1] += 1
            return None
        self.ahead_boundaries[0] += 1
        return reply

    async def _watched(self, control: LaneControl, method: bytes) -> bytes:
        """The answer to the ``method`` call in flight on ``control``, awaited on the loop,
        watched (a call that was waited on past the watch's first wait already)."""
        try:
            return await self.session.watch(control.answer(method), soon=True)
        except CoordinatorMoved:
            control.close()  # (its answer may still come on it: read by nobody)
            raise

    def next_assignment(self) -> Assignment | None:
        ahead, self._ahead = self._ahead, None
        answered = None
        if isinstance(ahead, LaneControl):
            answered, ahead = self._direct_ahead(ahead), None
            reply = answered
            if reply is not None and reply.routing_epoch > self.session.routing_epoch:
                reply = None  # (it re-routes the shards: on the loop)
        else:
            reply = self._answered_ahead(ahead)
        if reply is None:
            reply = self._run(self._boundary(self._md(), ahead, answered))
        plan = self._require_plan()
        if reply.action == ps_pb2.BOUNDARY_ACTION_RUN:
            self._generation = int(reply.assignment.generation)
        assignment = assignment_of(reply, plan, self._report[:2])
        if self._streamed is not None:
            self._streamed.assigned(assignment)
        return assignment

    def overlap_hooks(self, params: Sequence[Any]) -> StreamedGradients | None:
        """Hooks that stream the gradients to the shards while backward runs (ps_overlap.py);
        None when ``ps_overlap`` is off."""
        if not self.ps_overlap:
            return None
        if self._streamed is None:
            self._streamed = StreamedGradients(self, params)
        return self._streamed

    @property
    def tensors_sent(self) -> list[int]:
        """Parameters streamed by the hooks while backward ran, and in all."""
        return self._streamed.tensors_sent if self._streamed is not None else [0, 0]

    # -- parameters ---------------------------------------------------------------------------

    def pull_parameters(self) -> ModelState:
        """The job's current parameters and buffers from every shard (for a learner new in
        the generation of its last assignment). The tensors are reused by later calls."""
        setup = self._setup
        if setup is None:
            raise RuntimeError("initialize() must be called first")
        self._answers_ended()  # both write into the receive tensors
        self._run(self._pull(self._generation, self._md()))
        n = len(setup.param_specs)
        return ModelState(self._recv[:n], self._recv[n:])

    async def _pull(self, generation: int, md: Any = None) -> None:
        request = ps_pb2.PullParametersRequest(
            job_id=self.job_id,
            learner_id=self.learner_id,
            generation=generation,
            inline_answer_max_bytes=self.inline_bytes,
        )

        async def one(shard: _Shard) -> None:
            assert shard.streams is not None
            call = shard.streams["PullParameters"](request, metadata=md or self._metadata)
            await self._receive(shard, call)

        try:
            await self._watch(asyncio.gather(*(one(s) for s in self._shards)))
        except CoordinatorMoved as exc:  # a frozen coordinator's shard may be one of them
            raise IterationAborted("the job's coordinator moved") from exc
        except aio.AioRpcError as exc:
            if _shard_lost(exc):
                await asyncio.sleep(_SHARD_LOST_PAUSE_S)
                raise IterationAborted(_why(exc, None)) from exc
            raise _translate(exc) from exc

    # -- sync ---------------------------------------------------------------------------------

    def sync(
        self, assignment: Assignment, contribution: Contribution, *, lr: float | None = None
    ) -> SyncResult:
        setup = self._setup
        if setup is None:
            raise RuntimeError("initialize() must be called first")
        n_params = len(setup.param_specs)
        if len(contribution.grads) != n_params:
            raise ValueError(
                f"contribution has {len(contribution.grads)} gradients, expected {n_params}"
            )
        # The shard encodes its answer lazily from its slice: safe only because its next
        # commit needs this learner's next complete contribution, so the last answer must
        # have arrived before the trailer (or the buffers) leave.
        self._answers_ended()
        tracker = None
        if self.early_forward:
            tracker = ArrivingTensors(len(self._layout))
            tracker.step = assignment.step
            tracker.stats = self.early_tensors
        self._arriving_next = tracker
        tensors: list[torch.Tensor | None] = [None] * len(self._layout)
        if contribution.n_samples > 0:
            for j, g in enumerate(contribution.grads):
                tensors[j] = None if g is None else _cpu(g)
            for j, b in enumerate(contribution.buffers):
                tensors[n_params + j] = _cpu(b)
        streamed = (
            self._streamed.seal(assignment, contribution, lr) if self._streamed is not None else {}
        )
        ahead = None
        if self.boundary_ahead and self._stale_refusal is None:
            # This iteration's report, as the Boundary after the sync would carry it (the
            # script's metrics of it were logged before the sync).
            ahead = boundary_request(
                self.job_id,
                self.learner_id,
                self._user,
                assignment.generation,
                assignment.step,
                contribution.loss_sum,
                contribution.n_samples,
                ahead=True,
            )
        md = self._md()
        try:
            if self._direct_shards(ahead, md, streamed, tracker):
                headers = self._sync_direct(ahead, assignment, contribution, tensors, lr)
            else:
                headers = self._run(
                    self._sync_and_ahead(
                        ahead, md, assignment, contribution, tensors, lr, md, streamed, tracker
                    )
                )
        except IterationAborted:
            # Report this iteration's loss with the next Boundary anyway: if it was committed
            # after all (a shard died while answering, its backup took over) the coordinator
            # records it; if it was aborted, the coordinator ignores the report. (Assignment
            # k came with the Boundary that carried the report of k - 1, so none is lost.)
            self._report = (
                assignment.generation,
                assignment.step,
                contribution.loss_sum,
                contribution.n_samples,
            )
            raise
        total = headers[0].num_samples if headers else 0
        loss_sum = headers[0].loss_sum if headers else contribution.loss_sum
        self._report = (
            assignment.generation,
            assignment.step,
            contribution.loss_sum,
            contribution.n_samples,
        )
        loss = loss_sum / total if total else float("nan")
        setup = self._setup
        measured = setup is not None and (
            setup.clip_grad_norm is not None or setup.skip_nonfinite or setup.measure_grad_norm
        )
        if tracker is not None:
            self._arriving = tracker
            self.early_tensors[0] += sum(
                1 for j in range(len(self._layout)) if not tracker.is_done(j)
            )
        # Every shard committed with the same global norm and skip decision.
        return SyncResult(
            self._recv[:n_params],
            self._recv[n_params:],
            assignment.step,
            float(loss),
            grad_norm=headers[0].grad_norm if measured and headers else None,
            skipped=any(h.step_skipped for h in headers),
            arriving=tracker,
        )

    async def _sync_and_ahead(
        self, request: ps_pb2.BoundaryRequest | None, md: Any, *sync: Any
    ) -> list[ps_pb2.TensorBundleHeader]:
        """:meth:`_sync`, with the Boundary ``request`` (``ahead``) sent beside it: kept for
        :meth:`next_assignment` when the sync succeeds, cancelled when it fails (the plain
        Boundary after a failed sync carries what the failure said, a stale refusal)."""
        ahead = (
            None
            if request is None
            else asyncio.ensure_future(self.session.control("Boundary", request, md))
        )
        try:
            headers = await self._sync(*sync)
        except BaseException:
            if ahead is not None:
                await _cancelled(ahead)
            raise
        self._ahead = ahead
        return headers

    async def _sync(
        self,
        a: Assignment,
        contribution: Contribution,
        tensors: Sequence[torch.Tensor | None],
        lr: float | None,
        md: Any = None,
        streamed: Mapping[int, Awaitable[ps_pb2.TensorBundleHeader]] | None = None,
        tracker: ArrivingTensors | None = None,
        only: Sequence[_Shard] | None = None,
        sent: Mapping[int, LaneControl] | None = None,
    ) -> list[ps_pb2.TensorBundleHeader]:
        """Every shard's answer header (``only``: those shards'); with ``tracker`` (early
        forward) as soon as every header arrived, the rest of the answers arriving on this
        loop meanwhile. ``sent``: the lane controls (by ``id`` of their shard) the trainer's
        thread sent this iteration's SyncStep on, whose answers are awaited here
        (:meth:`_sync_direct`)."""
        shards = self._shards if only is None else only

        async def one(shard: _Shard) -> ps_pb2.TensorBundleHeader:
            assert shard.streams is not None
            if streamed and id(shard) in streamed:  # sent while backward ran (ps_overlap.py)
                return await streamed[id(shard)]
            if sent and id(shard) in sent:  # sent by the trainer's thread
                control = sent[id(shard)]
                try:
                    return self._lane_answer(shard, await control.answer(lane_control.SYNC_STEP))
                except asyncio.CancelledError:
                    control.close()  # (its answer may still come on it)
                    raise
                except LaneError:
                    pass  # its connection ended: sent again below (a new lane, or chunks)
                except aio.AioRpcError as exc:
                    if not lane_refused(exc):
                        raise
                    # (the shard lost the lane: below, the lane refuses again, then chunks)
            metas, total, header, views = self._bundle(shard, a, contribution, tensors, lr)
            if shard.lane is not None and shard.lane.control is not None:
                if shard.lane.control.closed:
                    # Its control ended (a call cancelled, the shard dropped the lane): a new
                    # lane, with a new control.
                    shard.lane.close()
                    shard.lane, shard.lane_tried = None, False
            if self._shm_lane and not shard.lane_tried:
                shard.lane_tried = True
                shard.lane = await open_lane(
                    shard.stub,
                    job_id=self.job_id,
                    learner_id=self.learner_id,
                    metadata=md or self._metadata,
                    address=shard.address,
                    control=self.lane_control and not shard.no_lane_control,
                )
            if shard.lane is not None and total > 0:
                lane = shard.lane
                try:
                    header.shared_memory = True
                    if total <= self.inline_bytes:  # a small copy: not worth a thread's hop
                        header.shared_memory_offset = lane.write(metas, views, total)
                    else:
                        header.shared_memory_offset = await asyncio.to_thread(
                            lane.write, metas, views, total
                        )
                    request = encode_header(ps_pb2.SyncStepRequest, header)
                    control = lane.control
                    if control is not None and not control.closed and not traced(md):
                        # The lane's control connection (grpc_lane.LaneControl), not gRPC.
                        answer = answer_of(control.sync_step(request))
                        return await self._receive(shard, answer, answer=True)
                    # One message each way (the answer is a header), as SyncStepUnary.
                    unary = shard.streams["SyncStepUnary"](request, metadata=md or self._metadata)
                    return await self._receive(shard, answer_of(unary), answer=True)
                except (aio.AioRpcError, LaneError) as exc:
                    if isinstance(exc, aio.AioRpcError) and not lane_refused(exc):
                        raise
                    # The shard lost the lane (it restarted), or its slice outgrew it, or the
                    # lane's control ended: this iteration goes as chunks, the next asks for a
                    # new lane.
                    ended = lane.control
                    if ended is not None and ended.closed and ended.calls == 0:
                        shard.no_lane_control = True  # (one that never answered: an old shard)
                    log.warning(
                        "shard %s: lane not usable (%s); sending chunks",
                        shard.address,
                        exc.details() if isinstance(exc, aio.AioRpcError) else exc,
                    )
                    shard.lane, shard.lane_tried = None, False
                    lane.close()
                    header.shared_memory, header.shared_memory_offset = False, 0

            header.inline_answer_max_bytes = self.inline_bytes
            if 0 < total <= self.inline_bytes:
                # One message, and the end of the request stream with it (SyncStepOnce).
                header.inline_data = inline_bytes(metas, views, total)
                self.inline_bundles[0] += 1
                if self._answer_bytes(shard) <= self.inline_bytes:
                    # The answer is known to come inline too (any size up to the most a header
                    # carries is asked for, so never in chunks): one message each way, the
                    # answer read with the call's status in one batch (SyncStepUnary).
                    header.inline_answer_max_bytes = MAX_INLINE_BYTES
                    unary = shard.streams["SyncStepUnary"](
                        encode_header(ps_pb2.SyncStepRequest, header), metadata=md or self._metadata
                    )
                    return await self._receive(shard, answer_of(unary), answer=True)
                call = shard.streams["SyncStepOnce"](
                    encode_header(ps_pb2.SyncStepRequest, header), metadata=md or self._metadata
                )
                return await self._receive(shard, call, answer=True)

            async def messages() -> AsyncIterator[bytes]:
                yield encode_header(ps_pb2.SyncStepRequest, header)
                for chunk in encode_chunks(metas, views, total, self._chunk_bytes):
                    yield chunk

            call = shard.streams["SyncStep"](messages(), metadata=md or self._metadata)
            return await self._receive(shard, call, answer=True)

        failed: dict[int, _Shard] = {}  # which shard's stream raised which error

        async def tracked(shard: _Shard) -> ps_pb2.TensorBundleHeader:
            try:
                return await one(shard)
            except aio.AioRpcError as exc:
                failed.setdefault(id(exc), shard)
                raise

        tasks = [asyncio.ensure_future(tracked(s)) for s in shards]
        arriving = False
        try:
            if tracker is None:
                return list(await self._watch(asyncio.gather(*tasks)))
            heads = []
            for shard, task in zip(shards, tasks, strict=True):
                head = tracker.head(id(shard))
                task.add_done_callback(functools.partial(_headless, head))
                heads.append(head)
            headers = list(await self._watch(asyncio.gather(*heads)))
            arriving = True
            # Held here until it ended (the loop keeps only a weak reference to a task).
            self._rest = asyncio.ensure_future(self._rest_of_answers(tasks, tracker))
            return headers
        except CoordinatorMoved as exc:  # a frozen coordinator's shard may be one of them
            raise IterationAborted("the job's coordinator moved") from exc
        except aio.AioRpcError as exc:
            for t in tasks:
                t.cancel()
            raise await self._sync_failed(exc, failed.get(id(exc))) from exc
        finally:
            if not arriving:
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _sync_failed(self, exc: aio.AioRpcError, shard: _Shard | None) -> Exception:
        """What a sync whose call to ``shard`` failed with ``exc`` raises (after the pause
        a lost shard asks for)."""
        error = _translate(exc)
        if isinstance(error, LearnerEvicted):
            self._recheck_coordinator = True  # a stale generation: was it a fenced one's?
            self._stale_refusal = _refusal_of(exc, shard)
        lost = _shard_lost(exc)
        if lost:
            await asyncio.sleep(_SHARD_LOST_PAUSE_S)
        if isinstance(error, IterationAborted | LearnerEvicted) or lost:
            return IterationAborted(_why(exc, shard))
        return error

    def _bundle(
        self,
        shard: _Shard,
        a: Assignment,
        contribution: Contribution,
        tensors: Sequence[torch.Tensor | None],
        lr: float | None,
    ) -> tuple[list[TensorMeta], int, ps_pb2.TensorBundleHeader, list[np.ndarray]]:
        """The bundle of ``tensors`` a SyncStep sends ``shard``: its layout, size, header
        and the tensors' bytes. The layout and the header's fixed part are made once per set
        of tensors present (``_bundles``: the same every iteration)."""
        present = tuple(j for j in shard.tensors if tensors[j] is not None)
        made = self._bundles.get(present)
        if made is None:
            metas, total = pack_layout([self._layout[j] for j in present])
            fixed = header_of(
                job_id=self.job_id, sender_id=self.learner_id, metas=metas, total_bytes=total
            )
            if len(self._bundles) >= 64:  # (gradients present in ever new sets: kept few)
                self._bundles.clear()
            made = self._bundles[present] = (metas, total, fixed)
        metas, total, fixed = made
        header = ps_pb2.TensorBundleHeader()
        header.CopyFrom(fixed)
        header.generation = a.generation
        header.iteration = a.step
        header.num_samples = contribution.n_samples
        header.loss_sum = contribution.loss_sum
        header.learning_rate = lr or 0.0
        views = [byte_view(tensors[j]) for j in present]  # type: ignore[arg-type]
        return metas, total, header, views

    # -- sync on the trainer's thread ---------------------------------------------------------

    def _direct_shards(
        self,
        ahead: ps_pb2.BoundaryRequest | None,
        md: Any,
        streamed: Mapping[int, Any],
        tracker: ArrivingTensors | None,
    ) -> bool:
        """Whether this sync goes on the lanes' control connections from this thread
        (:meth:`_sync_direct`), with the Boundary ``ahead`` beside the SyncStep to the shard
        in the coordinator's process; else on the session's loop (:meth:`_sync_and_ahead`).
        Only the plain case goes direct: every shard's lane control open, nothing streamed
        or arriving early, not traced, and, when a Boundary goes ahead, the coordinator in
        one of those shards' processes (with no re-Join or coordinator check due)."""
        if streamed or tracker is not None or traced(md):
            return False
        for shard in self._shards:
            lane = shard.lane
            if lane is None or lane.control is None or lane.control.closed:
                return False
        return ahead is None or any(self.session.boundary_goes_to(s.address) for s in self._shards)

    def _sync_direct(
        self,
        ahead: ps_pb2.BoundaryRequest | None,
        a: Assignment,
        contribution: Contribution,
        tensors: Sequence[torch.Tensor | None],
        lr: float | None,
    ) -> list[ps_pb2.TensorBundleHeader]:
        """:meth:`_sync_and_ahead` on this thread: each shard's gradients written into its
        lane, its SyncStep (and, to the coordinator's, the Boundary ``ahead``) sent on the
        lane's control connection in one write, and the answers read there as they come,
        with no hop to the session's loop and back (docs/data-plane.md, "The sync on the
        trainer's thread"). Anything else hands the iteration to the loop's :meth:`_sync`,
        which gathers and watches it as ever: answers not in within the watch's first wait
        are awaited there; a shard whose connection ended, or which has no lane of this
        learner any more, gets the iteration again from there (a new lane, or chunks; a
        repeated contribution is ignored) while the others' answers are awaited. A failure
        closes the connections whose answers are still due (as a cancelled call does)."""
        rest: list[_Shard] = []  # sent again from the loop
        sent: list[tuple[_Shard, LaneControl]] = []
        boundary_on: LaneControl | None = None
        for shard in self._shards:
            lane = shard.lane
            assert lane is not None and lane.control is not None
            metas, total, header, views = self._bundle(shard, a, contribution, tensors, lr)
            if total == 0:  # (nothing to write into the lane)
                rest.append(shard)
                continue
            header.shared_memory = True
            header.shared_memory_offset = lane.write(metas, views, total)
            requests = [(lane_control.SYNC_STEP, encode_header(ps_pb2.SyncStepRequest, header))]
            boundary = (
                ahead is not None
                and boundary_on is None
                and self.session.boundary_goes_to(shard.address)
            )
            if boundary:
                assert ahead is not None
                requests.append((lane_control.BOUNDARY, ahead.SerializeToString()))
            try:
                lane.control.send(*requests)
            except LaneError:
                rest.append(shard)
                continue
            sent.append((shard, lane.control))
            if boundary:
                boundary_on = lane.control
                self.session.boundaries_on(shard.address)
        headers: dict[int, ps_pb2.TensorBundleHeader] = {}
        due = [control for _, control in sent]  # closed if this sync fails
        pending = sent
        try:
            deadline = time.monotonic() + self.session.watch_after_s
            while pending and not rest:
                waiting = []
                for shard, control in pending:
                    try:
                        body = control.answered(lane_control.SYNC_STEP)
                    except LaneError:  # (it is closed)
                        rest.append(shard)
                        continue
                    except aio.AioRpcError as exc:
                        due.remove(control)  # (answered: the connection stays)
                        if not lane_refused(exc):
                            raise self._run(self._sync_failed(exc, shard)) from exc
                        rest.append(shard)
                        continue
                    if body is None:
                        waiting.append((shard, control))
                        continue
                    due.remove(control)
                    headers[id(shard)] = self._lane_answer(shard, body)
                pending = waiting
                left = deadline - time.monotonic()
                if not pending or rest or left <= 0:
                    break
                wait_any([control for _, control in pending], min(left, LaneControl.SLICE_S))
            if pending or rest:
                # The loop takes over, as _sync: the answers still due awaited there, the
                # others sent again, all together and watched (at once: this waited already).
                if not rest:
                    self.session.watch_soon()
                shards = sorted([s for s, _ in pending] + rest, key=self._shards.index)
                again = self._run(
                    self._sync(
                        a,
                        contribution,
                        tensors,
                        lr,
                        only=shards,
                        sent={id(shard): control for shard, control in pending},
                    )
                )
                headers.update(zip(map(id, shards), again, strict=True))
        except BaseException:
            for control in {*due, *([boundary_on] if boundary_on is not None else [])}:
                control.close()  # (answers may still come on it: read by nobody)
            raise
        if boundary_on is not None:
            self._ahead = boundary_on
        self.direct_syncs += 1
        return [headers[id(s)] for s in self._shards]

    def _lane_answer(self, shard: _Shard, body: bytes) -> ps_pb2.TensorBundleHeader:
        """A SyncStep's answer that came on ``shard``'s lane control, taken into the receive
        tensors; its header."""
        header = decode_frame(ps_pb2.SyncStepResponse, body).header
        if header is None:
            raise RuntimeError(f"shard {shard.address} answered a SyncStep with no header")
        self._take_answer(shard, header)
        return header

    # -- the rest -----------------------------------------------------------------------------

    def report_epoch(self, report: EpochReport) -> None:
        values = {"test_loss": float(report.loss)}
        values.update({k: float(v) for k, v in report.metrics.items()})
        self.session.report_epoch_metrics(report.epoch, values)

    def close(self) -> None:
        ahead, self._ahead = self._ahead, None
        if isinstance(ahead, asyncio.Future) and not self.session.closed:
            self._run(_cancelled(ahead))  # (a train() that raised after its last sync)
        self.session.close()

    def _require_plan(self) -> TrainingPlan:
        if self._plan is None:
            raise RuntimeError("initialize() must be called first")
        return self._plan


async def _cancelled(call: asyncio.Future[Any]) -> None:
    """Cancel ``call`` and wait until it ended (its error, if any, retrieved)."""
    call.cancel()
    await asyncio.gather(call, return_exceptions=True)


def _headless(head: asyncio.Future[Any], task: asyncio.Future[Any]) -> None:
    """A shard's answer ended before its header was told (it failed): the header's future
    fails alike, so that waiting for every header raises the answer's error."""
    if head.done():
        return
    if task.cancelled():
        head.cancel()
    elif task.exception() is not None:
        head.set_exception(task.exception())  # type: ignore[arg-type]
    else:
        head.set_result(task.result())


def _register() -> None:
    names = set(registered_backends())
    for name in (BACKEND_NAME, "parameter_server"):
        if name not in names:
            register_backend(name, GrpcBackend.from_env)


_register()
