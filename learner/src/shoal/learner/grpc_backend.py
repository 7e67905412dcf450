"""The ``"grpc"`` sync backend: a learner of a job on shoal's parameter-sync shards.

Per learner (see docs/data-plane.md for the protocol):

* :meth:`GrpcBackend.initialize` joins the job at the coordinator with the model's tensor
  layout and the optimizer. The first learner of a new job uploads the initial parameters to
  every shard (``InitializeParameters``); any other learner defers its state to its first
  assignment, which says ``pull_parameters`` (:meth:`GrpcBackend.pull_parameters` streams the
  current values from every shard, ``PullParameters``).
* :meth:`GrpcBackend.next_assignment` is the ``Boundary`` call: it reports the loss of the
  iteration just completed and returns the next assignment (or retire, or None when done).
* :meth:`GrpcBackend.sync` opens one ``SyncStep`` stream per shard, concurrently: the header,
  then this learner's gradients and buffers for that shard's tensors as raw little-endian
  chunks; each shard answers with its new parameters once every member has contributed and
  every shard is ready. ABORTED (a member was evicted), a stale generation, or a shard that is
  down or restarted without the job (UNAVAILABLE, DEADLINE_EXCEEDED, NOT_FOUND on a tensor
  stream, pulls included) raise :class:`~shoal.learner.backend.IterationAborted`: the next
  boundary re-issues the iteration (after the coordinator recovered the shard's slice).

gRPC runs on an asyncio loop in a background thread; the trainer calls in from its own thread.
The environment contract (``shoal.learner.env``): SHOAL_JOB_ID, SHOAL_LEARNER_ID,
SHOAL_COORDINATOR (default: the first of SHOAL_SYNC_ENDPOINTS), SHOAL_TOKEN.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
from grpc import aio

from shoal.client.tls import TLSFiles, channel_credentials
from shoal.contract.shm import LaneError
from shoal.contract.wire import (
    DEFAULT_CHUNK_BYTES,
    BundleReceiver,
    Frame,
    TensorMeta,
    byte_view,
    encode_chunks,
    encode_header,
    header_of,
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
from shoal.learner.env import LearnerEnv
from shoal.learner.grpc_calls import (
    _SHARD_LOST_PAUSE_S,
    MAX_MESSAGE_BYTES,
    LearnerEvicted,
    _bytes_of,
    _copy_sink,
    _cpu,
    _refusal_of,
    _Shard,
    _shard_lost,
    _translate,
    _why,
    optimizer_proto,
    stream_methods,
)
from shoal.learner.grpc_control import CoordinatorFollowing
from shoal.learner.grpc_lane import close_lane, lane_refused, open_lane
from shoal.learner.liveness import WATCH_AFTER_S, WATCH_EVERY_S, CoordinatorMoved
from shoal.learner.ps_overlap import StreamedGradients, overlap_enabled
from shoal.learner.tracing import trace_metadata
from shoal.v1 import (
    job_pb2,
    parameter_sync_service_pb2 as ps_pb2,
    parameter_sync_service_pb2_grpc as ps_grpc,
)

__all__ = [
    "BACKEND_NAME",
    "GrpcBackend",
    "LearnerEvicted",
    "optimizer_proto",
    "stream_methods",
]

log = logging.getLogger("shoal.learner.grpc")
T = TypeVar("T")

BACKEND_NAME = "grpc"


class GrpcBackend(CoordinatorFollowing, SyncBackend):
    """The parameter-server client of one learner (see the module docstring).

    ``channel_options`` are extra gRPC channel options. ``retry_s`` bounds how long the
    control calls (Join, Boundary) retry while the coordinator is unreachable.
    """

    #: The mode this backend joins a job in (the first Join fixes the job's).
    SYNC_MODE: int = job_pb2.SYNC_MODE_PARAMETER_SERVER
    #: A call pending on the coordinator this long starts the liveness probes, one each
    #: ``watch_every_s`` (``shoal.learner.liveness``).
    watch_after_s: float = WATCH_AFTER_S
    watch_every_s: float = WATCH_EVERY_S

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
        for name, value in (
            ("job_id", job_id),
            ("learner_id", learner_id),
            ("coordinator", coordinator),
        ):
            if not value:
                raise ValueError(f"{name} ({value!r}) must be set for the grpc backend")
        self.job_id = job_id
        self.learner_id = learner_id
        self.coordinator = coordinator
        # Every shard (SHOAL_SYNC_ENDPOINTS): asked where the coordinator is when it does not
        # answer (its shard was lost and another took the role over, FindCoordinator).
        self._endpoints = tuple(sync_endpoints)
        self._coordinator_epoch = 0
        # A shard refused this learner's generation: the coordinator that issued it may have
        # been replaced (and fenced); the next control call asks the shards first.
        self._recheck_coordinator = False
        # A shard refused this learner's SyncStep as stale and said its generation floor: the
        # next Boundary tells the coordinator (which re-issues the iteration above the floor if
        # it drifted above its generation; docs/data-plane.md, "Generation floor drift").
        self._stale_refusal: ps_pb2.StaleRefusal | None = None
        # The coordinator moved (FindCoordinator named a newer one): Join it before any other
        # control call; and which shard the next liveness probe asks (shoal.learner.liveness).
        self._rejoin = False
        self._probe_turn = 0
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._tls = tls
        self._chunk_bytes = chunk_bytes
        self._retry_s = retry_s
        self._options = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            *channel_options,
        ]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="shoal-grpc-backend", daemon=True
        )
        self._thread.start()
        self._channels: dict[str, aio.Channel] = {}
        self._setup: TrainingSetup | None = None
        self._plan: TrainingPlan | None = None
        self._layout: list[TensorMeta] = []
        self._shards: list[_Shard] = []
        self._routing_epoch = 0
        self._recv: list[torch.Tensor] = []
        self._recv_bytes: list[np.ndarray] = []
        self._generation = 0  # of the last assignment (pulls are checked against it)
        self._report = (0, -1, 0.0, 0)  # generation, completed iteration, loss_sum, samples
        self._user: tuple[int, Mapping[str, tuple[float, int]]] = (-1, {})  # trainer.log
        self._closed = False
        # Same-host shards: move SyncStep bytes through shared memory (grpc_lane.py).
        self._shm_lane = shm_lane
        # Gradients streamed while backward runs (ps_overlap.py; SHOAL_PS_OVERLAP).
        self.ps_overlap = overlap_enabled()
        self._streamed: StreamedGradients | None = None

    @classmethod
    def from_env(cls, env: LearnerEnv) -> GrpcBackend:
        if env.job_id is None or env.learner_id is None or env.coordinator is None:
            raise ValueError(
                "the grpc backend needs SHOAL_JOB_ID, SHOAL_LEARNER_ID and SHOAL_COORDINATOR "
                f"(or SHOAL_SYNC_ENDPOINTS); got job {env.job_id!r}, learner "
                f"{env.learner_id!r}, coordinator {env.coordinator!r}"
            )
        return cls(
            job_id=env.job_id,
            learner_id=env.learner_id,
            coordinator=env.coordinator,
            token=env.token,
            tls=TLSFiles(env.tls_ca, env.tls_cert, env.tls_key) if env.tls_ca else None,
            sync_endpoints=env.sync_endpoints,
            shm_lane=os.environ.get("SHOAL_SHM_LANE", "on").strip().lower()
            not in ("off", "false", "0"),
        )

    # -- plumbing -----------------------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coro.close()
            raise RuntimeError("the grpc backend is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _channel(self, address: str) -> aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            if self._tls is not None:
                creds = channel_credentials(self._tls.ca, self._tls.cert, self._tls.key)
                channel = aio.secure_channel(address, creds, options=self._options)
            else:
                channel = aio.insecure_channel(address, options=self._options)
            self._channels[address] = channel
        return channel

    def _coordinator_stub(self) -> ps_grpc.ParameterSyncServiceStub:
        return ps_grpc.ParameterSyncServiceStub(self._channel(self.coordinator))

    def _md(self) -> tuple[tuple[str, str], ...]:
        """Call metadata: the token, plus the trace context when the calling thread has a span
        recording (the join, a sampled iteration: ``shoal.learner.tracing``)."""
        return self._metadata + trace_metadata()

    # -- initialize ---------------------------------------------------------------------------

    def _begin(self, setup: TrainingSetup) -> None:
        """Take the learner's setup (once) and lay its tensors out as the job's."""
        if self._setup is not None:
            raise RuntimeError("initialize() was already called on this backend")
        self._setup = setup
        metas = [
            TensorMeta(s.name, s.dtype, tuple(s.shape), 0, s.nbytes, False)
            for s in setup.param_specs
        ] + [
            TensorMeta(s.name, s.dtype, tuple(s.shape), 0, s.nbytes, True)
            for s in setup.buffer_specs
        ]
        self._layout, _ = pack_layout(metas)

    def _adopt_plan(self, reply: ps_pb2.JoinResponse, plan: TrainingPlan) -> TrainingPlan:
        """The plan in force: the job's settings (from the Join reply) win over the script's."""
        self._plan = TrainingPlan(
            epochs=reply.epochs,
            batch_size=reply.batch_size,
            num_samples=plan.num_samples,
            seed=int(reply.seed),
            checkpoint_every=plan.checkpoint_every,
            max_workers=plan.max_workers,
        )
        return self._plan

    def initialize(self, setup: TrainingSetup) -> InitialState:
        self._begin(setup)
        self._recv = [torch.empty(m.shape, dtype=m.torch_dtype) for m in self._layout]
        self._recv_bytes = [_bytes_of(t) for t in self._recv]
        md = self._md()
        reply = self._run(self._join(setup, md))
        plan = self._adopt_plan(reply, setup.plan)
        if reply.initialize:
            log.info("initializing job %s", self.job_id)
            self._run(self._upload(setup, md))
            return InitialState(plan, setup.params, setup.buffers, 0)
        # The state comes with the first assignment (the job keeps training meanwhile).
        return InitialState(plan, None, None, self._run(self._completed(md)))

    async def _completed(self, md: Any = None) -> int:
        request = ps_pb2.GetJobProgressRequest(job_id=self.job_id)
        try:
            reply = await self._control("GetJobProgress", request, md)
        except Exception:  # informational only
            return 0
        return int(reply.progress.completed_iterations)

    async def _join(self, setup: TrainingSetup, md: Any = None) -> ps_pb2.JoinResponse:
        request = ps_pb2.JoinRequest(
            job_id=self.job_id,
            learner_id=self.learner_id,
            layout=[m.to_proto() for m in self._layout],
            optimizer=optimizer_proto(setup),
            dataset_size=setup.plan.num_samples,
            sync_mode=self.SYNC_MODE,  # type: ignore[arg-type]
            **self._join_fields(),
        )
        reply = await self._control("Join", request, md)
        self._rejoin = False
        self._route(reply.shards)
        return reply

    def _join_fields(self) -> dict[str, Any]:
        """More JoinRequest fields of a subclass (the collective backend's state)."""
        return {}

    def _route(self, slices: Sequence[ps_pb2.ShardSlice]) -> None:
        """Which shard holds which tensors (from Join, or a Boundary after a promotion)."""
        index = {m.name: j for j, m in enumerate(self._layout)}
        for old in self._shards:  # a slice may have moved or grown: lanes are asked anew
            if old.lane is not None:
                old.lane.close()
        self._shards = []
        for s in slices:
            if not s.tensor_names:
                continue
            channel = self._channel(s.address)
            self._shards.append(
                _Shard(
                    s.shard_index,
                    s.address,
                    sorted(index[n] for n in s.tensor_names),
                    ps_grpc.ParameterSyncServiceStub(channel),
                    stream_methods(channel),
                )
            )

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

    def _boundary_request(
        self,
        generation: int,
        completed: int = -1,
        loss_sum: float = 0.0,
        n: int = 0,
        **extra: Any,
    ) -> ps_pb2.BoundaryRequest:
        """This learner's Boundary, reporting ``completed`` (-1: none) of ``generation``,
        with what the script logged for that iteration."""
        step, user = self._user
        logged = user if completed >= 0 and completed == step else {}
        return ps_pb2.BoundaryRequest(
            job_id=self.job_id,
            learner_id=self.learner_id,
            generation=generation,
            completed_iteration=completed,
            loss_sum=loss_sum,
            num_samples=n,
            metric_sums={name: total for name, (total, _) in logged.items()},
            metric_samples={name: count for name, (_, count) in logged.items()},
            **extra,
        )

    def log_metrics(self, step: int, metrics: Mapping[str, tuple[float, int]]) -> None:
        self._user = (step, dict(metrics))

    async def _boundary(self, md: Any = None) -> ps_pb2.BoundaryResponse:
        request = self._boundary_request(*self._report)
        refusal, self._stale_refusal = self._stale_refusal, None
        if refusal is not None:
            request.stale_refusal.CopyFrom(refusal)
        reply = await self._control("Boundary", request, md)
        if reply.routing_epoch > self._routing_epoch and reply.shards:
            # A lost shard's slice moved to its backup: send and pull there from now on.
            self._route(reply.shards)
            self._routing_epoch = reply.routing_epoch
            log.warning("shards re-routed (routing epoch %d)", reply.routing_epoch)
        return reply

    def next_assignment(self) -> Assignment | None:
        assignment = self._to_assignment(self._run(self._boundary(self._md())))
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

    def _to_assignment(self, reply: ps_pb2.BoundaryResponse) -> Assignment | None:
        """A RUN, RETIRE or DONE answer as the trainer's :class:`Assignment` (None: done)."""
        plan = self._require_plan()
        if reply.action == ps_pb2.BOUNDARY_ACTION_DONE:
            return None
        if reply.action == ps_pb2.BOUNDARY_ACTION_RETIRE:
            return Assignment.retirement(self._report[0], self._report[1] + 1)
        if reply.action != ps_pb2.BOUNDARY_ACTION_RUN:
            raise RuntimeError(f"unknown boundary action {reply.action}")
        a = reply.assignment
        self._generation = int(a.generation)
        # A coordinator that sends the global batch sends where it starts (positions are kept
        # in samples: with an adaptive batch it is not iteration x B).
        start = int(a.batch_start) if a.global_batch else a.iteration * plan.batch_size
        assignment = Assignment(
            generation=int(a.generation),
            epoch=a.epoch,
            iteration=a.iteration,
            step=int(a.global_iteration),
            rank=a.rank,
            world_size=a.world_size,
            batch_start=start,
            batch_stop=start + a.batch_samples,
            pull_parameters=reply.pull_parameters,
            global_batch=a.global_batch,
            gradient_noise_scale=a.gradient_noise_scale,
        )
        if assignment.share != (a.sample_start, a.sample_end):
            raise RuntimeError(
                f"coordinator's sample range [{a.sample_start}, {a.sample_end}) differs from "
                f"the partition's {assignment.share} (rank {a.rank} of {a.world_size})"
            )
        return assignment

    # -- parameters ---------------------------------------------------------------------------

    def pull_parameters(self) -> ModelState:
        """The job's current parameters and buffers from every shard (for a learner new in
        the generation of its last assignment). The tensors are reused by later calls."""
        setup = self._setup
        if setup is None:
            raise RuntimeError("initialize() must be called first")
        self._run(self._pull(self._generation, self._md()))
        n = len(setup.param_specs)
        return ModelState(self._recv[:n], self._recv[n:])

    async def _pull(self, generation: int, md: Any = None) -> None:
        request = ps_pb2.PullParametersRequest(
            job_id=self.job_id, learner_id=self.learner_id, generation=generation
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

    async def _receive(
        self, shard: _Shard, frames: AsyncIterator[Frame]
    ) -> ps_pb2.TensorBundleHeader:
        """Read a parameter bundle from ``frames`` into the receive tensors."""
        index = {self._layout[j].name: j for j in shard.tensors}
        header: ps_pb2.TensorBundleHeader | None = None
        receiver: BundleReceiver | None = None
        targets: list[int] = []
        async for frame in frames:
            if header is None:
                if frame.header is None:
                    raise RuntimeError(f"shard {shard.address} sent a chunk before the header")
                header = frame.header
                metas = [TensorMeta.from_proto(t) for t in header.tensors]
                for m in metas:
                    j = index.get(m.name)
                    if j is None or not self._layout[j].same_tensor(m):
                        raise RuntimeError(f"shard {shard.address} sent unexpected {m.name!r}")
                    targets.append(j)
                receiver = BundleReceiver(
                    metas, header.total_bytes, _copy_sink(self._recv_bytes, targets)
                )
                if header.shared_memory:  # the bytes are in this learner's lane
                    if shard.lane is None:
                        raise RuntimeError(f"shard {shard.address} answered through no lane")
                    await asyncio.to_thread(shard.lane.read, header, receiver)
            elif frame.chunk is not None:
                assert receiver is not None
                if header.shared_memory:
                    raise RuntimeError(f"shard {shard.address} sent a chunk after its lane header")
                receiver.feed(frame.chunk)
        if header is None or receiver is None:
            raise RuntimeError(f"shard {shard.address} closed the stream without a header")
        receiver.finish()
        return header

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
        tensors: list[torch.Tensor | None] = [None] * len(self._layout)
        if contribution.n_samples > 0:
            for j, g in enumerate(contribution.grads):
                tensors[j] = None if g is None else _cpu(g)
            for j, b in enumerate(contribution.buffers):
                tensors[n_params + j] = _cpu(b)
        streamed = (
            self._streamed.seal(assignment, contribution, lr) if self._streamed is not None else {}
        )
        try:
            headers = self._run(
                self._sync(assignment, contribution, tensors, lr, self._md(), streamed)
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
        # Every shard committed with the same global norm and skip decision.
        return SyncResult(
            self._recv[:n_params],
            self._recv[n_params:],
            assignment.step,
            float(loss),
            grad_norm=headers[0].grad_norm if measured and headers else None,
            skipped=any(h.step_skipped for h in headers),
        )

    async def _sync(
        self,
        a: Assignment,
        contribution: Contribution,
        tensors: Sequence[torch.Tensor | None],
        lr: float | None,
        md: Any = None,
        streamed: Mapping[int, Awaitable[ps_pb2.TensorBundleHeader]] | None = None,
    ) -> list[ps_pb2.TensorBundleHeader]:
        async def one(shard: _Shard) -> ps_pb2.TensorBundleHeader:
            assert shard.streams is not None
            if streamed and id(shard) in streamed:  # sent while backward ran (ps_overlap.py)
                return await streamed[id(shard)]
            present = [j for j in shard.tensors if tensors[j] is not None]
            metas, total = pack_layout([self._layout[j] for j in present])
            header = header_of(
                job_id=self.job_id,
                sender_id=self.learner_id,
                metas=metas,
                total_bytes=total,
                generation=a.generation,
                iteration=a.step,
                num_samples=contribution.n_samples,
                loss_sum=contribution.loss_sum,
                learning_rate=lr or 0.0,
            )

            views = [byte_view(tensors[j]) for j in present]  # type: ignore[arg-type]
            if self._shm_lane and not shard.lane_tried:
                shard.lane_tried = True
                shard.lane = await open_lane(
                    shard.stub,
                    job_id=self.job_id,
                    learner_id=self.learner_id,
                    metadata=md or self._metadata,
                    address=shard.address,
                )
            if shard.lane is not None and total > 0:
                lane = shard.lane
                try:
                    header.shared_memory = True
                    header.shared_memory_offset = await asyncio.to_thread(
                        lane.write, metas, views, total
                    )
                    call = shard.streams["SyncStep"](
                        _one(encode_header(ps_pb2.SyncStepRequest, header)),
                        metadata=md or self._metadata,
                    )
                    return await self._receive(shard, call)
                except (aio.AioRpcError, LaneError) as exc:
                    if isinstance(exc, aio.AioRpcError) and not lane_refused(exc):
                        raise
                    # The shard lost the lane (it restarted), or its slice outgrew it: this
                    # iteration goes as chunks, the next asks for a new lane.
                    log.warning(
                        "shard %s: lane not usable (%s); sending chunks",
                        shard.address,
                        exc.details() if isinstance(exc, aio.AioRpcError) else exc,
                    )
                    shard.lane, shard.lane_tried = None, False
                    lane.close()
                    header.shared_memory, header.shared_memory_offset = False, 0

            async def messages() -> AsyncIterator[bytes]:
                yield encode_header(ps_pb2.SyncStepRequest, header)
                for chunk in encode_chunks(metas, views, total, self._chunk_bytes):
                    yield chunk

            call = shard.streams["SyncStep"](messages(), metadata=md or self._metadata)
            return await self._receive(shard, call)

        failed: dict[int, _Shard] = {}  # which shard's stream raised which error

        async def tracked(shard: _Shard) -> ps_pb2.TensorBundleHeader:
            try:
                return await one(shard)
            except aio.AioRpcError as exc:
                failed.setdefault(id(exc), shard)
                raise

        tasks = [asyncio.ensure_future(tracked(s)) for s in self._shards]
        try:
            return list(await self._watch(asyncio.gather(*tasks)))
        except CoordinatorMoved as exc:  # a frozen coordinator's shard may be one of them
            raise IterationAborted("the job's coordinator moved") from exc
        except aio.AioRpcError as exc:
            for t in tasks:
                t.cancel()
            error = _translate(exc)
            if isinstance(error, LearnerEvicted):
                self._recheck_coordinator = True  # a stale generation: was it a fenced one's?
                self._stale_refusal = _refusal_of(exc, failed.get(id(exc)))
            lost = _shard_lost(exc)
            if lost:
                await asyncio.sleep(_SHARD_LOST_PAUSE_S)
            if isinstance(error, IterationAborted | LearnerEvicted) or lost:
                raise IterationAborted(_why(exc, failed.get(id(exc)))) from exc
            raise error from exc
        finally:
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- the rest -----------------------------------------------------------------------------

    def report_epoch(self, report: EpochReport) -> None:
        values = {"test_loss": float(report.loss)}
        values.update({k: float(v) for k, v in report.metrics.items()})
        request = ps_pb2.ReportEpochMetricsRequest(
            job_id=self.job_id, learner_id=self.learner_id, epoch=report.epoch, values=values
        )
        try:
            self._run(self._control("ReportEpochMetrics", request))
        except Exception as exc:  # metrics are best effort: never stop training for them
            log.warning("epoch %d metrics not recorded: %s", report.epoch, exc)

    def close(self) -> None:
        if self._closed:
            return

        async def shutdown() -> None:
            lanes = [s for s in self._shards if s.lane is not None]
            await asyncio.gather(
                *(
                    close_lane(
                        s.stub,
                        s.lane,
                        job_id=self.job_id,
                        learner_id=self.learner_id,
                        md=self._metadata,
                    )
                    for s in lanes
                ),
                return_exceptions=True,
            )
            for s in lanes:
                s.lane = None
            for channel in self._channels.values():
                await channel.close()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=5)
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()

    def _require_plan(self) -> TrainingPlan:
        if self._plan is None:
            raise RuntimeError("initialize() must be called first")
        return self._plan


async def _one(message: bytes) -> AsyncIterator[bytes]:
    yield message


def _register() -> None:
    names = set(registered_backends())
    for name in (BACKEND_NAME, "parameter_server"):
        if name not in names:
            register_backend(name, GrpcBackend.from_env)


_register()
